#pragma once
// Shard a torch::nn::Module into FsdpParameterGroups.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/group_options.h>

namespace fsdp_muon {

class FsdpParameterGroup;  // parameter_group.h (the engine tier)

// Decides the group of each parameter: called with the parameter's full name (as in
// module.named_parameters()) and tensor, returns a group key. Parameters with the same key go
// to one group, groups ordered by first appearance. The default policy keys by the direct child
// module the parameter belongs to (its own parameters form one group too).
using ShardPolicy = std::function<std::string(const std::string& name, const at::Tensor& param)>;

struct FSDP_MUON_API ShardModuleOptions {
  TORCH_ARG(ShardPolicy, policy) = nullptr;  // nullptr: one group per direct child
  TORCH_ARG(FsdpParameterGroupOptions, group_options) = {};
};

FSDP_MUON_API std::vector<std::shared_ptr<FsdpParameterGroup>> shard_module(
    torch::nn::Module& module, std::shared_ptr<Communicator> comm,
    const ShardModuleOptions& options = {});
// The same on a mesh (HSDP): every group on `mesh` (FsdpParameterGroup's mesh constructor).
FSDP_MUON_API std::vector<std::shared_ptr<FsdpParameterGroup>> shard_module(
    torch::nn::Module& module, const DeviceMesh& mesh, const ShardModuleOptions& options = {});

}  // namespace fsdp_muon
