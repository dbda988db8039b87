// Full sharding across real processes (torchrun / mpirun, world sizes 1-4, Gloo on CPU): a small
// multi-block model trained through FsdpParameterGroup::forward() under kOptimGrads and
// kOptimGradsParams gives the bits of kOptim with one micro-batch (AdamW + FsdpMuon with fp32
// Newton-Schulz) and agrees to 1e-5 with gradient accumulation; prefetch on and off give the same
// bits; what each rank holds unsharded between steps and at its peak; resharded weights used
// outside forward() are refused; checkpoints and exports work while the weights are resharded.

#include <gtest/gtest.h>

#include <ftw.h>
#include <stdio.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "common/block_stack.h"
#include "common/distributed_main.h"

namespace fsdp_muon {
namespace {

using testing::world;
using testing::world_ptr;

// A column of 1, a row of 1 and sizes no world size up to 4 divides: some rank holds nothing of
// some parameter at W >= 2, and every group needs padding somewhere.
const std::vector<int64_t> kDims = {6, 11, 5, 1, 7, 3};

using testing::Block;
using testing::Stack;

struct TrainingOptions {
  ShardingStrategy strategy = ShardingStrategy::kOptim;
  bool prefetch = true;
  std::optional<c10::ScalarType> compute_dtype = std::nullopt;
  uint64_t seed = 3;
  std::optional<c10::ScalarType> reduce_dtype = std::nullopt;
};

// One model, its groups (one per block) and its optimizers: FsdpMuon on the matrices, AdamW on
// the rest.
struct Training {
  explicit Training(const TrainingOptions& o) {
    {
      testing::SeededRandom random(o.seed);
      net = Stack(kDims);
    }
    auto group_options =
        FsdpParameterGroupOptions().sharding_strategy(o.strategy).prefetch(o.prefetch);
    group_options.compute_dtype(o.compute_dtype);
    group_options.reduce_dtype(o.reduce_dtype);
    groups = shard_module(*net, world_ptr(), ShardModuleOptions().group_options(group_options));
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

  std::vector<torch::optim::Optimizer*> optimizers() { return {muon.get(), adamw.get()}; }

  // The training loop of every strategy: zero_grad, forward through the groups, backward,
  // reduce_scatter_grads, the optimizers' steps (FsdpMuon refreshes its groups' weights).
  double step(int step_index, int micro_batches) {
    for (auto& g : groups) g->zero_grad();
    double total = 0;
    for (int m = 0; m < micro_batches; ++m) {
      at::Tensor h;
      {
        testing::SeededRandom random(500 + 10 * step_index + 1000 * m + world().rank());
        h = at::randn({4, kDims.front()}).to(groups[0]->compute_dtype());  // each rank its own
      }
      for (size_t k = 0; k < groups.size(); ++k) {
        Block block = net->blocks[k];
        h = groups[k]->forward([&](const at::Tensor& x) { return block->forward(x); }, h);
      }
      const at::Tensor loss = h.to(at::kFloat).pow(2).mean() / micro_batches;
      loss.backward();
      total += loss.item<double>();
    }
    for (auto& g : groups) g->reduce_scatter_grads();
    adamw->step();
    muon->step();
    return total;
  }

  Stack net{nullptr};
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::unique_ptr<FsdpMuon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
};

// Largest relative difference over all ranks (so every rank takes the same branch).
double global_max(double local) {
  at::Tensor t = torch::tensor({local}, torch::kDouble);
  world().all_reduce(t, ReduceOp::kMax);
  return t.item<double>();
}

double relative_difference(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0;
  const double scale = std::max(b.abs().max().item<double>(), 1e-30);
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

// Main-weight shards, optimizer-visible gradient shards and the model weights (gathered where
// the strategy reshards them) of `a` and `b`: bitwise equal, or within `rtol`.
void expect_same_model(Training& a, Training& b, double rtol, const std::string& what) {
  ASSERT_EQ(a.groups.size(), b.groups.size());
  for (size_t g = 0; g < a.groups.size(); ++g) {
    auto& ga = *a.groups[g];
    auto& gb = *b.groups[g];
    ga.unshard();
    gb.unshard();
    const std::vector<std::pair<std::string, std::pair<at::Tensor, at::Tensor>>> pairs = {
        {"main weights", {ga.main_weight_shard(), gb.main_weight_shard()}},
        {"model weights", {ga.model_weights(), gb.model_weights()}}};
    for (const auto& [name, tensors] : pairs) {
      if (rtol == 0) {
        EXPECT_TRUE(torch::equal(tensors.first, tensors.second))
            << what << ": " << name << " of group " << ga.name() << " on rank " << world().rank()
            << " differ by " << relative_difference(tensors.first, tensors.second);
      } else {
        EXPECT_LE(global_max(relative_difference(tensors.first, tensors.second)), rtol)
            << what << ": " << name << " of group " << ga.name();
      }
    }
    ga.reshard();
    gb.reshard();
  }
}

int64_t weight_bytes(const Training& run) {
  int64_t bytes = 0;
  for (const auto& g : run.groups) {
    bytes += g->padded_numel() * static_cast<int64_t>(c10::elementSize(g->compute_dtype()));
  }
  return bytes;
}

// The two largest groups' weights and full gradients together: what the issue allows the peak
// under kOptimGradsParams (the group in use and the prefetched one).
int64_t two_largest_groups_bytes(const Training& run) {
  std::vector<int64_t> sizes;
  for (const auto& g : run.groups) {
    sizes.push_back(2 * g->padded_numel() *
                    static_cast<int64_t>(c10::elementSize(g->compute_dtype())));
  }
  std::sort(sizes.rbegin(), sizes.rend());
  return sizes[0] + (sizes.size() > 1 ? sizes[1] : 0);
}

constexpr int kSteps = 3;

FSDP_MUON_WORLD_TEST(FullSharding, StrategiesTrainBitwiseLikeKOptimWithOneMicroBatch) {
  Training reference({ShardingStrategy::kOptim});
  Training grads({ShardingStrategy::kOptimGrads});
  Training params({ShardingStrategy::kOptimGradsParams});
  for (int s = 0; s < kSteps; ++s) {
    const double l0 = reference.step(s, 1);
    EXPECT_EQ(grads.step(s, 1), l0) << "step " << s;
    EXPECT_EQ(params.step(s, 1), l0) << "step " << s;
  }
  expect_same_model(reference, grads, 0, "kOptimGrads");
  expect_same_model(reference, params, 0, "kOptimGradsParams");
}

FSDP_MUON_WORLD_TEST(FullSharding, PrefetchOffGivesTheSameBits) {
  Training on({ShardingStrategy::kOptimGradsParams, /*prefetch=*/true});
  Training off({ShardingStrategy::kOptimGradsParams, /*prefetch=*/false});
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(on.step(s, 2), off.step(s, 2)) << "step " << s;
  }
  expect_same_model(on, off, 0, "prefetch off");
}

FSDP_MUON_WORLD_TEST(FullSharding, MixedPrecisionGathersTheCastShard) {
  // bf16 compute, fp32 main weights: kOptimGradsParams gathers the bf16 cast that
  // refresh_model_weights() made of its shard, the same bits kOptim's refresh all-gathers.
  Training reference({ShardingStrategy::kOptim, true, at::kBFloat16});
  Training params({ShardingStrategy::kOptimGradsParams, true, at::kBFloat16});
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(params.step(s, 1), reference.step(s, 1)) << "step " << s;
  }
  expect_same_model(reference, params, 0, "bf16 compute");
}

FSDP_MUON_WORLD_TEST(FullSharding, ReducingInAnotherDtypeSendsACastCopy) {
  // bf16 compute, fp32 averaging: the full gradients are cast and freed at once, the cast copy
  // is what travels (and is counted while in flight).
  Training reference({ShardingStrategy::kOptim, true, at::kBFloat16, 3, at::kFloat});
  Training grads({ShardingStrategy::kOptimGrads, true, at::kBFloat16, 3, at::kFloat});
  Training params({ShardingStrategy::kOptimGradsParams, true, at::kBFloat16, 3, at::kFloat});
  for (int s = 0; s < kSteps; ++s) {
    const double l0 = reference.step(s, 1);
    EXPECT_EQ(grads.step(s, 1), l0) << "step " << s;
    EXPECT_EQ(params.step(s, 1), l0) << "step " << s;
  }
  expect_same_model(reference, grads, 0, "fp32 reduce, kOptimGrads");
  expect_same_model(reference, params, 0, "fp32 reduce, kOptimGradsParams");
  EXPECT_EQ(total_unsharded_bytes(params.groups), 0);
}

FSDP_MUON_WORLD_TEST(FullSharding, GradientAccumulationAgreesWithKOptim) {
  for (const int micro_batches : {2, 3}) {
    Training reference({ShardingStrategy::kOptim});
    Training grads({ShardingStrategy::kOptimGrads});
    Training params({ShardingStrategy::kOptimGradsParams});
    for (int s = 0; s < kSteps; ++s) {
      reference.step(s, micro_batches);
      grads.step(s, micro_batches);
      params.step(s, micro_batches);
    }
    // Sums of per-micro-batch means, not a mean of sums: not bitwise, but close.
    const std::string what = std::to_string(micro_batches) + " micro-batches";
    expect_same_model(reference, grads, 1e-5, what + ", kOptimGrads");
    expect_same_model(reference, params, 1e-5, what + ", kOptimGradsParams");
  }
}

FSDP_MUON_WORLD_TEST(FullSharding, UnshardedBytesBetweenStepsAndAtThePeak) {
  for (const ShardingStrategy strategy : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                          ShardingStrategy::kOptimGradsParams}) {
    SCOPED_TRACE(to_string(strategy));
    Training run({strategy});
    const int64_t weights = weight_bytes(run);
    reset_peak_total_unsharded_bytes(run.groups);
    for (int s = 0; s < kSteps; ++s) {
      run.step(s, 2);
      const int64_t held = total_unsharded_bytes(run.groups);
      switch (strategy) {
        case ShardingStrategy::kOptim:
          EXPECT_EQ(held, 2 * weights);
          break;
        case ShardingStrategy::kOptimGrads:
          EXPECT_EQ(held, weights);
          break;
        case ShardingStrategy::kOptimGradsParams:
          EXPECT_EQ(held, 0);
          break;
      }
      for (const auto& g : run.groups) {
        EXPECT_EQ(g->unsharded_bytes() == 0, strategy == ShardingStrategy::kOptimGradsParams);
      }
      // FsdpMuon's refresh casts the shard only under kOptimGradsParams: nothing is sent.
      const int64_t refreshed = run.muon->last_step_stats().refresh_bytes;
      if (strategy == ShardingStrategy::kOptimGradsParams) {
        EXPECT_EQ(refreshed, 0);
      } else if (world().size() > 1) {
        EXPECT_GT(refreshed, 0);
      }
    }
    const int64_t peak = peak_total_unsharded_bytes(run.groups);
    if (strategy == ShardingStrategy::kOptimGradsParams) {
      EXPECT_LE(peak, two_largest_groups_bytes(run));
      EXPECT_GT(peak, 0);
    } else if (strategy == ShardingStrategy::kOptimGrads) {
      // The full gradients of the group in backward and of the one being reduce-scattered.
      EXPECT_LE(peak, weights + two_largest_groups_bytes(run) / 2);
    } else {
      EXPECT_EQ(peak, 2 * weights);
    }
    if (world().rank() == 0) {
      std::printf("W=%d %s: model %lld bytes (weights), peak unsharded %lld bytes\n",
                  world().size(), to_string(strategy), static_cast<long long>(weights),
                  static_cast<long long>(peak));
    }
  }
}

FSDP_MUON_WORLD_TEST(FullSharding, EvaluationUnderNoGradReshardsAndMatches) {
  Training reference({ShardingStrategy::kOptim});
  Training params({ShardingStrategy::kOptimGradsParams});
  reference.step(0, 1);
  params.step(0, 1);
  at::NoGradGuard no_grad;
  at::Tensor a;
  {
    testing::SeededRandom random(77);
    a = at::randn({3, kDims.front()});
  }
  at::Tensor b = a.clone();
  for (size_t k = 0; k < params.groups.size(); ++k) {
    Block ra = reference.net->blocks[k];
    Block pb = params.net->blocks[k];
    a = reference.groups[k]->forward([&](const at::Tensor& x) { return ra->forward(x); }, a);
    b = params.groups[k]->forward([&](const at::Tensor& x) { return pb->forward(x); }, b);
  }
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_EQ(total_unsharded_bytes(params.groups), 0);
}

FSDP_MUON_WORLD_TEST(FullSharding, VectorForwardRunsSeveralTensorsThroughOneGroup) {
  Training reference({ShardingStrategy::kOptim});
  Training params({ShardingStrategy::kOptimGradsParams});
  at::Tensor x, y;
  {
    testing::SeededRandom random(8);
    x = at::randn({2, kDims.front()});
    y = at::randn({5, kDims.front()});
  }
  std::vector<at::Tensor> outputs[2];
  Training* runs[2] = {&reference, &params};
  for (int r = 0; r < 2; ++r) {
    Block block = runs[r]->net->blocks[0];
    for (auto& g : runs[r]->groups) g->zero_grad();
    outputs[r] = runs[r]->groups[0]->forward(
        [&](const std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{block->forward(in[0]), block->forward(in[1])};
        },
        std::vector<at::Tensor>{x, y});
    (outputs[r][0].sum() + outputs[r][1].pow(2).sum()).backward();
    runs[r]->groups[0]->reduce_scatter_grads();
  }
  EXPECT_TRUE(torch::equal(outputs[0][0], outputs[1][0]));
  EXPECT_TRUE(torch::equal(outputs[0][1], outputs[1][1]));
  EXPECT_TRUE(torch::equal(reference.groups[0]->grad_shard(), params.groups[0]->grad_shard()));
  EXPECT_EQ(params.groups[0]->unsharded_bytes(), 0);
}

FSDP_MUON_WORLD_TEST(FullSharding, PrefetchGathersTheNextGroupInForwardAndThePreviousInBackward) {
  for (const bool prefetch : {true, false}) {
    Training run({ShardingStrategy::kOptimGradsParams, prefetch});
    run.step(0, 1);  // the first iteration records the forward order
    for (auto& g : run.groups) g->zero_grad();
    at::Tensor h;
    {
      testing::SeededRandom random(9);
      h = at::randn({4, kDims.front()});
    }
    int seen = 0;
    for (size_t k = 0; k < run.groups.size(); ++k) {
      Block block = run.net->blocks[k];
      h = run.groups[k]->forward(
          [&](const at::Tensor& x) {
            // Inside fn: this group's weights are here, the next group's are on their way
            // (allocated and being gathered) only with prefetch.
            const auto& self = *run.groups[k];
            EXPECT_EQ(self.unsharded_bytes(), self.padded_numel() * 4);
            if (k + 1 < run.groups.size()) {
              const auto& next = *run.groups[k + 1];
              EXPECT_EQ(next.unsharded_bytes(), prefetch ? next.padded_numel() * 4 : 0)
                  << "group " << k + 1 << ", prefetch " << prefetch;
            }
            if (k > 0) {
              // Runs in backward just before group k-1's own backward begins: with prefetch
              // its weights are already on their way.
              x.register_hook([&run, k, prefetch, &seen](const at::Tensor&) {
                const auto& previous = *run.groups[k - 1];
                EXPECT_EQ(previous.unsharded_bytes(), prefetch ? previous.padded_numel() * 4 : 0)
                    << "backward of group " << k << ", prefetch " << prefetch;
                ++seen;
              });
            }
            return block->forward(x);
          },
          h);
    }
    h.pow(2).mean().backward();
    EXPECT_EQ(seen, static_cast<int>(run.groups.size()) - 1);
    for (auto& g : run.groups) g->reduce_scatter_grads();
    EXPECT_EQ(total_unsharded_bytes(run.groups), 0);
  }
}

FSDP_MUON_WORLD_TEST(FullSharding, TiedWeightsThroughUnshardMatchKOptim) {
  // Block 0's weight serves twice: through its group's forward() and, as a tied output head,
  // directly, which needs unshard() until its backward has run.
  Training reference({ShardingStrategy::kOptim});
  Training params({ShardingStrategy::kOptimGradsParams});
  for (Training* run : {&reference, &params}) {
    for (auto& g : run->groups) g->zero_grad();
    at::Tensor x;
    {
      testing::SeededRandom random(21 + world().rank());
      x = at::randn({3, kDims[0]});
    }
    Block first = run->net->blocks[0];
    Block second = run->net->blocks[1];
    run->groups[0]->unshard();
    at::Tensor h =
        run->groups[0]->forward([&](const at::Tensor& in) { return first->forward(in); }, x);
    h = run->groups[1]->forward([&](const at::Tensor& in) { return second->forward(in); }, h);
    // kDims[2] = 5 features back to kDims[1] = 11 through block 0's weight: a tied head.
    const at::Tensor head =
        at::matmul(at::tanh(h).matmul(at::ones({kDims[2], kDims[1]})), first->fc->weight);
    head.pow(2).mean().backward();
    run->groups[0]->reshard();
    for (auto& g : run->groups) g->reduce_scatter_grads();
  }
  for (size_t g = 0; g < 2; ++g) {
    EXPECT_TRUE(torch::equal(reference.groups[g]->grad_shard(), params.groups[g]->grad_shard()))
        << "group " << g << " on rank " << world().rank();
  }
  EXPECT_EQ(total_unsharded_bytes(params.groups), 0);
}

// What ATen says, with the group's message, when a resharded parameter is accessed.
constexpr const char* kResharded =
    "parameter 'b1.fc.weight' is resharded (sharding strategy optim_grads_params)";
constexpr const char* kReshardedGain =
    "parameter 'b0.gain' is resharded (sharding strategy optim_grads_params)";

FSDP_MUON_WORLD_TEST(FullSharding, ReshardedWeightsAreRefusedOutsideForward) {
  Training run({ShardingStrategy::kOptimGradsParams});
  run.step(0, 1);
  Block block = run.net->blocks[1];
  auto& group = *run.groups[1];
  at::Tensor x;
  {
    testing::SeededRandom random(10);
    x = at::randn({2, kDims[1]});
  }
  try {
    block->forward(x);
    ADD_FAILURE() << "a resharded weight computed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(kResharded), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("group 'b1'"), std::string::npos) << e.what();
  }
  // unshard() makes the weights usable outside forward(), with the values forward() uses.
  group.unshard();
  EXPECT_EQ(group.unsharded_bytes(), group.padded_numel() * static_cast<int64_t>(sizeof(float)));
  const at::Tensor direct = block->forward(x);
  group.reshard();
  EXPECT_EQ(group.unsharded_bytes(), 0);
  const at::Tensor through =
      group.forward([&](const at::Tensor& in) { return block->forward(in); }, x);
  EXPECT_TRUE(torch::equal(direct, through));
  for (const auto& [accessor, message] : std::vector<std::pair<std::function<void()>, std::string>>{
           {[&] { group.model_weights(); }, "model_weights(): the model weights are resharded"},
           {[&] { group.full_grad_buffer(); }, "read grad_shard() instead"}}) {
    try {
      accessor();
      ADD_FAILURE() << "a freed buffer was handed out";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  for (const at::Tensor& resharded : {block->fc->weight, block->gain}) {
    try {
      resharded.sum();
      ADD_FAILURE() << "a resharded weight was read";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("is resharded"), std::string::npos) << e.what();
    }
  }
}

FSDP_MUON_WORLD_TEST(FullSharding, ForwardRefusesToReturnAViewOfTheWeights) {
  Training run({ShardingStrategy::kOptimGradsParams});
  Block block = run.net->blocks[2];
  try {
    run.groups[2]->forward([&](const at::Tensor&) { return block->fc->weight.t(); },
                           at::zeros({1}));
    ADD_FAILURE() << "a view of resharded weights escaped forward()";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fn returned a view of the group's weights"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(run.groups[2]->unsharded_bytes(), 0);
  run.step(0, 1);  // and the group still trains
}

FSDP_MUON_WORLD_TEST(FullSharding, ReshardingBeforeBackwardIsAClearError) {
  Training run({ShardingStrategy::kOptimGradsParams});
  Block block = run.net->blocks[0];
  auto& group = *run.groups[0];
  for (auto& g : run.groups) g->zero_grad();
  group.unshard();
  at::Tensor input;
  {
    testing::SeededRandom random(11);
    input = at::randn({2, kDims[0]});
  }
  const at::Tensor y = block->forward(input);  // outside forward()
  group.reshard();                             // too early: backward still needs the weights
  try {
    y.pow(2).sum().backward();
    ADD_FAILURE() << "backward ran on resharded weights";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(kReshardedGain), std::string::npos) << e.what();
  }
  // The loop recovers: zero_grad() and a normal step.
  run.step(0, 1);
  EXPECT_EQ(total_unsharded_bytes(run.groups), 0);
}

FSDP_MUON_WORLD_TEST(FullSharding, GradientsOutsideForwardAreAClearError) {
  Training run({ShardingStrategy::kOptimGrads});
  for (auto& g : run.groups) g->zero_grad();
  at::Tensor h;
  {
    testing::SeededRandom random(12);
    h = at::randn({2, kDims[0]});
  }
  for (auto& block : run.net->blocks) h = block->forward(h);  // the module called directly
  try {
    h.sum().backward();
    ADD_FAILURE() << "gradients outside forward() were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("received a gradient outside the group's forward()"),
              std::string::npos)
        << e.what();
  }
  run.step(0, 1);
  EXPECT_EQ(total_unsharded_bytes(run.groups), weight_bytes(run));
}

FSDP_MUON_WORLD_TEST(FullSharding, StrategyNamesRoundTrip) {
  for (const ShardingStrategy s : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                   ShardingStrategy::kOptimGradsParams}) {
    EXPECT_EQ(parse_sharding_strategy(to_string(s)), s);
  }
  EXPECT_EQ(std::string(to_string(ShardingStrategy::kOptimGradsParams)), "optim_grads_params");
  EXPECT_FALSE(parse_sharding_strategy("zero3").has_value());
}

