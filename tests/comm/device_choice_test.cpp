// The CUDA device an NCCL rank drives, decided from the visible device count and the launch
// environment (no GPU needed: the count is given): one visible device is used whatever the
// local rank says; with several, the local rank chooses and must exist.

#include <functional>
#include <string>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "comm/device_choice.h"

namespace fsdp_muon::detail {
namespace {

LaunchEnvironment srun_rank(int rank, int local_rank) {
  LaunchEnvironment e;
  e.launcher = "srun";
  e.rank = rank;
  e.world_size = 16;
  e.local_rank = local_rank;
  e.local_rank_variable = "SLURM_LOCALID";
  return e;
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no exception)";
}

TEST(DeviceChoice, OneVisibleDeviceIsUsedWhateverTheLocalRank) {
  // srun --gpus-per-task=1: each process sees one GPU while SLURM_LOCALID runs 0..7.
  for (int local_rank = 0; local_rank < 8; ++local_rank) {
    EXPECT_EQ(choose_cuda_device(1, srun_rank(8 + local_rank, local_rank)), 0) << local_rank;
  }
  LaunchEnvironment single;  // no launcher, no local rank variable
  single.launcher = "single";
  EXPECT_EQ(choose_cuda_device(1, single), 0);
}

TEST(DeviceChoice, SeveralVisibleDevicesAreChosenByTheLocalRank) {
  for (int local_rank = 0; local_rank < 8; ++local_rank) {
    EXPECT_EQ(choose_cuda_device(8, srun_rank(local_rank, local_rank)), local_rank);
  }
  LaunchEnvironment single;
  single.launcher = "single";
  EXPECT_EQ(choose_cuda_device(4, single), 0);
}

TEST(DeviceChoice, ALocalRankPastTheVisibleDevicesIsAnErrorNamingBoth) {
  const std::string message = message_of([] { choose_cuda_device(2, srun_rank(7, 5)); });
  EXPECT_NE(message.find("fsdp_muon::init_from_env: local rank 5 (from SLURM_LOCALID) has no "
                         "CUDA device: 2 are visible to srun rank 7"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("give each process exactly one GPU"), std::string::npos) << message;
}

TEST(DeviceChoice, NoVisibleDeviceIsAnError) {
  const std::string message = message_of([] { choose_cuda_device(0, srun_rank(3, 0)); });
  EXPECT_NE(message.find("fsdp_muon::init_from_env: NCCL needs a CUDA device, but none is "
                         "visible to srun rank 3"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace fsdp_muon::detail
