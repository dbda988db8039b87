// FsdpMuon on one GPU over NCCL (a world of one): the CUDA path end to end — the sharded groups
// on cuda:0, the exchange on NCCL, Newton–Schulz through cuBLAS on the current stream — must give
// single-device Muon's parameters bit for bit, and the phase times must be execution times
// (CUDA events). Skips, saying why, where no GPU is usable; scripts/gpu-check runs it on a GPU.

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "common/test_util.h"

namespace fsdp_muon {
namespace {

// A world of one whatever launcher started the test binary: its variables are cleared first.
std::shared_ptr<Communicator> nccl_world_of_one() {
  for (const char* var :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "PMI_RANK",
        "PMI_SIZE", "FSDP_MUON_BACKEND"}) {
    ::unsetenv(var);
  }
  InitOptions options;
  options.backend = "nccl";
  options.timeout_seconds = 60;
  return init_from_env(options);
}

// Shapes with a row of 1, a column of 1 and a tall matrix, in two groups.
std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>> shapes() {
  return {{{"a.w", {48, 96}}, {"a.row", {1, 33}}, {"a.tall", {80, 24}}},
          {{"b.col", {17, 1}}, {"b.w", {64, 64}}}};
}

TEST(FsdpMuonCuda, MatchesSingleDeviceMuonBitwiseAndTimesPhasesWithEvents) {
  FSDP_MUON_REQUIRE_GPU("FsdpMuon over NCCL is checked on a GPU");
  auto comm = nccl_world_of_one();
  ASSERT_EQ(comm->device(), c10::Device(c10::kCUDA, 0));
  const auto on_gpu = at::TensorOptions().device(comm->device());
  at::manual_seed(11);
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<at::Tensor> reference;
  std::vector<at::Tensor> sharded;
  for (const auto& group_shapes : shapes()) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& [name, shape] : group_shapes) {
      at::Tensor p = at::randn(shape, on_gpu).requires_grad_(true);
      reference.push_back(p.detach().clone().requires_grad_(true));
      named.emplace_back(name, p);
    }
    groups.push_back(std::make_shared<FsdpParameterGroup>(std::move(named), comm));
    for (const at::Tensor& s : groups.back()->sharded_parameters()) sharded.push_back(s);
  }
  for (const bool fp32 : {true, false}) {
    SCOPED_TRACE(fp32 ? "fp32 Newton-Schulz" : "bf16 Newton-Schulz");
    const MuonOptions options = MuonOptions(0.02).newton_schulz(
        NewtonSchulzOptions().compute_dtype(fp32 ? at::kFloat : at::kBFloat16));
    std::vector<at::Tensor> ref_params;
    for (const at::Tensor& r : reference) ref_params.push_back(r.detach().clone().requires_grad_());
    // Both start from the same weights.
    {
      at::NoGradGuard no_grad;
      size_t k = 0;
      for (const auto& group : groups) {
        for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
          group->sharded_parameter(i).copy_(ref_params[k].detach().flatten());
        }
        group->refresh_model_weights();
      }
    }
    FsdpMuon fsdp(sharded, options);
    Muon muon(ref_params, options);
    for (int step = 0; step < 3; ++step) {
      size_t k = 0;
      for (const auto& group : groups) {
        group->zero_grad();
        for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
          const at::Tensor g = at::randn(ref_params[k].sizes(), on_gpu);
          ref_params[k].mutable_grad() = g.clone();
          group->sharded_parameter(i).grad().copy_(g.flatten());
        }
      }
      fsdp.step();
      muon.step();
    }
    size_t k = 0;
    for (const auto& group : groups) {
      for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
        EXPECT_TRUE(
            at::equal(group->sharded_parameter(i).cpu(), ref_params[k].detach().flatten().cpu()))
            << group->slot(i).name;
      }
    }
    // Phase times are CUDA event times: positive, and together no longer than the synchronized
    // wall time of the step that produced them.
    torch::cuda::synchronize(0);
    const auto wall_start = std::chrono::steady_clock::now();
    fsdp.step();
    torch::cuda::synchronize(0);
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
    const FsdpMuonStepStats& stats = fsdp.last_step_stats();
    const double phases = stats.check_seconds + stats.elementwise_seconds + stats.gather_seconds +
                          stats.orthogonalize_seconds + stats.scatter_seconds +
                          stats.apply_seconds + stats.refresh_seconds;
    EXPECT_GT(stats.orthogonalize_seconds, 0.0);
    EXPECT_LE(phases, wall * 1.05 + 1e-4);
  }
}

}  // namespace
}  // namespace fsdp_muon
