#pragma once
// Factory for the NCCL communicator, for programs that bring their own c10d Store (init_from_env()
// is the usual way in). Kept apart from communicator.h so that code which only moves tensors
// does not pull in c10d.

#include <chrono>
#include <memory>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/config.h>

namespace fsdp_muon {

// Raw NCCL on cuda:<device_index>; the NCCL unique id travels through `store`. Every call is
// enqueued on the caller's current CUDA stream, launched on the caller's thread. Errors reported
// by NCCL and collectives that do not finish within `timeout` (checked whenever the host waits:
// set-up, barrier(), to_host()) abort the communicator and throw. A call blocked inside NCCL for
// twice `timeout` (waiting for a missing peer while NCCL connects, or queued behind kernels that
// wait for one) ends the process with a message naming the collective and the rank
// (docs/DESIGN.md §5). Throws when NCCL_COMM_BLOCKING is set, and when this build of fsdp_muon
// has no CUDA.
FSDP_MUON_API std::shared_ptr<Communicator> make_nccl_communicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, int device_index,
    std::chrono::milliseconds timeout = std::chrono::minutes(5));

}  // namespace fsdp_muon
