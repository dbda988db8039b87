// Full sharding on one GPU over NCCL (a world of one on cuda:0): the asynchronous gathers and
// reduce-scatters run on the communication stream while autograd's device thread computes, so
// this is where a missing stream wait or an early free shows. kOptimGrads and kOptimGradsParams
// must train bit for bit like kOptim with one micro-batch, and prefetch off like prefetch on, as
// on the CPU (tests/fsdp/full_sharding_distributed_test.cpp). Skips, saying why, where no GPU
// is usable; scripts/gpu-check runs it (label gpu).

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fsdp_muon/comm/nccl_communicator.h>
#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "common/block_stack.h"
#include "common/test_util.h"

#if FSDP_MUON_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

#include "comm/nccl_internal.h"
#endif

namespace fsdp_muon {
namespace {

std::shared_ptr<Communicator> nccl_world_of_one() {
  return make_nccl_communicator(c10::make_intrusive<c10d::HashStore>(), /*rank=*/0, /*size=*/1,
                                /*device_index=*/0, std::chrono::seconds(120));
}

// Rows and columns of 1 and odd sizes, and a wide block so that the collectives take long
// enough to overlap with compute.
const std::vector<int64_t> kDims = {6, 11, 5, 1, 7, 384, 3};

using testing::Block;
using testing::Stack;

// One model on cuda:0, one group per block, FsdpMuon on the matrices and AdamW on the rest.
struct Training {
  Training(const std::shared_ptr<Communicator>& comm, ShardingStrategy strategy, bool prefetch,
           const std::vector<int64_t>& dims = kDims, int64_t rows = 64)
      : dims(dims), rows(rows) {
    at::manual_seed(3);
    net = Stack(dims);
    net->to(comm->device());
    groups = shard_module(
        *net, comm,
        ShardModuleOptions().group_options(
            FsdpParameterGroupOptions().sharding_strategy(strategy).prefetch(prefetch)));
    std::vector<at::Tensor> matrices, others;
    for (const auto& g : groups) {
      for (size_t i = 0; i < g->num_parameters(); ++i) {
        (g->slot(i).shape.size() == 2 ? matrices : others).push_back(g->sharded_parameter(i));
      }
    }
    muon =
        std::make_unique<FsdpMuon>(matrices, MuonOptions(0.02).weight_decay(0.01).newton_schulz(
                                                 NewtonSchulzOptions().compute_dtype(at::kFloat)));
    adamw = std::make_unique<torch::optim::AdamW>(
        others, torch::optim::AdamWOptions(0.01).weight_decay(0.01));
  }

  // zero_grad, forward through the groups, backward, reduce_scatter_grads, the steps; returns
  // the loss (on the host).
  double step(int step_index, int micro_batches) {
    for (auto& g : groups) g->zero_grad();
    const double total = forward_backward(step_index, micro_batches);
    for (auto& g : groups) g->reduce_scatter_grads();
    adamw->step();
    muon->step();
    return total;
  }

  // The micro-batches' forward and backward through the groups; returns the summed loss.
  double forward_backward(int step_index, int micro_batches) {
    double total = 0;
    for (int m = 0; m < micro_batches; ++m) {
      at::manual_seed(500 + 10 * step_index + 1000 * m);
      at::Tensor h = at::randn({rows, dims.front()}).to(groups[0]->sharded_parameter(0).device());
      for (size_t k = 0; k < groups.size(); ++k) {
        Block block = net->blocks[k];
        h = groups[k]->forward([&](const at::Tensor& x) { return block->forward(x); }, h);
      }
      const at::Tensor loss = h.pow(2).mean() / micro_batches;
      loss.backward();
      total += loss.item<double>();
    }
    return total;
  }

