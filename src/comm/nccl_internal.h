#pragma once
// Internals of the NCCL communicator that tests reach (CUDA build only).

#include <c10/cuda/CUDAStream.h>

namespace fsdp_muon::detail {

// The communication stream every NCCL communicator on `device_index` runs its asynchronous
// collectives on (docs/DESIGN.md §5), created on first use. Tests hold it busy to prove that
// waits order the caller's stream after it.
c10::cuda::CUDAStream nccl_communication_stream(int device_index);

}  // namespace fsdp_muon::detail
