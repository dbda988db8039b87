// Full export and import: one file of full tensors by parameter name, LibTorch pickle format
// (what torch.save writes and torch.load reads).

#include <fsdp_muon/checkpoint/checkpoint.h>

#include <algorithm>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include "checkpoint/file_io.h"
#include "checkpoint/model_index.h"
#include "comm/agreement.h"

namespace fsdp_muon {
using namespace checkpoint;

namespace {

// The state keys an optimizer of this kind creates for a parameter of param group `options`
// (what an imported state must hold to be complete).
std::vector<std::string> required_keys(OptimizerKind kind,
                                       const torch::optim::OptimizerOptions& options) {
  switch (kind) {
    case OptimizerKind::kFsdpMuon:
      return {"momentum_buffer"};
    case OptimizerKind::kAdamW: {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(options);
      if (o.amsgrad()) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
      return {"exp_avg", "exp_avg_sq"};
    }
    case OptimizerKind::kAdam: {
      const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
      if (o.amsgrad()) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
      return {"exp_avg", "exp_avg_sq"};
    }
    case OptimizerKind::kSgd:
      return {"momentum_buffer"};
  }
  return {};
}

}  // namespace

void export_full_checkpoint(const std::string& path,
                            const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                            const std::vector<torch::optim::Optimizer*>& optimizers) {
  TORCH_CHECK(!groups.empty() && groups[0], "export_full_checkpoint: no parameter groups given");
  Communicator& comm = *groups[0]->communicator();
  const char* fn = "export_full_checkpoint";
  const int me = comm.rank();
  ModelIndex model;
  std::vector<OptimizerEntry> opts;
  detail::run_agreed(comm, fn, [&] {
    model = index_model(groups, fn);
    opts = index_optimizers(optimizers, model, fn);
  });

  c10::Dict<std::string, at::Tensor> out;
  auto add = [&](const std::string& key, const at::Tensor& t) {
    TORCH_CHECK(!out.contains(key), fn, ": two tensors would be named '", key,
                "'; rename the parameter that clashes");
    out.insert(key, t);
  };

  // Weights: one all-gather of the main-weight shards per group.
  std::vector<std::vector<at::Tensor>> full_weights(model.groups.size());
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    const at::Tensor& shard = group->main_weight_shard();
    at::Tensor full = at::empty({group->padded_numel()}, shard.options());
    comm.all_gather(shard.contiguous(), full);
    if (me != 0) continue;
    full = full.cpu();
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const ParameterSlot& slot = group->slot(i);
      full_weights[g].push_back(full.narrow(0, slot.offset, slot.numel).view(slot.shape).clone());
    }
  }

  // Optimizer state: which parameters have it (any rank) and their step, then one all-gather
  // per (optimizer, group, state key) of a shard-shaped buffer.
  std::vector<std::pair<std::string, at::Tensor>> state_tensors;
  for (size_t o = 0; o < opts.size(); ++o) {
    const OptimizerEntry& opt = opts[o];
    const auto& keys = state_keys(opt.kind);
    std::vector<ParamRef> refs;
    for (const auto& pg : opt.param_groups) refs.insert(refs.end(), pg.begin(), pg.end());
    const int64_t n = static_cast<int64_t>(refs.size());
    const int64_t nk = static_cast<int64_t>(keys.size());
    // Per parameter: [present, step, has key 0, has key 1, ...]
    at::Tensor flags = at::zeros({n * (2 + nk)}, at::kLong);
    std::vector<ParamState> local(refs.size());
    auto* f = flags.data_ptr<int64_t>();
    for (int64_t k = 0; k < n; ++k) {
      local[k] = read_state(opt, model.shard(refs[k]));
      if (!local[k].present) continue;
      f[k * (2 + nk)] = 1;
      f[k * (2 + nk) + 1] = local[k].step;
      for (const auto& [key, t] : local[k].tensors) {
        const auto pos = std::find(keys.begin(), keys.end(), key) - keys.begin();
        f[k * (2 + nk) + 2 + pos] = 1;
      }
    }
    if (n > 0) {
      at::Tensor reduced = flags.to(comm.device());
      comm.all_reduce(reduced, ReduceOp::kMax);
      flags = reduced.cpu();
      f = flags.data_ptr<int64_t>();
    }
    for (size_t g = 0; g < model.groups.size(); ++g) {
      const auto& group = model.groups[g];
      for (int64_t kk = 0; kk < nk; ++kk) {
        bool any = false;
        for (int64_t k = 0; k < n; ++k) any |= refs[k].group == g && f[k * (2 + nk) + 2 + kk];
        if (!any) continue;
        at::Tensor buffer = at::zeros({group->shard_numel()}, group->main_weight_shard().options());
        for (int64_t k = 0; k < n; ++k) {
          if (refs[k].group != g) continue;
          for (const auto& [key, t] : local[k].tensors) {
            if (key != keys[kk] || t.numel() == 0) continue;
            TORCH_CHECK(t.numel() == model.shard(refs[k]).numel(), fn, ": state '", key, "' of '",
                        model.slot(refs[k]).name, "' is not elementwise");
            buffer.narrow(0, group->shard_offset(refs[k].index, me), t.numel())
                .copy_(t.reshape({-1}));
          }
        }
        at::Tensor full = at::empty({group->padded_numel()}, buffer.options());
        comm.all_gather(buffer, full);
        if (me != 0) continue;
        full = full.cpu();
        for (int64_t k = 0; k < n; ++k) {
          if (refs[k].group != g || !f[k * (2 + nk) + 2 + kk]) continue;
          const ParameterSlot& slot = model.slot(refs[k]);
          state_tensors.emplace_back(
              slot.name + "." + keys[kk],
              full.narrow(0, slot.offset, slot.numel).view(slot.shape).clone());
        }
      }
    }
    if (me == 0 && has_step(opt.kind)) {
      for (int64_t k = 0; k < n; ++k) {
        if (!f[k * (2 + nk)]) continue;
        state_tensors.emplace_back(model.slot(refs[k]).name + ".step",
                                   at::scalar_tensor(f[k * (2 + nk) + 1], at::kLong));
      }
    }
  }

  detail::run_agreed(comm, fn, [&] {
    if (me != 0) return;
    // Parameter order, each followed by its state: the file reads like the model.
    std::unordered_map<std::string, std::vector<std::pair<std::string, at::Tensor>>> by_param;
    for (auto& [key, t] : state_tensors) {
      const auto dot = key.rfind('.');
      by_param[key.substr(0, dot)].emplace_back(key, t);
    }
    for (size_t g = 0; g < model.groups.size(); ++g) {
      for (size_t i = 0; i < model.groups[g]->num_parameters(); ++i) {
        const std::string& name = model.groups[g]->slot(i).name;
        add(name, full_weights[g][i]);
        for (const auto& [key, t] : by_param[name]) add(key, t);
      }
    }
    const auto slash = path.rfind('/');
    if (slash != std::string::npos && slash > 0) make_directories(path.substr(0, slash));
    const std::vector<char> bytes = pickle_save_plain(c10::IValue(out));
    write_file_atomic(path, {{bytes.data(), bytes.size()}});
  });
}

