#pragma once
// Which CUDA device an NCCL rank drives (docs/DESIGN.md §5, Launch): a pure function of what the
// process sees, so that it is tested without a GPU.

#include <chrono>
#include <functional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fsdp_muon/comm/communicator.h>

#include "comm/launch_environment.h"

namespace fsdp_muon::detail {

// Exactly one visible device: that one, whatever the local rank says (srun --gpus-per-task=1 or
// a CUDA_VISIBLE_DEVICES per process give each rank its own device while SLURM_LOCALID or
// LOCAL_RANK still count the ranks of the node). Otherwise cuda:<local rank>, which must exist;
// no visible device, or a local rank past the visible ones, throws naming the local rank, its
// variable and the count.
int choose_cuda_device(int visible_devices, const LaunchEnvironment& e);

// Every rank runs `placement` (which chooses its device and returns where it is: the host and the
// device's PCI bus id) and claims the result in `store`. When two ranks claim the same one, or
// `placement` throws on some rank, every rank throws the same error, naming the ranks and the
// placement (or the failing rank's message), before NCCL would fail on some ranks only
// ("Duplicate GPU detected") or hang; a rank that never checks in within `timeout` is named by
// the count that did. Two processes that see one GPU each are told apart by the GPU, not by the
// count choose_cuda_device sees. NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL's own switch for several
// ranks on one GPU, e.g. MIG slices of one board) turns the conflict off, not the exchange.
// Store operations per rank: a constant, whatever the world size.
void check_one_rank_per_device(c10d::Store& store, int rank, int world_size,
                               const std::function<std::string()>& placement,
                               std::chrono::milliseconds timeout);

// Which host this process runs on, as NCCL tells hosts apart: NCCL_HOSTID when set, else the
// host name and the kernel's boot id (containers may share a host name, not a boot id).
std::string host_identity();

// "<host_identity()> <PCI bus id>" of CUDA device `device` (the placement above); CUDA builds
// only.
std::string cuda_device_placement(int device);
std::string cuda_pci_bus_id(int device);  // nccl_communicator.cpp

}  // namespace fsdp_muon::detail
