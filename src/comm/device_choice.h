#pragma once
// Which CUDA device an NCCL rank drives (docs/DESIGN.md §5, Launch): a pure function of what the
// process sees, so that it is tested without a GPU.

#include <string>

#include <fsdp_muon/comm/communicator.h>

#include "comm/launch_environment.h"

namespace fsdp_muon::detail {

// Exactly one visible device: that one, whatever the local rank says (srun --gpus-per-task=1 or
// a CUDA_VISIBLE_DEVICES per process give each rank its own device while SLURM_LOCALID or
// LOCAL_RANK still count the ranks of the node). Otherwise cuda:<local rank>, which must exist;
// no visible device, or a local rank past the visible ones, throws naming the local rank, its
// variable and the count.
int choose_cuda_device(int visible_devices, const LaunchEnvironment& e);

}  // namespace fsdp_muon::detail