void import_full_checkpoint(const std::string& path,
                            const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                            const std::vector<torch::optim::Optimizer*>& optimizers,
                            const ImportCheckpointOptions& options) {
  TORCH_CHECK(!groups.empty() && groups[0], "import_full_checkpoint: no parameter groups given");
  Communicator& comm = *groups[0]->communicator();
  const char* fn = "import_full_checkpoint";
  ModelIndex model;
  std::vector<OptimizerEntry> opts;
  std::vector<std::vector<at::Tensor>> weights;  // [group][param]: this rank's slice
  std::vector<std::vector<ParamState>> states;   // [optimizer][flat param]
  std::vector<std::vector<bool>> touch;          // [optimizer][flat param]: install or keep
  detail::run_agreed(comm, fn, [&] {
    model = index_model(groups, fn);
    opts = index_optimizers(optimizers, model, fn);
    const std::vector<char> bytes = read_whole_file(path);
    c10::IValue value;
    try {
      value = torch::pickle_load(bytes);
    } catch (...) {
      TORCH_CHECK(false, fn, ": ", path, " is not a readable torch.save / pickle file (",
                  bytes.size(),
                  " bytes; truncated or corrupt?): ", detail::current_exception_message());
    }
    TORCH_CHECK(value.isGenericDict(), fn, ": ", path, " holds a ", value.tagKind(),
                ", not a dict of tensors by parameter name");
    std::unordered_map<std::string, at::Tensor> tensors;
    for (const auto& item : value.toGenericDict()) {
      TORCH_CHECK(item.key().isString(), fn, ": ", path, " has a key that is not a string");
      if (!item.value().isTensor()) {
        TORCH_CHECK(!options.strict(), fn, ": ", path, " entry '", item.key().toStringRef(),
                    "' is a ", item.value().tagKind(),
                    ", not a tensor (pass strict(false) to "
                    "ignore it)");
        continue;
      }
      tensors.emplace(item.key().toStringRef(), item.value().toTensor());
    }
    std::set<std::string> used;
    auto slice = [](const at::Tensor& full, int64_t a, int64_t b) {
      return full.reshape({-1}).slice(0, a, b).to(at::kCPU).contiguous();
    };
    for (const auto& group : model.groups) {
      std::vector<at::Tensor> w;
      for (size_t i = 0; i < group->num_parameters(); ++i) {
        const ParameterSlot& slot = group->slot(i);
        auto it = tensors.find(slot.name);
        TORCH_CHECK(it != tensors.end(), fn, ": ", path, " has no tensor '", slot.name,
                    "' (parameter ", i, " of group '", group->name(), "', shape ",
                    shape_string(slot.shape), ")");
        TORCH_CHECK(it->second.sizes().vec() == slot.shape, fn, ": ", path, " tensor '", slot.name,
                    "' has shape ", shape_string(it->second.sizes()),
                    " but the parameter has shape ", shape_string(slot.shape));
        used.insert(slot.name);
        const auto [a, b] = group->held_range(i);
        w.push_back(slice(it->second, a, b));
      }
      weights.push_back(std::move(w));
    }
    for (const OptimizerEntry& opt : opts) {
      std::vector<ParamState> per_param;
      std::vector<bool> install;
      const auto& live = opt.optimizer->param_groups();
      for (size_t j = 0; j < opt.param_groups.size(); ++j) {
        for (const ParamRef& ref : opt.param_groups[j]) {
          const ParameterSlot& slot = model.slot(ref);
          ParamState state;
          std::vector<std::string> found, missing;
          for (const std::string& key : state_keys(opt.kind)) {
            if (tensors.count(slot.name + "." + key)) found.push_back(key);
          }
          const bool has_step_tensor = tensors.count(slot.name + ".step") > 0;
          const bool any = !found.empty() || has_step_tensor;
          if (any && options.optimizer_state()) {
            for (const std::string& key : required_keys(opt.kind, live[j].options())) {
              if (!tensors.count(slot.name + "." + key)) missing.push_back(slot.name + "." + key);
            }
            if (has_step(opt.kind) && !has_step_tensor) missing.push_back(slot.name + ".step");
            if (!missing.empty()) {
              std::string list;
              for (const auto& m : missing) list += (list.empty() ? "'" : ", '") + m + "'";
              TORCH_CHECK(false, fn, ": ", path, " has optimizer state of '", slot.name, "' for a ",
                          kind_name(opt.kind), " optimizer but lacks ", list,
                          " (pass optimizer_state(false) to import weights only)");
            }
            state.present = true;
            if (has_step_tensor) {
              const at::Tensor& s = tensors.at(slot.name + ".step");
              TORCH_CHECK(s.numel() == 1, fn, ": ", path, " tensor '", slot.name, ".step' has ",
                          s.numel(), " elements, expected 1");
              state.step = static_cast<int64_t>(s.item<double>());
            }
            const auto [a, b] = model.groups[ref.group]->held_range(ref.index);
            for (const std::string& key : found) {
              const at::Tensor& t = tensors.at(slot.name + "." + key);
              TORCH_CHECK(t.sizes().vec() == slot.shape, fn, ": ", path, " tensor '", slot.name,
                          ".", key, "' has shape ", shape_string(t.sizes()),
                          " but the parameter has shape ", shape_string(slot.shape));
              state.tensors.emplace_back(key, slice(t, a, b));
            }
          }
          if (any) {
            for (const std::string& key : found) used.insert(slot.name + "." + key);
            if (has_step_tensor) used.insert(slot.name + ".step");
          }
          install.push_back(any && options.optimizer_state());
          per_param.push_back(std::move(state));
        }
      }
      states.push_back(std::move(per_param));
      touch.push_back(std::move(install));
    }
    if (options.strict()) {
      std::vector<std::string> extra;
      for (const auto& [key, t] : tensors) {
        if (!used.count(key)) extra.push_back(key);
      }
      std::sort(extra.begin(), extra.end());
      if (!extra.empty()) {
        std::string list;
        for (size_t k = 0; k < std::min<size_t>(extra.size(), 8); ++k) {
          list += (k ? ", '" : "'") + extra[k] + "'";
        }
        TORCH_CHECK(false, fn, ": ", path, " has ", extra.size(),
                    " tensor(s) that name no parameter of this model or state of its "
                    "optimizers: ",
                    list, extra.size() > 8 ? ", ..." : "", " (pass strict(false) to ignore them)");
      }
    }
  });

  install_weights(model, weights);
  for (size_t o = 0; o < opts.size(); ++o) {
    size_t k = 0;
    for (const auto& refs : opts[o].param_groups) {
      for (const ParamRef& ref : refs) {
        if (touch[o][k]) install_state(opts[o], model.shard(ref), states[o][k]);
        ++k;
      }
    }
  }
}

}  // namespace fsdp_muon
