// The CUDA device an NCCL rank drives, decided from the visible device count and the launch
// environment (no GPU needed: the count is given): one visible device is used whatever the
// local rank says; with several, the local rank chooses and must exist. Then the check that no
// two ranks claim one GPU, on an in-memory store with the ranks as threads.

#include <stdlib.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/device_choice.h"
#include "common/check.h"

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
  FSDP_MUON_API_SCOPE("init_from_env");  // the library calls it from there
  const std::string message = message_of([] { choose_cuda_device(2, srun_rank(7, 5)); });
  EXPECT_NE(message.find("fsdp_muon::init_from_env: local rank 5 (from SLURM_LOCALID) has no "
                         "CUDA device: 2 are visible to srun rank 7"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("give each process exactly one GPU"), std::string::npos) << message;
}

TEST(DeviceChoice, NoVisibleDeviceIsAnError) {
  FSDP_MUON_API_SCOPE("init_from_env");  // the library calls it from there
  const std::string message = message_of([] { choose_cuda_device(0, srun_rank(3, 0)); });
  EXPECT_NE(message.find("fsdp_muon::init_from_env: NCCL needs a CUDA device, but none is "
                         "visible to srun rank 3"),
            std::string::npos)
      << message;
}

// Every rank's message from check_one_rank_per_device ("" where it passed), ranks as threads.
std::vector<std::string> claim(const std::vector<std::string>& placements) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int world = static_cast<int>(placements.size());
  std::vector<std::string> messages(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      messages[r] = message_of([&] {
        check_one_rank_per_device(
            *store, r, world,
            [&] {
              TORCH_CHECK(placements[r] != "fail", "no CUDA device is visible to this rank");
              return placements[r];
            },
            std::chrono::seconds(30));
      });
      if (messages[r] == "(no exception)") messages[r].clear();
    });
  }
  for (auto& t : ranks) t.join();
  return messages;
}

TEST(OneRankPerDevice, DistinctGpusPass) {
  for (const std::string& m : claim({"node0 0000:01:00.0", "node0 0000:02:00.0",
                                     "node1 0000:01:00.0", "node1 0000:02:00.0"})) {
    EXPECT_EQ(m, "");
  }
}

TEST(OneRankPerDevice, TwoRanksOnOneGpuFailOnEveryRankNamingBoth) {
  // Ranks 0 and 2 see one GPU each, the same one: the count alone cannot tell.
  const std::vector<std::string> messages =
      claim({"node0 0000:01:00.0", "node0 0000:02:00.0", "node0 0000:01:00.0"});
  for (const std::string& m : messages) {
    EXPECT_NE(m.find("NCCL needs one GPU per rank"), std::string::npos) << m;
    EXPECT_NE(m.find("both use node0 0000:01:00.0"), std::string::npos) << m;
    const bool names_both = m.find("ranks 0 and 2") != std::string::npos ||
                            m.find("ranks 2 and 0") != std::string::npos;
    EXPECT_TRUE(names_both) << m;
    EXPECT_NE(m.find("FSDP_MUON_BACKEND=gloo"), std::string::npos) << m;
  }
}

TEST(OneRankPerDevice, ARankThatCannotChooseItsGpuFailsEveryRankWithItsMessage) {
  for (const std::string& m : claim({"node0 0000:01:00.0", "fail", "node0 0000:02:00.0"})) {
    EXPECT_NE(m.find("choosing the GPU failed on rank 1"), std::string::npos) << m;
    EXPECT_NE(m.find("no CUDA device is visible"), std::string::npos) << m;
  }
}

TEST(OneRankPerDevice, ARankThatNeverChecksInIsCountedNotWaitedForever) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string m = message_of([&] {
    check_one_rank_per_device(
        *store, 0, 2, [] { return std::string("node0 0000:01:00.0"); },
        std::chrono::milliseconds(300));
  });
  EXPECT_NE(m.find("only 1 of 2 ranks reached the GPU check"), std::string::npos) << m;
}

TEST(OneRankPerDevice, HostIdentityHasTheBootIdAndHonoursNcclHostid) {
  ::unsetenv("NCCL_HOSTID");
  const std::string own = host_identity();
  EXPECT_FALSE(own.empty());
  EXPECT_NE(own.find('/'), std::string::npos) << own;  // host name / boot id on Linux
  ::setenv("NCCL_HOSTID", "rack7-node3", 1);
  EXPECT_EQ(host_identity(), "rack7-node3");
  ::unsetenv("NCCL_HOSTID");
}

}  // namespace
}  // namespace fsdp_muon::detail
