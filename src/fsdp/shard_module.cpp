#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp/shard_module.h>

#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon {
namespace {

// Key of the default policy: the direct child a parameter belongs to ("layer1" for
// "layer1.sub.weight"), or "" for the module's own parameters. Child names can never be empty
// (register_module rejects it), so the two never collide.
std::string direct_child_key(const std::string& name) {
  const auto dot = name.find('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

}  // namespace

std::vector<std::shared_ptr<FsdpParameterGroup>> shard_module(torch::nn::Module& module,
                                                              std::shared_ptr<Communicator> comm,
                                                              const ShardModuleOptions& options) {
  FSDP_MUON_API_SCOPE("shard_module");
  FSDP_MUON_CHECK(comm != nullptr, "the communicator is null");
  return shard_module(module, one_dimensional_mesh(std::move(comm)), options);
}

std::vector<std::shared_ptr<FsdpParameterGroup>> shard_module(torch::nn::Module& module,
                                                              const DeviceMesh& mesh,
                                                              const ShardModuleOptions& options) {
  FSDP_MUON_API_SCOPE("shard_module");
  FSDP_MUON_CHECK(mesh.world != nullptr && mesh.shard != nullptr && mesh.replicate != nullptr,
                  "the mesh has a null communicator (world, shard or "
                  "replicate); build it with make_device_mesh(world, shard_size)");
  std::vector<std::string> keys;  // in order of first appearance
  std::unordered_map<std::string, std::vector<std::pair<std::string, at::Tensor>>> members;
  std::unordered_map<const c10::TensorImpl*, std::string> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    const at::Tensor& param = item.value();
    auto [it, inserted] = seen.emplace(param.unsafeGetTensorImpl(), name);
    FSDP_MUON_CHECK(inserted, "parameters '", it->second, "' and '", name,
                    "' are the same tensor (tied weights); sharding would re-point it twice. Untie "
                    "them, or share the weight by reference in forward() instead of registering it "
                    "twice.");
    std::string key = options.policy() ? options.policy()(name, param) : direct_child_key(name);
    auto found = members.find(key);
    if (found == members.end()) {
      keys.push_back(key);
      found = members.emplace(key, std::vector<std::pair<std::string, at::Tensor>>{}).first;
    }
    found->second.emplace_back(name, param);
  }

  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  groups.reserve(keys.size());
  for (const std::string& key : keys) {
    FsdpParameterGroupOptions group_options = options.group_options();
    group_options.name(key);
    groups.push_back(
        std::make_shared<FsdpParameterGroup>(std::move(members[key]), mesh, group_options));
  }
  share_forward_order(groups);
  return groups;
}

}  // namespace fsdp_muon
