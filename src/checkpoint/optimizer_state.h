#pragma once
// One parameter's optimizer state out of a live optimizer and back in, and a param group's
// options as bytes: how checkpoints see the four supported optimizers' state, whatever class
// each keeps it in.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "checkpoint/model_index.h"

namespace fsdp_muon::checkpoint {

// One parameter's optimizer state, in the local shard's shape.
struct ParamState {
  bool present = false;
  int64_t step = 0;
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // defined ones, in state_keys order
};

ParamState read_state(const OptimizerEntry& opt, const at::Tensor& param);
// Replaces the state of `param` (none when !state.present) with one built as the optimizer
// builds its lazy state; `state.tensors` are copied into tensors like `param`.
void install_state(const OptimizerEntry& opt, const at::Tensor& param, const ParamState& state);

// The state keys an optimizer of this kind creates for a parameter of a param group with these
// options: what an imported state must hold to be complete.
std::vector<std::string> required_state_keys(OptimizerKind kind,
                                             const torch::optim::OptimizerOptions& options);

// The bytes of an optimizer param group's options (OptimizerOptions::serialize) and back.
std::vector<char> options_to_bytes(const torch::optim::OptimizerOptions& options);
void options_from_bytes(torch::optim::OptimizerOptions& options, const std::vector<char>& bytes);

}  // namespace fsdp_muon::checkpoint
