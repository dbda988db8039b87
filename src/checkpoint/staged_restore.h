#pragma once
// What a load or an import installs, gathered first and installed only after every rank has read
// everything it needs: a failure on any rank then leaves the model and optimizers unchanged
// everywhere.

#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "checkpoint/model_index.h"
#include "checkpoint/optimizer_state.h"

namespace fsdp_muon::checkpoint {

struct StagedRestore {
  // [group][param]: this rank's slice of the parameter's main weights, any device.
  std::vector<std::vector<at::Tensor>> weights;
  // [optimizer][parameter, param groups flattened in order]: nullopt keeps the live state.
  std::vector<std::vector<std::optional<ParamState>>> states;
  // [optimizer][param group]: options_to_bytes() of each param group's options; empty keeps
  // the live options.
  std::vector<std::vector<std::vector<char>>> options;
};

// Copies the weights into the main-weight shards, refreshes the model weights of every group,
// then installs the options and optimizer state. Local: no communication.
void install_staged(const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                    const StagedRestore& staged);

}  // namespace fsdp_muon::checkpoint
