// read_launch_environment() and init_from_env() in one process, with the launcher variables
// set and unset in-process: every launcher, the nestings that are legitimate, and every error.

#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/config.h>

#include "comm/launch_environment.h"

namespace fsdp_muon {
namespace {

using detail::LaunchEnvironment;
using detail::read_launch_environment;

const char* const kVariables[] = {"RANK",
                                  "WORLD_SIZE",
                                  "LOCAL_RANK",
                                  "MASTER_ADDR",
                                  "MASTER_PORT",
                                  "TORCHELASTIC_RUN_ID",
                                  "TORCHELASTIC_USE_AGENT_STORE",
                                  "OMPI_COMM_WORLD_RANK",
                                  "OMPI_COMM_WORLD_SIZE",
                                  "OMPI_COMM_WORLD_LOCAL_RANK",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE",
                                  "OMPI_MCA_ess_base_jobid",
                                  "OMPI_MCA_orte_jobfam_session_dir",
                                  "PMIX_NAMESPACE",
                                  "SLURM_PROCID",
                                  "SLURM_NTASKS",
                                  "SLURM_LOCALID",
                                  "SLURM_JOB_ID",
                                  "SLURM_STEP_ID",
                                  "SLURM_NNODES",
                                  "SLURM_STEP_NUM_NODES",
                                  "PMI_RANK",
                                  "PMI_SIZE",
                                  "MPI_LOCALRANKID",
                                  "MPI_LOCALNRANKS",
                                  "FSDP_MUON_BACKEND",
                                  "FSDP_MUON_STORE_DIR",
                                  "FSDP_MUON_TIMEOUT",
                                  "TORCHELASTIC_RESTART_COUNT",
                                  "LOCAL_WORLD_SIZE",
                                  "SLURM_STEP_TASKS_PER_NODE",
                                  "SLURM_TASKS_PER_NODE"};

// Clears every variable the bootstrap reads, and restores the process's own afterwards (this
// test may itself run under a launcher).
class LaunchEnvironmentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kVariables) {
      if (const char* v = std::getenv(name)) {
        saved_[name] = v;
      }
      unsetenv(name);
    }
  }
  void TearDown() override {
    for (const char* name : kVariables) {
      unsetenv(name);
    }
    for (const auto& [name, value] : saved_) {
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
  static void set(const std::vector<std::pair<const char*, const char*>>& vars) {
    for (const auto& [name, value] : vars) {
      setenv(name, value, 1);
    }
  }
  // The message of the error read_launch_environment() throws (fails the test if none).
  static std::string error() {
    try {
      read_launch_environment();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    ADD_FAILURE() << "read_launch_environment() accepted the environment";
    return "";
  }

 private:
  std::map<std::string, std::string> saved_;
};

TEST_F(LaunchEnvironmentTest, NoLauncherIsASingleProcess) {
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.launcher, "single");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_TRUE(e.master_addr.empty());
}

TEST_F(LaunchEnvironmentTest, Torchrun) {
  set({{"RANK", "2"},
       {"WORLD_SIZE", "4"},
       {"LOCAL_RANK", "1"},
       {"MASTER_ADDR", "node7"},
       {"MASTER_PORT", "29400"},
       {"TORCHELASTIC_RUN_ID", "run-1"},
       {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_rank_variable, "LOCAL_RANK");
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_TRUE(e.use_agent_store);
  EXPECT_EQ(e.job_id, "torchrun-run-1");
}

TEST_F(LaunchEnvironmentTest, TorchrunWithoutAgentStoreMakesRankZeroTheServer) {
  set({{"RANK", "0"},
       {"WORLD_SIZE", "2"},
       {"MASTER_ADDR", "h"},
       {"MASTER_PORT", "1"},
       {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_FALSE(e.use_agent_store);
  EXPECT_EQ(e.local_rank, 0);  // not given: 0
  EXPECT_EQ(e.local_rank_variable, "");
}

TEST_F(LaunchEnvironmentTest, OpenMpiOnOneNodeNeedsNoAddress) {
  set({{"OMPI_COMM_WORLD_RANK", "3"},
       {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
       {"OMPI_MCA_ess_base_jobid", "2045968385"}});
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.launcher, "mpirun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_TRUE(e.master_addr.empty());
  EXPECT_EQ(e.job_id, "mpirun-2045968385");
}

TEST_F(LaunchEnvironmentTest, OpenMpiAcrossNodesNeedsAnAddress) {
  set({{"OMPI_COMM_WORLD_RANK", "3"},
       {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_NE(error().find("MASTER_ADDR"), std::string::npos) << error();
  set({{"MASTER_ADDR", "n0"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(read_launch_environment().master_addr, "n0");
}

TEST_F(LaunchEnvironmentTest, Slurm) {
  set({{"SLURM_PROCID", "5"},
       {"SLURM_NTASKS", "8"},
       {"SLURM_LOCALID", "1"},
       {"SLURM_JOB_ID", "777"},
       {"SLURM_STEP_ID", "2"},
       {"SLURM_NNODES", "1"}});
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.launcher, "srun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.job_id, "srun-777.2");
  set({{"SLURM_NNODES", "4"}});
  const std::string message = error();
  EXPECT_NE(message.find("SLURM_NNODES=4"), std::string::npos) << message;
  EXPECT_NE(message.find("MASTER_ADDR"), std::string::npos) << message;
}

TEST_F(LaunchEnvironmentTest, SlurmAllocationWithoutSrunIsASingleProcess) {
  set({{"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "1"}});
  EXPECT_EQ(read_launch_environment().launcher, "single");
}

TEST_F(LaunchEnvironmentTest, Pmi) {
  set({{"PMI_RANK", "1"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "1"}});
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.launcher, "pmi");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 3);
  EXPECT_EQ(e.local_rank, 1);
  // No job id from the launcher: the parent process names the job.
  EXPECT_EQ(e.job_id.rfind("pmi-ppid" + std::to_string(getppid()) + "-", 0), 0u) << e.job_id;
}

// The ranks per node, which init_mesh_from_env() takes as the default shard size.
TEST_F(LaunchEnvironmentTest, LocalWorldSizePerLauncher) {
  EXPECT_EQ(read_launch_environment().local_world_size, 1);  // a single process
  set({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(read_launch_environment().local_world_size, 0);  // not given
  set({{"LOCAL_WORLD_SIZE", "4"}});
  LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.local_world_size_variable, "LOCAL_WORLD_SIZE");
  set({{"LOCAL_WORLD_SIZE", "9"}});
  EXPECT_NE(error().find("LOCAL_WORLD_SIZE=9 is outside [1, 8]"), std::string::npos) << error();
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("LOCAL_WORLD_SIZE");

  set({{"OMPI_COMM_WORLD_RANK", "1"},
       {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(read_launch_environment().local_world_size, 2);
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    unsetenv(v);
  }

  set({{"SLURM_PROCID", "3"},
       {"SLURM_NTASKS", "8"},
       {"SLURM_NNODES", "2"},
       {"MASTER_ADDR", "h"},
       {"MASTER_PORT", "1"},
       {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}});
  e = read_launch_environment();
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.local_world_size_variable, "SLURM_STEP_TASKS_PER_NODE");
  // Nodes with different task counts give no single shard size.
  set({{"SLURM_STEP_TASKS_PER_NODE", "5,3"}});
  EXPECT_EQ(read_launch_environment().local_world_size, 0);
  unsetenv("SLURM_STEP_TASKS_PER_NODE");
  set({{"SLURM_TASKS_PER_NODE", "4(x2)"}});
  EXPECT_EQ(read_launch_environment().local_world_size, 4);
}

TEST_F(LaunchEnvironmentTest, InitMeshFromEnv) {
  const DeviceMesh mesh = init_mesh_from_env();  // a single process: a mesh of one
  EXPECT_EQ(mesh.shape(), "1x1");
  EXPECT_EQ(mesh.shard.get(), mesh.world.get());
  // A launcher that gives no ranks per node needs the shard size from the caller.
  set({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  try {
    init_mesh_from_env();
    ADD_FAILURE() << "init_mesh_from_env() guessed a shard size";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("fsdp_muon::init_mesh_from_env: the torchrun launcher gives no number "
                           "of ranks per node"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("pass shard_size"), std::string::npos) << message;
  }
}

TEST_F(LaunchEnvironmentTest, TorchrunInsideSrunUsesTorchrunsRanks) {
  set({{"SLURM_PROCID", "1"},
       {"SLURM_NTASKS", "2"},
       {"SLURM_LOCALID", "0"},
       {"RANK", "5"},
       {"WORLD_SIZE", "8"},
       {"LOCAL_RANK", "1"},
       {"MASTER_ADDR", "n0"},
       {"MASTER_PORT", "9"},
       {"TORCHELASTIC_RUN_ID", "x"}});
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
}

TEST_F(LaunchEnvironmentTest, MpirunInsideSlurmAllocationUsesMpirunsRanks) {
  set({{"SLURM_PROCID", "0"},
       {"SLURM_NTASKS", "1"},
       {"OMPI_COMM_WORLD_RANK", "3"},
       {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.launcher, "mpirun");
  EXPECT_EQ(e.rank, 3);
}

TEST_F(LaunchEnvironmentTest, AgreeingVariablesFromAJobScriptAreFine) {
  set({{"SLURM_PROCID", "1"},
       {"SLURM_NTASKS", "2"},
       {"SLURM_NNODES", "1"},
       {"RANK", "1"},
       {"WORLD_SIZE", "2"}});
  const LaunchEnvironment e = read_launch_environment();
  EXPECT_EQ(e.launcher, "srun");
  EXPECT_EQ(e.rank, 1);
}

TEST_F(LaunchEnvironmentTest, ContradictoryRanks) {
  set({{"RANK", "1"},
       {"WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_RANK", "0"},
       {"OMPI_COMM_WORLD_SIZE", "2"}});
  const std::string message = error();
  EXPECT_NE(message.find("RANK=1"), std::string::npos) << message;
  EXPECT_NE(message.find("OMPI_COMM_WORLD_RANK=0"), std::string::npos) << message;
}

TEST_F(LaunchEnvironmentTest, ContradictoryWorldSizes) {
  set({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"RANK", "0"}, {"WORLD_SIZE", "3"}});
  const std::string message = error();
  EXPECT_NE(message.find("SLURM_NTASKS=2"), std::string::npos) << message;
  EXPECT_NE(message.find("WORLD_SIZE=3"), std::string::npos) << message;
}

TEST_F(LaunchEnvironmentTest, ContradictoryLocalRanks) {
  set({{"PMI_RANK", "1"},
       {"PMI_SIZE", "2"},
       {"MPI_LOCALRANKID", "0"},
       {"OMPI_COMM_WORLD_RANK", "1"},
       {"OMPI_COMM_WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  const std::string message = error();
  EXPECT_NE(message.find("MPI_LOCALRANKID=0"), std::string::npos) << message;
  EXPECT_NE(message.find("OMPI_COMM_WORLD_LOCAL_RANK=1"), std::string::npos) << message;
}

TEST_F(LaunchEnvironmentTest, RankOutsideWorld) {
  set({{"RANK", "5"}, {"WORLD_SIZE", "2"}});
  EXPECT_NE(error().find("RANK=5 is outside"), std::string::npos) << error();
  // Errors name the call that read the environment.
  EXPECT_EQ(error().rfind("fsdp_muon::read_launch_environment: RANK=5 is outside", 0), 0u)
      << error();
}

TEST_F(LaunchEnvironmentTest, NegativeRank) {
  set({{"OMPI_COMM_WORLD_RANK", "-1"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_NE(error().find("OMPI_COMM_WORLD_RANK=-1 is outside"), std::string::npos) << error();
}

TEST_F(LaunchEnvironmentTest, LocalRankOutsideWorld) {
  set({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "2"}});
  EXPECT_NE(error().find("SLURM_LOCALID=2"), std::string::npos) << error();
}

TEST_F(LaunchEnvironmentTest, ZeroWorldSize) {
  set({{"PMI_RANK", "0"}, {"PMI_SIZE", "0"}});
  EXPECT_NE(error().find("PMI_SIZE=0 must be at least 1"), std::string::npos) << error();
}

TEST_F(LaunchEnvironmentTest, NonIntegerValues) {
  for (const char* bad : {"two", "1.5", "3x", " 1", "99999999999"}) {
    SetUp();
    set({{"RANK", "0"}, {"WORLD_SIZE", bad}});
    EXPECT_NE(error().find("WORLD_SIZE='" + std::string(bad) + "' is not an integer"),
              std::string::npos)
        << error();
  }
  SetUp();
  set({{"SLURM_PROCID", "first"}, {"SLURM_NTASKS", "2"}});
  EXPECT_NE(error().find("SLURM_PROCID='first'"), std::string::npos) << error();
}

TEST_F(LaunchEnvironmentTest, RankWithoutWorldSizeAndTheReverse) {
  set({{"RANK", "0"}});
  EXPECT_NE(error().find("RANK is set but WORLD_SIZE is not"), std::string::npos) << error();
  SetUp();
  set({{"WORLD_SIZE", "2"}});
  EXPECT_NE(error().find("WORLD_SIZE is set but RANK is not"), std::string::npos) << error();
  SetUp();
  set({{"SLURM_PROCID", "0"}});
  EXPECT_NE(error().find("SLURM_NTASKS"), std::string::npos) << error();
}

TEST_F(LaunchEnvironmentTest, MasterAddrAndPortComeTogether) {
  set({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "n0"}});
  EXPECT_NE(error().find("MASTER_PORT is not"), std::string::npos) << error();
  SetUp();
  set({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "29500"}});
  EXPECT_NE(error().find("MASTER_ADDR is not"), std::string::npos) << error();
}

TEST_F(LaunchEnvironmentTest, BadPorts) {
  set({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "n0"}, {"MASTER_PORT", "70000"}});
  EXPECT_NE(error().find("MASTER_PORT=70000"), std::string::npos) << error();
  set({{"MASTER_PORT", "http"}});
  EXPECT_NE(error().find("MASTER_PORT='http' is not an integer"), std::string::npos) << error();
  set({{"MASTER_PORT", "0"}});
  EXPECT_NE(error().find("MASTER_PORT=0 only works for a single process"), std::string::npos)
      << error();
  set({{"WORLD_SIZE", "1"}});
  EXPECT_EQ(read_launch_environment().master_port, 0);
}

TEST_F(LaunchEnvironmentTest, HandSetRanksNeedAnAddress) {
  set({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  EXPECT_NE(error().find("MASTER_ADDR is not set"), std::string::npos) << error();
}

TEST_F(LaunchEnvironmentTest, EmptyVariablesCountAsUnset) {
  set({{"RANK", ""}, {"WORLD_SIZE", ""}, {"MASTER_ADDR", ""}});
  EXPECT_EQ(read_launch_environment().launcher, "single");
}

// init_from_env() in a world of one: no launcher, or a hand-set one whose rank 0 serves the
// store on a port the OS picks.
TEST_F(LaunchEnvironmentTest, InitFromEnvSingleProcess) {
  for (const bool tcp : {false, true}) {
    SetUp();
    if (tcp) {
      set({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "0"}});
    }
    InitOptions options;
    options.backend = "gloo";
    options.timeout_seconds = 20;
    auto comm = init_from_env(options);
    ASSERT_TRUE(comm);
    EXPECT_EQ(comm->rank(), 0);
    EXPECT_EQ(comm->size(), 1);
    EXPECT_EQ(comm->backend_name(), "gloo");
    EXPECT_EQ(comm->device(), c10::Device(c10::kCPU));
    at::Tensor t = at::arange(4, at::kFloat);
    comm->all_reduce(t);
    EXPECT_TRUE(at::equal(t, at::arange(4, at::kFloat)));
    at::Tensor out = at::zeros({4});
    comm->reduce_scatter_mean(t, out);
    EXPECT_TRUE(at::equal(out, t));
    comm->all_gather(t, out.zero_());
    EXPECT_TRUE(at::equal(out, t));
    comm->barrier();
    EXPECT_EQ(comm->stats().total_bytes(), 0);
  }
}

TEST(CommBackendTest, NamesRoundTrip) {
  EXPECT_STREQ(to_string(CommBackend::kAuto), "auto");
  EXPECT_STREQ(to_string(CommBackend::kNccl), "nccl");
  EXPECT_STREQ(to_string(CommBackend::kGloo), "gloo");
  for (const auto backend : {CommBackend::kAuto, CommBackend::kNccl, CommBackend::kGloo}) {
    EXPECT_EQ(parse_comm_backend(to_string(backend)), backend) << to_string(backend);
  }
  EXPECT_EQ(parse_comm_backend("mpi"), std::nullopt);
  EXPECT_EQ(parse_comm_backend("Gloo"), std::nullopt);
  EXPECT_EQ(parse_comm_backend(""), std::nullopt);
  // InitOptions::backend stays a string: a name, or a CommBackend spelled by to_string.
  InitOptions options;
  EXPECT_EQ(options.backend, "auto");
  options.backend = to_string(CommBackend::kGloo);
  EXPECT_EQ(options.backend, "gloo");
}

TEST_F(LaunchEnvironmentTest, InitFromEnvBackendChoice) {
  InitOptions options;
  options.backend = "mpi";
  try {
    init_from_env(options);
    ADD_FAILURE() << "backend mpi accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "fsdp_muon::init_from_env: InitOptions::backend='mpi' is not one of auto, nccl, gloo"),
        std::string::npos)
        << e.what();
  }
  set({{"FSDP_MUON_BACKEND", "ucc"}});
  try {
    init_from_env();
    ADD_FAILURE() << "FSDP_MUON_BACKEND=ucc accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP_MUON_BACKEND='ucc'"), std::string::npos);
  }
  set({{"FSDP_MUON_BACKEND", "gloo"}});
  EXPECT_EQ(init_from_env()->backend_name(), "gloo");
  options.backend = "auto";
  options.timeout_seconds = 0;
  EXPECT_THROW(init_from_env(options), c10::Error);
}

// Asking for NCCL: a clear error without a GPU; with one (world of one, cuda:0) every
// collective runs on the current stream and gives the single-rank answers.
TEST_F(LaunchEnvironmentTest, InitFromEnvNccl) {
  InitOptions options;
  options.backend = "nccl";
  options.timeout_seconds = 60;
  if (!FSDP_MUON_WITH_CUDA || !torch::cuda::is_available()) {
    try {
      init_from_env(options);
      ADD_FAILURE() << "NCCL without CUDA accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("asks for NCCL but"), std::string::npos) << e.what();
    }
    return;
  }
  auto comm = init_from_env(options);
  EXPECT_EQ(comm->backend_name(), "nccl");
  EXPECT_EQ(comm->device(), c10::Device(c10::kCUDA, 0));
  const auto on = at::TensorOptions().device(comm->device());
  at::Tensor t = at::arange(5, on.dtype(at::kFloat));
  comm->all_reduce(t, ReduceOp::kMax);
  at::Tensor out = at::zeros({5}, on);
  comm->reduce_scatter_mean(t, out);
  EXPECT_TRUE(at::equal(out.cpu(), at::arange(5, at::kFloat)));
  comm->all_gather(t, out.zero_());
  EXPECT_TRUE(at::equal(out.cpu(), at::arange(5, at::kFloat)));
  at::Tensor recv = at::zeros({5}, on);
  comm->all_to_all_v(t, {5}, recv, {5});
  EXPECT_TRUE(at::equal(recv.cpu(), at::arange(5, at::kFloat)));
  comm->broadcast(t, 0);
  comm->barrier();
  EXPECT_EQ(comm->stats().total_bytes(), 0);
}

// NCCL in a world of more than one needs the local rank to pick the GPU; the error comes before
// any CUDA check, so it shows on a machine without CUDA too, and before any rendezvous.
TEST_F(LaunchEnvironmentTest, InitFromEnvNcclNeedsTheLocalRank) {
  set({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}});
  InitOptions options;
  options.backend = "nccl";
  options.timeout_seconds = 5;
  try {
    init_from_env(options);
    ADD_FAILURE() << "NCCL without a local rank accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "fsdp_muon::init_from_env: NCCL (asked for by InitOptions::backend) in a world "
                  "of 2 ranks needs this rank's local rank to choose its GPU, but none of "
                  "LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID is set"),
              std::string::npos)
        << e.what();
  }
  SetUp();
  set({{"OMPI_COMM_WORLD_RANK", "0"},
       {"OMPI_COMM_WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
       {"FSDP_MUON_BACKEND", "nccl"}});
  try {
    init_from_env();
    ADD_FAILURE() << "NCCL without a local rank accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL (asked for by FSDP_MUON_BACKEND) in a world of 2"),
              std::string::npos)
        << e.what();
  }
}

// FSDP_MUON_TIMEOUT replaces InitOptions::timeout_seconds when set; anything but a positive,
// finite decimal number of seconds is an error naming it (set but empty, hexadecimal and signs
// included), and so is such an option.
TEST_F(LaunchEnvironmentTest, InitFromEnvTimeout) {
  InitOptions options;
  options.backend = "gloo";
  for (const char* bad : {"0", "-1", "inf", "nan", "3s", " 3", "1e10", "soon", "", "0x10", "0X1p4",
                          "+5", ".", "1e", "1.5e+"}) {
    set({{"FSDP_MUON_TIMEOUT", bad}});
    try {
      init_from_env(options);
      ADD_FAILURE() << "FSDP_MUON_TIMEOUT=" << bad << " accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("fsdp_muon::init_from_env: FSDP_MUON_TIMEOUT='" +
                                           std::string(bad) + "' is not a timeout in seconds"),
                std::string::npos)
          << e.what();
    }
  }
  for (const char* good : {"2.5", "30", "7.", ".5", "1e2", "2E+1"}) {
    set({{"FSDP_MUON_TIMEOUT", good}});
    options.timeout_seconds = -1;  // replaced by the variable
    EXPECT_EQ(init_from_env(options)->size(), 1) << good;
  }
  unsetenv("FSDP_MUON_TIMEOUT");
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()}) {
    options.timeout_seconds = bad;
    try {
      init_from_env(options);
      ADD_FAILURE() << "timeout_seconds=" << bad << " accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(
          std::string(e.what()).find("fsdp_muon::init_from_env: InitOptions::timeout_seconds="),
          std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("must be positive and finite"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace fsdp_muon
