#pragma once
// Internals of the NCCL communicator that tests reach (CUDA build only).

#include <cstdint>

#include <c10/cuda/CUDAStream.h>

namespace fsdp_muon::detail {

// The communication stream every NCCL communicator on `device_index` runs its asynchronous
// collectives on (docs/DESIGN.md §5), created on first use. Tests hold it busy to prove that
// waits order the caller's stream after it.
c10::cuda::CUDAStream nccl_communication_stream(int device_index);

// Test-only: every asynchronous collective started from now on first sleeps `cycles` GPU cycles
// (at::cuda::sleep) on the communication stream, after its wait for the caller's stream; 0
// turns it off. A consumer that reads a result without CommWork::wait() then reads it before the
// collective has run, deterministically, instead of by timing luck (docs/DESIGN.md §5).
void set_async_collective_delay_for_testing(int64_t cycles);

}  // namespace fsdp_muon::detail
