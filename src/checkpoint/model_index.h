#pragma once
// What save, load, export and import share: the parameters of the groups by name, the
// optimizers over them by kind, per-parameter optimizer state in and out.

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/fsdp/parameter_group.h>

namespace fsdp_muon::checkpoint {

// Part of the file format: kinds are written by name.
enum class OptimizerKind { kFsdpMuon, kAdamW, kAdam, kSgd };

const char* kind_name(OptimizerKind kind);
// Tensor state an optimizer of this kind may keep per parameter, each the parameter's shape.
const std::vector<std::string>& state_keys(OptimizerKind kind);
bool has_step(OptimizerKind kind);

struct ParamRef {
  size_t group = 0;
  size_t index = 0;
};

struct ModelIndex {
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::shared_ptr<Communicator> comm;
  std::unordered_map<std::string, ParamRef> by_name;
  std::unordered_map<const void*, ParamRef> by_impl;  // sharded parameter TensorImpl

  const ParameterSlot& slot(const ParamRef& ref) const {
    return groups[ref.group]->slot(ref.index);
  }
  const at::Tensor& shard(const ParamRef& ref) const {
    return groups[ref.group]->sharded_parameter(ref.index);
  }
};

// Checks the groups (non-empty, one world, unique parameter names) and indexes them. `fn`
// names the calling function in errors.
ModelIndex index_model(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                       const char* fn);

// Copies this rank's slice of every parameter ([group][param], any device) into its main-weight
// shard and refreshes the model weights of every group: the last step of every load.
void install_weights(const ModelIndex& model, const std::vector<std::vector<at::Tensor>>& weights);

struct OptimizerEntry {
  OptimizerKind kind = OptimizerKind::kAdamW;
  torch::optim::Optimizer* optimizer = nullptr;
  // Per optimizer param group, its parameters in order.
  std::vector<std::vector<ParamRef>> param_groups;
};

// Detects each optimizer's kind (a clear error for another type) and resolves its parameters
// to the model's (a clear error for a tensor that is not a sharded parameter of `model`, or
// one that two optimizers share).
std::vector<OptimizerEntry> index_optimizers(
    const std::vector<torch::optim::Optimizer*>& optimizers, const ModelIndex& model,
    const char* fn);

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

// The bytes of an optimizer param group's options (OptimizerOptions::serialize) and back.
std::vector<char> options_to_bytes(const torch::optim::OptimizerOptions& options);
void options_from_bytes(torch::optim::OptimizerOptions& options, const std::vector<char>& bytes);

std::string shape_string(at::IntArrayRef shape);

}  // namespace fsdp_muon::checkpoint
