#include "fsdp/storage_bytes.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon {
namespace fsdp {

int64_t storage_bytes(const at::Tensor& tensor) {
  return static_cast<int64_t>(tensor.storage().nbytes());
}

int64_t set_storage_bytes(const at::Tensor& tensor, int64_t bytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  const int64_t before = static_cast<int64_t>(storage->nbytes());
  if (before == bytes) return 0;
  c10::Allocator* allocator = storage->allocator();
  FSDP_MUON_CHECK(allocator != nullptr, "internal error: a buffer's storage has no allocator");
  // Allocate on the storage's own device (the CUDA caching allocator uses the current one).
  c10::OptionalDeviceGuard guard(tensor.device());
  // The old memory is released when its DataPtr is replaced; with 0 bytes the allocator hands
  // back a null pointer, which ATen refuses to compute with ("data is not allocated").
  storage->set_data_ptr_noswap(allocator->allocate(static_cast<size_t>(bytes)));
  storage->set_nbytes(static_cast<size_t>(bytes));
  return bytes - before;
}

}  // namespace fsdp
}  // namespace fsdp_muon
