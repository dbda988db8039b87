#pragma once
// Where char_gpt saves and resumes training. The library's checkpoint API (DESIGN §6) plugs in
// here; until it is part of the build these report that checkpoints are unavailable.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/fsdp/parameter_group.h>

namespace char_gpt {

// Everything a resumed run needs to continue exactly: the sharded groups (main weights), both
// optimizers' state (momentum, AdamW moments), the step reached and this rank's data sampler.
struct TrainingState {
  std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>> groups;
  torch::optim::Optimizer* muon = nullptr;  // null in the AdamW baseline
  torch::optim::Optimizer* adamw = nullptr;
  int64_t step = 0;        // steps completed
  at::Generator data_gen;  // this rank's batch sampler
};

// True when this build can write and read checkpoints.
bool checkpoints_available();

// Collective: every rank writes its shards under `directory` (atomically).
void save_checkpoint(const std::string& directory, const TrainingState& state);

// Collective: restores `state` (weights, optimizer state, step, sampler) from `directory` and
// refreshes the model weights of every group.
void load_checkpoint(const std::string& directory, TrainingState& state);

}  // namespace char_gpt
