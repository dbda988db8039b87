#pragma once
// Internals of the NCCL communicator that tests reach (CUDA build only).

#include <cstddef>
#include <cstdint>
#include <string>

#include <c10/cuda/CUDAStream.h>

namespace fsdp_muon::detail {

// The kinds of asynchronous collective, each on a stream of its own per device: a lane
// (docs/DESIGN.md §5, Streams).
enum class CommLane : int {
  kAllGather = 0,  // all_gather, all_gather_v: ZeRO-3's weights, the HSDP relay
  kReduceScatter,  // reduce_scatter_mean: the gradients
  kAllReduce,      // all_reduce: HSDP's replica sum
  kAllToAll,       // all_to_all_v: FsdpMuon's exchange
};
inline constexpr size_t kCommLanes = 4;

// Whether a device's lanes are separate streams, and why. Decided once per process, when the
// library is loaded, from NCCL's version, NCCL_LAUNCH_ORDER_IMPLICIT and the CUDA version (the
// older of driver and runtime). `set_variable`: the library sets NCCL_LAUNCH_ORDER_IMPLICIT=1.
struct LaunchOrder {
  bool separate_lanes = false;
  bool set_variable = false;
  std::string why;
};
LaunchOrder decide_launch_order(int nccl_version, const char* variable, int cuda_version);

// This process's decision (made at load, checked by the first NCCL communicator).
bool nccl_lanes_separate();
// Whether the library set NCCL_LAUNCH_ORDER_IMPLICIT=1 when it was loaded.
bool nccl_launch_order_set_by_library();

// The stream `lane` runs on for every NCCL communicator on `device_index`, created on first use
// (one stream for every lane where they are not separate). Tests hold it busy to prove that
// waits order the caller's stream after it.
c10::cuda::CUDAStream nccl_lane_stream(int device_index, CommLane lane);

// Test-only: every asynchronous collective started from now on first sleeps `cycles` GPU cycles
// (at::cuda::sleep) on its lane, after its wait for the caller's stream; 0 turns it off. A
// consumer that reads a result without CommWork::wait() then reads it before the collective has
// run, deterministically, instead of by timing luck (docs/DESIGN.md §5).
void set_async_collective_delay_for_testing(int64_t cycles);

}  // namespace fsdp_muon::detail
