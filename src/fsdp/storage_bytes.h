#pragma once
// Allocating and freeing the memory under a tensor's storage in place (docs/DESIGN.md §2,
// Sharding strategies): every tensor and view on the storage, autograd's saved ones included,
// sees the new memory, and with 0 bytes ATen refuses to read or write any of them.

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace fsdp_muon {
namespace fsdp {

// Bytes the storage under `tensor` holds now.
int64_t storage_bytes(const at::Tensor& tensor);

// Gives the storage under `tensor` `bytes` fresh, uninitialized bytes from its own allocator (0:
// frees them). The contents are not kept. Returns the change in bytes.
int64_t set_storage_bytes(const at::Tensor& tensor, int64_t bytes);

}  // namespace fsdp
}  // namespace fsdp_muon
