#include "checkpoint/metadata.h"

#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "checkpoint/optimizer_state.h"
#include "common/check.h"

namespace fsdp_muon::checkpoint {
namespace {

c10::impl::GenericDict new_dict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

c10::impl::GenericList new_list() { return c10::impl::GenericList(c10::AnyType::get()); }

c10::IValue int_list(const std::vector<int64_t>& values) {
  c10::impl::GenericList list = new_list();
  for (int64_t v : values) list.push_back(c10::IValue(v));
  return list;
}

c10::IValue bytes_tensor(const std::vector<char>& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

void corrupt(const std::string& path, const std::string& detail) {
  FSDP_MUON_CHECK(false, path, " is corrupt or not an fsdp_muon checkpoint file: ", detail);
}

c10::impl::GenericDict describe(const ModelIndex& model, const std::vector<OptimizerEntry>& opts) {
  c10::impl::GenericDict meta = new_dict();
  meta.insert("format", kFormatName);
  meta.insert("format_version", kFormatVersion);
  meta.insert("world_size", static_cast<int64_t>(model.comm->size()));
  c10::impl::GenericList groups = new_list();
  for (const auto& group : model.groups) {
    c10::impl::GenericDict g = new_dict();
    g.insert("name", group->name());
    g.insert("main_dtype", std::string(c10::toString(group->main_dtype())));
    g.insert("compute_dtype", std::string(c10::toString(group->compute_dtype())));
    g.insert("padded_numel", group->padded_numel());
    g.insert("shard_numel", group->shard_numel());
    c10::impl::GenericList params = new_list();
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const ParameterSlot& slot = group->slot(i);
      c10::impl::GenericDict p = new_dict();
      p.insert("name", slot.name);
      p.insert("shape", int_list(slot.shape));
      p.insert("numel", slot.numel);
      p.insert("offset", slot.offset);
      params.push_back(p);
    }
    g.insert("params", params);
    groups.push_back(g);
  }
  meta.insert("groups", groups);

  c10::impl::GenericList optimizers = new_list();
  for (const OptimizerEntry& opt : opts) {
    c10::impl::GenericDict o = new_dict();
    o.insert("kind", std::string(kind_name(opt.kind)));
    c10::impl::GenericList param_groups = new_list();
    c10::impl::GenericDict state = new_dict();
    const auto& live = opt.optimizer->param_groups();
    for (size_t j = 0; j < opt.param_groups.size(); ++j) {
      c10::impl::GenericDict pg = new_dict();
      c10::impl::GenericList names = new_list();
      for (const ParamRef& ref : opt.param_groups[j]) {
        const std::string& name = model.slot(ref).name;
        names.push_back(name);
        const ParamState s = read_state(opt, model.shard(ref));
        if (!s.present) continue;
        c10::impl::GenericDict entry = new_dict();
        entry.insert("step", s.step);
        c10::impl::GenericList keys = new_list();
        for (const auto& kv : s.tensors) keys.push_back(kv.first);
        entry.insert("keys", keys);
        state.insert(name, entry);
      }
      pg.insert("params", names);
      pg.insert("options", bytes_tensor(options_to_bytes(live[j].options())));
      param_groups.push_back(pg);
    }
    o.insert("param_groups", param_groups);
    o.insert("state", state);
    optimizers.push_back(o);
  }
  meta.insert("optimizers", optimizers);
  return meta;
}

Fields::Fields(const c10::IValue& value, std::string path, std::string where)
    : dict_(new_dict()), path_(std::move(path)), where_(std::move(where)) {
  if (!value.isGenericDict()) corrupt(path_, "expected a dict" + where_);
  dict_ = value.toGenericDict();
}

bool Fields::has(const char* key) const { return dict_.contains(c10::IValue(std::string(key))); }

const c10::IValue& Fields::at(const char* key) const {
  auto it = dict_.find(c10::IValue(std::string(key)));
  if (it == dict_.end()) corrupt(path_, std::string("field '") + key + "' is missing" + where_);
  return it->value();
}

int64_t Fields::integer(const char* key) const {
  const c10::IValue& v = at(key);
  if (!v.isInt()) corrupt(path_, std::string("field '") + key + "' is not an integer" + where_);
  return v.toInt();
}

std::string Fields::str(const char* key) const {
  const c10::IValue& v = at(key);
  if (!v.isString()) corrupt(path_, std::string("field '") + key + "' is not a string" + where_);
  return v.toStringRef();
}

std::vector<c10::IValue> Fields::list(const char* key) const {
  const c10::IValue& v = at(key);
  if (!v.isList()) corrupt(path_, std::string("field '") + key + "' is not a list" + where_);
  const auto ref = v.toListRef();
  return std::vector<c10::IValue>(ref.begin(), ref.end());
}

std::vector<int64_t> Fields::ints(const char* key) const {
  std::vector<int64_t> out;
  for (const c10::IValue& v : list(key)) {
    if (!v.isInt()) corrupt(path_, std::string("field '") + key + "' holds a non-integer" + where_);
    out.push_back(v.toInt());
  }
  return out;
}

Fields Fields::dict(const char* key) const {
  return Fields(at(key), path_, std::string(" (in '") + key + "'" + where_ + ")");
}

SavedMeta parse_meta(const c10::IValue& value, const std::string& path, bool manifest) {
  SavedMeta meta;
  meta.path = path;
  const Fields top(value, path);
  if (!top.has("format") || !top.at("format").isString() || top.str("format") != kFormatName) {
    corrupt(path, std::string("it does not say format '") + kFormatName + "'");
  }
  const int64_t version = top.integer("format_version");
  if (version < 1) corrupt(path, "format_version < 1");
  FSDP_MUON_CHECK(version <= kFormatVersion, path, " has format version ", version,
                  ", written by a newer fsdp_muon; this one reads versions up to ", kFormatVersion);
  meta.version = version;
  if (version >= 2) {
    meta.save_id = top.str("save_id");
    if (meta.save_id.empty()) corrupt(path, "empty save_id");
  }
  meta.world_size = static_cast<int>(top.integer("world_size"));
  if (meta.world_size < 1) corrupt(path, "world_size < 1");
  for (const c10::IValue& gv : top.list("groups")) {
    const Fields g(gv, path, " (a group)");
    SavedGroup group;
    group.name = g.str("name");
    group.padded_numel = g.integer("padded_numel");
    group.shard_numel = g.integer("shard_numel");
    if (group.shard_numel * meta.world_size != group.padded_numel) {
      corrupt(path, "group '" + group.name + "': shard_numel x world_size != padded_numel");
    }
    for (const c10::IValue& pv : g.list("params")) {
      const Fields p(pv, path, " (a parameter of group '" + group.name + "')");
      SavedParam param;
      param.name = p.str("name");
      param.shape = p.ints("shape");
      param.numel = p.integer("numel");
      param.offset = p.integer("offset");
      if (param.offset < 0 || param.numel < 0 || param.offset + param.numel > group.padded_numel) {
        corrupt(path, "parameter '" + param.name + "' lies outside its group's buffer");
      }
      meta.by_name[param.name] = {meta.groups.size(), group.params.size()};
      group.params.push_back(std::move(param));
    }
    meta.groups.push_back(std::move(group));
  }
  for (const c10::IValue& ov : top.list("optimizers")) {
    const Fields o(ov, path, " (an optimizer)");
    SavedOptimizer opt;
    opt.kind = o.str("kind");
    for (const c10::IValue& pgv : o.list("param_groups")) {
      const Fields pg(pgv, path, " (a param group of an optimizer)");
      std::vector<std::string> names;
      for (const c10::IValue& n : pg.list("params")) {
        if (!n.isString()) corrupt(path, "a parameter name is not a string");
        names.push_back(n.toStringRef());
      }
      const c10::IValue& ov2 = pg.at("options");
      if (!ov2.isTensor() || ov2.toTensor().scalar_type() != at::kByte) {
        corrupt(path, "param group options are not a byte tensor");
      }
      const at::Tensor bytes = ov2.toTensor().contiguous();
      const char* data = reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>());
      opt.param_groups.push_back(std::move(names));
      opt.options.emplace_back(data, data + bytes.numel());
    }
    const Fields state = o.dict("state");
    for (const auto& item : state.raw()) {
      if (!item.key().isString()) corrupt(path, "optimizer state key is not a string");
      const Fields s(item.value(), path, " (state of '" + item.key().toStringRef() + "')");
      SavedState saved;
      saved.step = s.integer("step");
      for (const c10::IValue& k : s.list("keys")) {
        if (!k.isString()) corrupt(path, "a state key is not a string");
        saved.keys.push_back(k.toStringRef());
      }
      opt.state.emplace(item.key().toStringRef(), std::move(saved));
    }
    meta.optimizers.push_back(std::move(opt));
  }
  if (manifest) {
    meta.sequence = top.integer("sequence");
    for (const c10::IValue& f : top.list("rank_files")) {
      if (!f.isString()) corrupt(path, "a rank file name is not a string");
      meta.rank_files.push_back(f.toStringRef());
    }
    meta.rank_file_bytes = top.ints("rank_file_bytes");
    if (static_cast<int>(meta.rank_files.size()) != meta.world_size ||
        static_cast<int>(meta.rank_file_bytes.size()) != meta.world_size) {
      corrupt(path, "it does not list one rank file per saved rank");
    }
    if (version >= 2) {
      // Written since the job identity (docs/DESIGN.md §6); older version 2 manifests lack it.
      if (top.has("run_id")) meta.run_id = top.str("run_id");
      const Fields user = top.dict("user_state");
      for (const auto& item : user.raw()) {
        if (!item.key().isString()) corrupt(path, "a user_state key is not a string");
        const std::string& key = item.key().toStringRef();
        if (item.value().isInt()) {
          meta.user_state.ints[key] = item.value().toInt();
        } else if (item.value().isString()) {
          meta.user_state.strings[key] = item.value().toStringRef();
        } else {
          corrupt(path, "user_state '" + key + "' is neither an integer nor a string");
        }
      }
    }
  }
  return meta;
}

}  // namespace fsdp_muon::checkpoint
