#pragma once
// What an FsdpParameterGroup holds (docs/DESIGN.md §2): the flat layout, the four buffers, the
// module's parameters as views into them and the sharded parameters as slices of the shards;
// the steps that build them; and the kOptim (ZeRO-1) handling of .grad(). What full sharding
// adds on top (freeing, gathering, reducing during backward) is ShardingStateMachine's.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/fsdp/parameter_group.h>

#include "fsdp/flat_layout.h"

namespace fsdp_muon::fsdp {

// The start of every message: "fsdp_muon::FsdpParameterGroup: " and, for a named group,
// "group '<name>': ".
std::string group_label(const std::string& name);

struct GroupStorage {
  // The mesh the group lives on: sharded over mesh.shard (`comm`, whose ranks the layout is in),
  // replicated over mesh.replicate (docs/DESIGN.md §2, Meshes).
  DeviceMesh mesh;
  std::shared_ptr<Communicator> comm;  // mesh.shard
  FsdpParameterGroupOptions options;
  FlatLayout layout;
  c10::ScalarType compute_dtype = at::kFloat;
  c10::ScalarType reduce_dtype = at::kFloat;

  std::vector<at::Tensor> params;        // the module's own tensors
  std::vector<at::Tensor> weight_views;  // their views into model_weights
  std::vector<at::Tensor> grad_views;    // their .grad(): views into full_grad
  std::vector<at::Tensor> sharded;       // 1-D slices of main_shard
  std::vector<at::Tensor> shard_grads;   // their .grad(): slices of grad_shard

  at::Tensor model_weights;  // padded, compute dtype
  at::Tensor full_grad;      // padded, compute dtype
  at::Tensor main_shard;     // shard_numel, main dtype
  at::Tensor grad_shard;     // shard_numel, main dtype

  std::string label() const { return group_label(options.name()); }
  // Bytes of the full model weights (or of the full gradients) in the compute dtype.
  int64_t full_bytes() const;
  void check_index(size_t index) const;

  // kOptim's zero_grad(), reduce_scatter_grads() and refresh_model_weights() (the group's
  // calls, under a NoGradGuard).
  void zero_grad();
  void reduce_scatter_grads();
  void refresh_model_weights();

  // More than one replica: a gradient shard is all-reduced over mesh.replicate after its
  // reduce-scatter. False on a 1-D mesh, which then runs exactly the collectives it ran before
  // meshes existed (docs/DESIGN.md §2, Meshes).
  bool replicated() const { return mesh.replicas() > 1; }
  // The second stage of the gradient reduction, on a reduce-scattered shard in the reduce dtype:
  // start_replica_sum() starts the sum over the replicas (in place), finish_replica_average()
  // divides by their number once it has been waited for. Every replica gets the same bits.
  std::unique_ptr<CommWork> start_replica_sum(const at::Tensor& reduced) const;
  void finish_replica_average(const at::Tensor& reduced) const;

  // Points .grad() of the module parameters and of the sharded parameters back at the
  // buffers. With `keep_foreign`, a module gradient that autograd re-created elsewhere (after a
  // set_to_none zero_grad, or with create_graph=true) is first copied into the buffer so nothing
  // is lost, and an undefined one is zeros.
  void install_grads(bool keep_foreign);
  // Points .grad() of the sharded parameters (those that require grad) at the gradient shard.
  void install_shard_grads();
  // The module's parameters still view the model weights (not moved or cast since sharding).
  void check_parameters_alias() const;
};

// ---- construction steps, in order (FsdpParameterGroup's constructor) ----

// What validation learns about the parameters, for the steps after it.
struct ValidatedParameters {
  c10::ScalarType param_dtype = at::kFloat;
  std::vector<std::pair<std::string, std::vector<int64_t>>> named_shapes;
  int64_t alignment = 1;  // in elements of the compute dtype
};

// Checks the parameters and options locally and resolves the compute and reduce dtypes into
// `s`. Throws the first problem found; the caller turns that into an agreed error
// (fsdp/group_agreement.h) rather than throwing alone.
ValidatedParameters validate_parameters(
    GroupStorage& s, const std::vector<std::pair<std::string, at::Tensor>>& named_params);

// Allocates the four buffers: world rank 0's values (broadcast when asked) in the main-weight
// shard and the model weights, zero gradients.
void allocate_buffers(GroupStorage& s,
                      const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                      c10::ScalarType param_dtype);

// Turns the module's parameters into views of the model weights (keeping their identity) and
// makes the sharded parameters, then points every .grad() at its buffer.
void attach_parameters(GroupStorage& s,
                       std::vector<std::pair<std::string, at::Tensor>> named_params);

}  // namespace fsdp_muon::fsdp
