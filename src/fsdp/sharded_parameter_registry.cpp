#include "fsdp/sharded_parameter_registry.h"

#include <mutex>
#include <unordered_map>

namespace fsdp_muon {
namespace fsdp {
namespace {

// Keyed by TensorImpl because optimizers hand back tensors that share the impl (copies of the
// handle), never a new one for the same parameter. The group pointer is raw: entries are erased
// (under the mutex) at the top of the group's destructor, so a pointer found under the mutex is
// always alive, and weak_from_this() then says whether a shared_ptr still owns it.
struct RegistryEntry {
  FsdpParameterGroup* group = nullptr;
  size_t index = 0;
};

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<const c10::TensorImpl*, RegistryEntry>& registry() {
  static std::unordered_map<const c10::TensorImpl*, RegistryEntry> map;
  return map;
}

}  // namespace

void register_sharded_parameters(FsdpParameterGroup* group,
                                 const std::vector<at::Tensor>& sharded) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (size_t i = 0; i < sharded.size(); ++i) {
    registry()[sharded[i].unsafeGetTensorImpl()] = RegistryEntry{group, i};
  }
}

void unregister_sharded_parameters(const FsdpParameterGroup* group,
                                   const std::vector<at::Tensor>& sharded) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (const at::Tensor& sp : sharded) {
    auto it = registry().find(sp.unsafeGetTensorImpl());
    if (it != registry().end() && it->second.group == group) registry().erase(it);
  }
}

}  // namespace fsdp

std::optional<ShardedParameterInfo> find_sharded_parameter(const at::Tensor& tensor) {
  if (!tensor.defined()) return std::nullopt;
  std::lock_guard<std::mutex> lock(fsdp::registry_mutex());
  auto it = fsdp::registry().find(tensor.unsafeGetTensorImpl());
  if (it == fsdp::registry().end()) return std::nullopt;
  std::shared_ptr<FsdpParameterGroup> group = it->second.group->weak_from_this().lock();
  if (!group) return std::nullopt;
  return ShardedParameterInfo{std::move(group), it->second.index};
}

}  // namespace fsdp_muon
