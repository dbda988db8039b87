#include "checkpoint/compatibility.h"

#include <algorithm>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>

#include "checkpoint/optimizer_state.h"
#include "common/check.h"

namespace fsdp_muon::checkpoint {
namespace {

// "[fsdp_muon, adamw]"
std::string saved_kinds(const SavedMeta& saved) {
  std::string s;
  for (size_t o = 0; o < saved.optimizers.size(); ++o) {
    s += (o ? ", " : "") + saved.optimizers[o].kind;
  }
  return "[" + s + "]";
}

// "[a, b, c, d, e, f, ...]": at most six names, enough to see where two lists part.
std::string first_names(const std::vector<std::string>& names) {
  std::string s = "[";
  for (size_t k = 0; k < std::min<size_t>(names.size(), 6); ++k) {
    s += (k ? ", " : "") + names[k];
  }
  return s + (names.size() > 6 ? ", ..." : "") + "]";
}

}  // namespace

void check_same_model(const SavedMeta& saved, const ModelIndex& model) {
  std::vector<std::string> problems;
  for (const auto& group : model.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const ParameterSlot& slot = group->slot(i);
      auto it = saved.by_name.find(slot.name);
      if (it == saved.by_name.end()) {
        problems.push_back("parameter '" + slot.name + "' (shape " +
                           c10::str(c10::IntArrayRef(slot.shape)) + ") is not in the checkpoint");
        continue;
      }
      const SavedParam& p = saved.groups[it->second.first].params[it->second.second];
      if (p.shape != slot.shape) {
        problems.push_back("parameter '" + slot.name + "' has shape " +
                           c10::str(c10::IntArrayRef(p.shape)) + " in the checkpoint but " +
                           c10::str(c10::IntArrayRef(slot.shape)) + " in this model");
      }
    }
  }
  for (const auto& [name, where] : saved.by_name) {
    if (model.by_name.count(name) == 0) {
      const SavedParam& p = saved.groups[where.first].params[where.second];
      problems.push_back("checkpoint parameter '" + name + "' (shape " +
                         c10::str(c10::IntArrayRef(p.shape)) + ") is not in this model");
    }
  }
  if (problems.empty()) return;
  std::sort(problems.begin(), problems.end());
  std::ostringstream msg;
  msg << detail::ApiPrefix{} << saved.path << " is a checkpoint of another model: ";
  const size_t shown = std::min<size_t>(problems.size(), 8);
  for (size_t i = 0; i < shown; ++i) msg << (i ? "; " : "") << problems[i];
  if (shown < problems.size()) msg << "; and " << problems.size() - shown << " more";
  TORCH_CHECK(false, msg.str());
}

void check_same_optimizers(const SavedMeta& saved, const ModelIndex& model,
                           const std::vector<OptimizerEntry>& opts) {
  FSDP_MUON_CHECK(saved.optimizers.size() == opts.size(), saved.path, " holds ",
                  saved.optimizers.size(), " optimizer(s) ", saved_kinds(saved), " but ",
                  opts.size(),
                  " were given; pass the same optimizers, in the same order, as when saving");
  for (size_t o = 0; o < opts.size(); ++o) {
    const SavedOptimizer& s = saved.optimizers[o];
    FSDP_MUON_CHECK(s.kind == kind_name(opts[o].kind), "optimizer ", o, " is '", s.kind,
                    "' in the checkpoint but '", kind_name(opts[o].kind), "' here");
    FSDP_MUON_CHECK(s.param_groups.size() == opts[o].param_groups.size(), "optimizer ", o, " (",
                    s.kind, ") has ", s.param_groups.size(),
                    " param group(s) in the checkpoint but ", opts[o].param_groups.size(), " here");
    for (size_t j = 0; j < s.param_groups.size(); ++j) {
      std::vector<std::string> live;
      for (const ParamRef& ref : opts[o].param_groups[j]) live.push_back(model.slot(ref).name);
      FSDP_MUON_CHECK(s.param_groups[j] == live, "optimizer ", o, " (", s.kind, "), param group ",
                      j, " holds different parameters in the checkpoint than here: saved ",
                      first_names(s.param_groups[j]), ", here ", first_names(live));
    }
  }
}

std::string other_job_reason(const SavedMeta& saved, const ModelIndex& model,
                             const std::vector<OptimizerEntry>& opts, const std::string& run_id) {
  if (saved.run_id && *saved.run_id != run_id) {
    return "run id '" + *saved.run_id + "' there, '" + run_id + "' here";
  }
  try {
    check_same_model(saved, model);
    check_same_optimizers(saved, model, opts);
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    const std::string prefix = c10::str(detail::ApiPrefix{});
    if (msg.rfind(prefix, 0) == 0) msg = msg.substr(prefix.size());
    return msg;
  }
  return "";
}

std::vector<std::string> describe_for_save(const ModelIndex& model,
                                           const std::vector<OptimizerEntry>& opts,
                                           bool with_state) {
  std::vector<std::string> lines;
  lines.push_back("groups = " + std::to_string(model.groups.size()));
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    std::ostringstream line;
    line << "group " << g << " = '" << group->name() << "', " << group->num_parameters()
         << " parameter(s), " << group->padded_numel() << " elements, main "
         << c10::toString(group->main_dtype());
    lines.push_back(line.str());
  }
  lines.push_back("optimizers = " + std::to_string(opts.size()));
  for (size_t o = 0; o < opts.size(); ++o) {
    const std::string which = "optimizer " + std::to_string(o);
    lines.push_back(which + " = " + kind_name(opts[o].kind) + ", " +
                    std::to_string(opts[o].param_groups.size()) + " param group(s)");
    for (size_t j = 0; j < opts[o].param_groups.size(); ++j) {
      std::string names;
      for (const ParamRef& ref : opts[o].param_groups[j]) {
        names += (names.empty() ? "" : ", ") + model.slot(ref).name;
      }
      lines.push_back(which + ", param group " + std::to_string(j) + " = [" + names + "]");
      if (!with_state) continue;
      for (const ParamRef& ref : opts[o].param_groups[j]) {
        const ParamState st = read_state(opts[o], model.shard(ref));
        std::string state = "none";
        if (st.present) {
          state = "step " + std::to_string(st.step) + ", [";
          for (size_t k = 0; k < st.tensors.size(); ++k) {
            state += (k ? ", " : "") + st.tensors[k].first;
          }
          state += "]";
        }
        lines.push_back(which + ", state of '" + model.slot(ref).name + "' = " + state);
      }
    }
  }
  return lines;
}

}  // namespace fsdp_muon::checkpoint
