#include "comm/device_choice.h"

#include <c10/util/Exception.h>

namespace fsdp_muon::detail {

int choose_cuda_device(int visible_devices, const LaunchEnvironment& e) {
  if (visible_devices == 1) {
    return 0;
  }
  const std::string from = e.local_rank_variable.empty()
                               ? std::string("no local rank variable set, so 0")
                               : "from " + e.local_rank_variable;
  TORCH_CHECK(visible_devices > 0,
              "fsdp_muon::init_from_env: NCCL needs a CUDA device, but none "
              "is visible to ",
              e.launcher, " rank ", e.rank,
              " (check CUDA_VISIBLE_DEVICES and the GPUs the launcher gave this process)");
  TORCH_CHECK(e.local_rank >= 0 && e.local_rank < visible_devices,
              "fsdp_muon::init_from_env: local rank ", e.local_rank, " (", from,
              ") has no CUDA device: ", visible_devices, " are visible to ", e.launcher, " rank ",
              e.rank,
              ", so the local rank chooses among them; start at most one process per "
              "visible GPU on each node, or give each process exactly one GPU "
              "(CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1), which it then uses whatever its "
              "local rank");
  return e.local_rank;
}

}  // namespace fsdp_muon::detail