FSDP_MUON_WORLD_TEST(FullSharding, GroupsBuiltWithDifferentStrategiesAreRefusedOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  torch::nn::Linear fc{nullptr};
  {
    testing::SeededRandom random(1);
    fc = torch::nn::Linear(3, 4);
  }
  const auto strategy =
      world().rank() == 1 ? ShardingStrategy::kOptimGradsParams : ShardingStrategy::kOptim;
  try {
    shard_module(*fc, world_ptr(),
                 ShardModuleOptions().group_options(
                     FsdpParameterGroupOptions().sharding_strategy(strategy)));
    ADD_FAILURE() << "different strategies were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sharding_strategy"), std::string::npos) << e.what();
  }
}

// POSIX calls, no std::filesystem: libtorch.so exports copies of some of its symbols that crash
// when remove_all binds to them.
void remove_tree(const std::string& path) {
  ::nftw(
      path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
      16, FTW_DEPTH | FTW_PHYS);
}

// A folder every rank agrees on: rank 0 makes it, everyone receives its name.
std::string shared_temp_dir() {
  std::string path;
  if (world().rank() == 0) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/fsdp_full_XXXXXX";
    const char* made = ::mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr) << "cannot make a folder from " << pattern;
    path = made != nullptr ? made : "";
  }
  at::Tensor bytes = at::zeros({256}, at::kByte);
  std::copy(path.begin(), path.end(), bytes.data_ptr<uint8_t>());
  world().broadcast(bytes, 0);
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()));
}