  std::vector<int64_t> dims;
  int64_t rows;
  Stack net{nullptr};
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::unique_ptr<FsdpMuon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
};

// Main-weight shards and model weights (gathered where resharded) bitwise equal.
void expect_same_model(Training& a, Training& b, const std::string& what) {
  ASSERT_EQ(a.groups.size(), b.groups.size());
  for (size_t g = 0; g < a.groups.size(); ++g) {
    auto& ga = *a.groups[g];
    auto& gb = *b.groups[g];
    ga.unshard();
    gb.unshard();
    EXPECT_TRUE(torch::equal(ga.main_weight_shard().cpu(), gb.main_weight_shard().cpu()))
        << what << ": main weights of group " << ga.name();
    EXPECT_TRUE(torch::equal(ga.model_weights().cpu(), gb.model_weights().cpu()))
        << what << ": model weights of group " << ga.name();
    ga.reshard();
    gb.reshard();
  }
}

constexpr int kSteps = 3;

TEST(FullShardingCuda, StrategiesTrainBitwiseLikeKOptimWithOneMicroBatch) {
  FSDP_MUON_REQUIRE_GPU("full sharding over NCCL is checked on a GPU");
  const auto comm = nccl_world_of_one();
  Training reference(comm, ShardingStrategy::kOptim, /*prefetch=*/true);
  Training grads(comm, ShardingStrategy::kOptimGrads, /*prefetch=*/true);
  Training params(comm, ShardingStrategy::kOptimGradsParams, /*prefetch=*/true);
  for (int s = 0; s < kSteps; ++s) {
    const double l0 = reference.step(s, 1);
    EXPECT_EQ(grads.step(s, 1), l0) << "kOptimGrads, step " << s;
    EXPECT_EQ(params.step(s, 1), l0) << "kOptimGradsParams, step " << s;
  }
  expect_same_model(reference, grads, "kOptimGrads");
  expect_same_model(reference, params, "kOptimGradsParams");
}

TEST(FullShardingCuda, PrefetchOffGivesTheSameBits) {
  FSDP_MUON_REQUIRE_GPU("full sharding over NCCL is checked on a GPU");
  const auto comm = nccl_world_of_one();
  for (const ShardingStrategy strategy :
       {ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams}) {
    Training on(comm, strategy, /*prefetch=*/true);
    Training off(comm, strategy, /*prefetch=*/false);
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(on.step(s, 2), off.step(s, 2)) << to_string(strategy) << ", step " << s;
    }
    expect_same_model(on, off, std::string("prefetch off, ") + to_string(strategy));
  }
}

#if FSDP_MUON_WITH_CUDA
// Every asynchronous collective sleeps on the communication stream first while it lives
// (nccl_internal.h): a result read without the wait that orders it is then read too early,
// every time, rather than when the timing happens to be unlucky.
struct DelayedCollectives {
  explicit DelayedCollectives(int64_t cycles) {
    detail::set_async_collective_delay_for_testing(cycles);
  }
  ~DelayedCollectives() { detail::set_async_collective_delay_for_testing(0); }
  DelayedCollectives(const DelayedCollectives&) = delete;
  DelayedCollectives& operator=(const DelayedCollectives&) = delete;
};

// Every strategy, with prefetch, trains to the same bits when each asynchronous gather and
// reduce-scatter starts ~10 ms late on the communication stream: every consumer of their results
// (forward, backward, FsdpMuon's and AdamW's steps, the refresh) waits for them.
TEST(FullShardingCuda, DelayedCollectivesGiveTheSameBits) {
  FSDP_MUON_REQUIRE_GPU("the stream order of the asynchronous collectives is checked on a GPU");
  const auto comm = nccl_world_of_one();
  for (const ShardingStrategy strategy : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                          ShardingStrategy::kOptimGradsParams}) {
    Training prompt(comm, strategy, /*prefetch=*/true);
    Training delayed(comm, strategy, /*prefetch=*/true);
    for (int s = 0; s < kSteps; ++s) {
      const double expected = prompt.step(s, 2);
      const DelayedCollectives late(20'000'000);
      EXPECT_EQ(delayed.step(s, 2), expected) << to_string(strategy) << ", step " << s;
    }
    expect_same_model(prompt, delayed, std::string("delayed collectives, ") + to_string(strategy));
  }
}

// Bytes the CUDA caching allocator holds for live tensors and for freed blocks still waiting
// for another stream (active_bytes): what a record_stream'd block keeps from reuse shows here.
int64_t active_bytes(bool peak) {
  // getDeviceStats returns by value: keep the copy alive while reading from it.
  const c10::CachingDeviceAllocator::DeviceStats stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  const auto& stat =
      stats.active_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return peak ? stat.peak : stat.current;
}
#endif

// The allocator's peak over forward, backward and the reduce-scatters of a ZeRO-3 step stays
// within the library's own count (peak_total_unsharded_bytes: two groups' weights and gradients
// with prefetch) plus the staging it does not count: autograd's gradient of one weight before it
// is accumulated into the group's buffer, and the activations (kept tiny: 4 rows). Blocks kept
// from reuse after the asynchronous collectives (record_stream on the communication stream)
// would add about a group of weights and one of gradients (docs/DESIGN.md §5, Memory).
TEST(FullShardingCuda, AllocatorPeakStaysWithinTheLibrarysCountPlusNamedStaging) {
  FSDP_MUON_REQUIRE_GPU("full sharding over NCCL is checked on a GPU");
#if FSDP_MUON_WITH_CUDA
  const auto comm = nccl_world_of_one();
  const std::vector<int64_t> wide(7, 1024);  // six groups of 4 MiB of weights
  for (const bool prefetch : {true, false}) {
    Training run(comm, ShardingStrategy::kOptimGradsParams, prefetch, wide, /*rows=*/4);
    for (int s = 0; s < 2; ++s) run.step(s, 1);  // optimizer state, cuBLAS workspaces
    for (auto& g : run.groups) g->zero_grad();
    torch::cuda::synchronize(0);
    const int64_t before = active_bytes(false);
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    reset_peak_total_unsharded_bytes(run.groups);
    run.forward_backward(2, 1);
    for (auto& g : run.groups) g->reduce_scatter_grads();
    torch::cuda::synchronize(0);
    const int64_t allocator = active_bytes(true) - before;
    const int64_t library = peak_total_unsharded_bytes(run.groups);
    int64_t largest_weights = 0;
    for (const auto& g : run.groups)
      largest_weights = std::max(largest_weights, 4 * g->padded_numel());
    const int64_t staging = largest_weights + (1 << 20);
    std::cout << "prefetch " << (prefetch ? "on" : "off") << ": allocator peak "
              << allocator / 1048576.0 << " MiB, library's count " << library / 1048576.0
              << " MiB, named staging " << staging / 1048576.0 << " MiB\n";
    EXPECT_GE(allocator, library) << "prefetch " << prefetch;
    EXPECT_LE(allocator, library + staging) << "prefetch " << prefetch;
  }
#endif
}

}  // namespace
}  // namespace fsdp_muon
