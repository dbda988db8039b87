#pragma once
// What save, load, export and import share about the live model: the parameters of the groups by
// name, and the optimizers over them by kind with their parameters resolved to the model's.
// Checkpoints key everything by parameter name, so that a load can match a model laid out for
// another world size.

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/fsdp/parameter_group.h>

namespace fsdp_muon::checkpoint {

// Part of the file format: kinds are written by name.
enum class OptimizerKind { kFsdpMuon, kAdamW, kAdam, kSgd };

const char* kind_name(OptimizerKind kind);
// Tensor state an optimizer of this kind may keep per parameter: the parameter's shape, or for
// row state (is_row_state) one value per row of the 2-D parameter.
const std::vector<std::string>& state_keys(OptimizerKind kind);
// FsdpMuon's NorMuon state ("normuon_variance"): a rank keeps the rows whose first element its
// shard holds (detail::rows_starting_in, docs/DESIGN.md §6), so it is sharded and resharded by
// rows as elementwise state is by elements.
bool is_row_state(OptimizerKind kind, const std::string& key);
bool has_step(OptimizerKind kind);

struct ParamRef {
  size_t group = 0;
  size_t index = 0;
};

struct ModelIndex {
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  // The groups' shard group: rank files, held ranges and the manifest's world size are in its
  // ranks, so a checkpoint saved on a mesh is the one a 1-D world of shard_size ranks saves.
  std::shared_ptr<Communicator> comm;
  // The groups' mesh (group 0's; the others are checked to match its shape and this rank's place
  // in it). Every checkpoint call agrees over mesh.world (docs/DESIGN.md §6, Meshes).
  DeviceMesh mesh;
  std::unordered_map<std::string, ParamRef> by_name;
  std::unordered_map<const void*, ParamRef> by_impl;  // sharded parameter TensorImpl

  const ParameterSlot& slot(const ParamRef& ref) const {
    return groups[ref.group]->slot(ref.index);
  }
  const at::Tensor& shard(const ParamRef& ref) const {
    return groups[ref.group]->sharded_parameter(ref.index);
  }
};

// The communicator of the groups' data-parallel world (their mesh's world: every rank of every
// replica), which every step of a checkpoint call agrees over; throws (locally: there is no
// world to agree in) when no groups are given.
Communicator& communicator_of(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups);

// Checks the groups (non-empty, one mesh shape with this rank at one place in it, unique
// parameter names) and indexes them. `api`
// names the public function in errors.
ModelIndex index_model(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups);

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
    const std::vector<torch::optim::Optimizer*>& optimizers, const ModelIndex& model);

}  // namespace fsdp_muon::checkpoint
