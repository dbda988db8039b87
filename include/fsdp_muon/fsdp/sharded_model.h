#pragma once
// ShardedModel (docs/DESIGN.md §2, The user tier): a module sharded into FsdpParameterGroups, with
// the FSDP cycle done where the user need not write it: gradients are reduce-scattered at the end
// of every backward through the model, as FSDP2 does.

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/shard_module.h>

namespace fsdp_muon {

// One parameter of a ShardedModel, in the module's named_parameters() order, with what its
// module says about it (what MuonAdamW's default routing reads).
struct FSDP_MUON_API ShardedModelParameter {
  std::string name;  // as in module.named_parameters()
  std::shared_ptr<FsdpParameterGroup> group;
  size_t index = 0;          // in `group`
  std::string module_type;   // the owning module's name(), e.g. "torch::nn::LinearImpl"
  bool embedding = false;    // owned by a torch::nn::Embedding or EmbeddingBag
  bool output_head = false;  // owned by the model's last torch::nn::Linear (named_modules order)
  // A tensor on the meta device with the parameter's full shape and dtype: what it is, without
  // its data (which under kOptimGradsParams exists only inside forward()).
  at::Tensor meta;
};

class FSDP_MUON_API ShardedModel {
 public:
  // shard_module(module, comm or mesh, options), and from then on every backward that reaches
  // the model's parameters ends with reduce_scatter_grads() of every group. The module must
  // outlive the ShardedModel and keep its parameters (move or cast it before).
  ShardedModel(torch::nn::Module& module, std::shared_ptr<Communicator> comm,
               const ShardModuleOptions& options = {});
  ShardedModel(torch::nn::Module& module, const DeviceMesh& mesh,
               const ShardModuleOptions& options = {});
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups() const;
  const std::vector<ShardedModelParameter>& parameters() const;
  const DeviceMesh& mesh() const;

  // Zeroes every group's gradients (FsdpParameterGroup::zero_grad), and forgets a backward that
  // failed before its end.
  void zero_grad();

  // Whether a backward ends with the gradient reduce-scatter (true, the default). False lets
  // micro-batches accumulate without communication under ShardingStrategy::kOptim: the full
  // gradients add up across backwards, and the first backward after setting it back to true
  // reduce-scatters their sum (FSDP2's set_requires_gradient_sync). Every rank must set it alike.
  // Under kOptimGrads/kOptimGradsParams false is an error: those free the full gradients, so
  // each backward reduce-scatters as it passes each group and the shards accumulate.
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;

  // What the end of backward runs: every group's reduce_scatter_grads(), in order. Collective.
  void reduce_scatter_grads();
  // Every group's refresh_model_weights(), in order. Collective.
  void refresh_model_weights();

  // The group holding `child`'s parameters (a module whose parameters span several groups, or
  // that has none in this model, is an error naming it).
  FsdpParameterGroup& group_of(const torch::nn::Module& child) const;
  // child->forward(input) inside that group's forward() boundary (FsdpParameterGroup::forward):
  // what kOptimGrads and kOptimGradsParams need around each group's part of the model; under
  // kOptim it runs the same bits.
  template <typename ModuleHolder>
  at::Tensor forward(ModuleHolder child, const at::Tensor& input) {  // holders are shared pointers
    return forward(
        *child, [&](const at::Tensor& x) { return child->forward(x); }, input);
  }
  // The same with the call written out: fn(input) inside the boundary of `child`'s group.
  at::Tensor forward(const torch::nn::Module& child,
                     const std::function<at::Tensor(const at::Tensor&)>& fn,
                     const at::Tensor& input);

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// The user tier's entry point: `module` sharded over `comm` (or `mesh`), one group per direct
// child unless options.policy() says otherwise (shard_module).
FSDP_MUON_API std::shared_ptr<ShardedModel> shard(torch::nn::Module& module,
                                                  std::shared_ptr<Communicator> comm,
                                                  const ShardModuleOptions& options = {});
FSDP_MUON_API std::shared_ptr<ShardedModel> shard(torch::nn::Module& module, const DeviceMesh& mesh,
                                                  const ShardModuleOptions& options = {});

}  // namespace fsdp_muon