FSDP_MUON_WORLD_TEST(FullSharding, CheckpointsAndExportsWhileResharded) {
  const std::string dir = shared_temp_dir();
  Training trained({ShardingStrategy::kOptimGradsParams});
  for (int s = 0; s < 2; ++s) trained.step(s, 1);
  ASSERT_EQ(total_unsharded_bytes(trained.groups), 0);
  save_checkpoint(dir + "/ckpt", trained.groups, trained.optimizers());
  export_full_checkpoint(dir + "/full.pt", trained.groups, trained.optimizers());
  EXPECT_EQ(total_unsharded_bytes(trained.groups), 0);  // both read the shards only

  // Resume into a model built from another seed: the next step matches bit for bit.
  Training resumed({ShardingStrategy::kOptimGradsParams, true, std::nullopt, /*seed=*/99});
  load_checkpoint(dir + "/ckpt", resumed.groups, resumed.optimizers());
  EXPECT_EQ(total_unsharded_bytes(resumed.groups), 0);
  EXPECT_EQ(resumed.step(2, 1), trained.step(2, 1));
  expect_same_model(trained, resumed, 0, "resumed");

  // The export holds the full main weights (as of step 2); importing it under any strategy
  // gives the same weights.
  Training imported({ShardingStrategy::kOptimGradsParams, true, std::nullopt, /*seed=*/7});
  import_full_checkpoint(dir + "/full.pt", imported.groups, imported.optimizers());
  Training reference({ShardingStrategy::kOptim});
  for (int s = 0; s < 2; ++s) reference.step(s, 1);
  expect_same_model(reference, imported, 0, "imported");
  world().barrier();
  if (world().rank() == 0) remove_tree(dir);
}

}  // namespace
}  // namespace fsdp_muon
