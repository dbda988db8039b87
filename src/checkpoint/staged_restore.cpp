#include "checkpoint/staged_restore.h"

#include <ATen/core/grad_mode.h>

namespace fsdp_muon::checkpoint {
namespace {

void install_weights(const ModelIndex& model, const std::vector<std::vector<at::Tensor>>& weights) {
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < model.groups.size(); ++g) {
    for (size_t i = 0; i < model.groups[g]->num_parameters(); ++i) {
      const at::Tensor& shard = model.groups[g]->sharded_parameter(i);
      if (shard.numel() > 0) shard.copy_(weights[g][i]);
    }
  }
}

void install_optimizer(const ModelIndex& model, const OptimizerEntry& opt,
                       const std::vector<std::optional<ParamState>>& states,
                       const std::vector<std::vector<char>>* options) {
  auto& live = opt.optimizer->param_groups();
  size_t flat = 0;
  for (size_t j = 0; j < opt.param_groups.size(); ++j) {
    if (options != nullptr) options_from_bytes(live[j].options(), (*options)[j]);
    for (const ParamRef& ref : opt.param_groups[j]) {
      const std::optional<ParamState>& state = states[flat++];
      if (state) install_state(opt, model.shard(ref), *state);
    }
  }
}

}  // namespace

void install_staged(const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                    const StagedRestore& staged) {
  install_weights(model, staged.weights);
  for (size_t o = 0; o < opts.size(); ++o) {
    install_optimizer(model, opts[o], staged.states[o],
                      staged.options.empty() ? nullptr : &staged.options[o]);
  }
  // The refresh's all-gathers come last: a host-to-device copy from pageable memory synchronizes
  // the stream, so copies queued behind a collective would wait for it without a bound (one
  // stuck on a dead peer included). Every copy above runs before any collective is queued.
  for (const auto& group : model.groups) group->refresh_model_weights();
}

}  // namespace fsdp_muon::checkpoint
