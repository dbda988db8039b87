// FsdpParameterGroup across real processes (torchrun / mpirun, world sizes 1-4, Gloo on CPU):
// the layout tiles every parameter, gradient shards are the mean of the ranks' gradients, and
// a stock AdamW on the sharded parameters trains exactly like single-process AdamW on the
// averaged gradient (the DDP equivalence).

#include <gtest/gtest.h>

#include <cstdio>

#include <torch/torch.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp/shard_module.h>

#include "common/distributed_main.h"

namespace fsdp_muon {
namespace {

using fsdp_muon::testing::world;
using fsdp_muon::testing::world_ptr;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

// The reference averages like the Gloo communicator (sum over ranks in rank order, then divide
// by W), so there results must agree bitwise; other transports (NCCL rings) sum in another
// order and agree to a few ulps.
bool exact_transport() { return world().backend_name() == "gloo"; }

bool close(const at::Tensor& got, const at::Tensor& expected, double rtol, double atol) {
  return exact_transport() ? torch::equal(got, expected)
                           : torch::allclose(got, expected, rtol, atol);
}

bool inside(const at::Tensor& view, const at::Tensor& buffer) {
  return view.is_alias_of(buffer) && view.storage_offset() >= buffer.storage_offset() &&
         view.storage_offset() + view.numel() <= buffer.storage_offset() + buffer.numel();
}

// Largest |a - b| over all ranks, so every rank takes the same branch afterwards.
double global_max(double local) {
  at::Tensor t = torch::tensor({local}, torch::kDouble);
  world().all_reduce(t, ReduceOp::kMax);
  return t.item<double>();
}

// Shapes chosen so that, with 16-byte alignment, some parameter spans three ranks at W = 3 and
// 4, some rank holds nothing of some parameter at W >= 2, and the total (not a multiple of W)
// needs padding: 1×n, n×1, a tiny head and one long vector.
const std::vector<std::vector<int64_t>> kShapes = {{2},   {3, 7}, {1, 13}, {13, 1},
                                                   {120}, {5},    {4, 4},  {1}};

at::Tensor original_value(size_t i) {
  const auto& shape = kShapes[i];
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  return (torch::arange(numel, torch::kFloat) * 0.01 + static_cast<double>(i)).view(shape);
}

FSDP_MUON_WORLD_TEST(FsdpDistributed, ShardsTileEveryParameterExactlyOnce) {
  const int W = world().size();
  const int rank = world().rank();
  Named named;
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    // Ranks other than 0 start from different values: construction broadcasts rank 0's.
    at::Tensor p = (original_value(i) + 100.0 * rank).requires_grad_(true);
    params.push_back(p);
    named.emplace_back("p" + std::to_string(i), p);
  }
  auto group = std::make_shared<FsdpParameterGroup>(named, world_ptr(),
                                                    FsdpParameterGroupOptions().name("layout"));
  EXPECT_EQ(group->padded_numel() % W, 0);
  EXPECT_EQ(group->shard_numel() * W, group->padded_numel());

  bool some_rank_holds_nothing = false;
  int widest_span = 0;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    SCOPED_TRACE(group->slot(i).name);
    const at::Tensor full = original_value(i);
    EXPECT_TRUE(torch::equal(params[i], full)) << "module tensor differs from rank 0's";
    EXPECT_TRUE(inside(params[i], group->model_weights()));
    const auto [first, second] = group->held_range(i);
    const at::Tensor& sp = group->sharded_parameter(i);
    ASSERT_EQ(sp.dim(), 1);
    ASSERT_EQ(sp.numel(), second - first);
    EXPECT_TRUE(torch::equal(sp, full.reshape({-1}).slice(0, first, second)));
    EXPECT_TRUE(inside(sp, group->main_weight_shard()));
    EXPECT_TRUE(inside(sp.grad(), group->grad_shard()));
    auto info = find_sharded_parameter(sp);  // empty shards are registered too
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->index, i);
    EXPECT_EQ(info->slot().shape, kShapes[i]);

    // Every element held by exactly one rank, with rank 0's value: sum the ranks' coverage
    // counts and values.
    at::Tensor count = torch::zeros({full.numel()});
    at::Tensor values = torch::zeros({full.numel()});
    count.slice(0, first, second).fill_(1.0);
    values.slice(0, first, second).copy_(sp);
    world().all_reduce(count);
    world().all_reduce(values);
    EXPECT_TRUE(torch::equal(count, torch::ones({full.numel()})));
    EXPECT_TRUE(torch::equal(values, full.reshape({-1})));

    int span = 0;
    for (int r = 0; r < W; ++r) {
      const auto [f, s] = group->held_range(i, r);
      some_rank_holds_nothing |= (f == s);
      span += (f < s);
    }
    widest_span = std::max(widest_span, span);
  }
  if (W >= 2) {
    EXPECT_TRUE(some_rank_holds_nothing);
  }
  if (W >= 3) {
    EXPECT_GE(widest_span, 3);
  }
  if (rank == 0) {
    std::printf("W=%d: padded %lld, shard %lld, widest parameter spans %d ranks\n", W,
                static_cast<long long>(group->padded_numel()),
                static_cast<long long>(group->shard_numel()), widest_span);
  }
}

FSDP_MUON_WORLD_TEST(FsdpDistributed, WithoutBroadcastEachRankKeepsItsValues) {
  const int rank = world().rank();
  at::Tensor p = (original_value(4) + 100.0 * rank).requires_grad_(true);
  const at::Tensor mine = p.detach().clone();
  FsdpParameterGroup group({{"p", p}}, world_ptr(),
                           FsdpParameterGroupOptions().broadcast_from_rank0(false));
  EXPECT_TRUE(torch::equal(p, mine));
  const auto [first, second] = group.held_range(0);
  EXPECT_TRUE(torch::equal(group.sharded_parameter(0), mine.slice(0, first, second)));
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    scale = register_parameter("scale", torch::ones({4}) + 0.1 * torch::randn({4}));
    fc1 = register_module("fc1", torch::nn::Linear(6, 9));
    fc2 = register_module("fc2", torch::nn::Linear(9, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))) * scale; }
  torch::Tensor scale;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

// Rank r's batch for a step, reproducible on every rank.
std::pair<torch::Tensor, torch::Tensor> batch(int step, int r) {
  testing::SeededRandom random(1000 + 97 * step + r);
  torch::Tensor x = torch::randn({8, 6});
  torch::Tensor y = torch::randn({8, 4});
  return {x, y};
}

torch::Tensor loss_of(Net& net, const std::pair<torch::Tensor, torch::Tensor>& b) {
  return torch::mse_loss(net->forward(b.first), b.second);
}

Net make_net_pair(Net& reference) {
  testing::SeededRandom random(7);
  Net net;
  reference = Net();
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < net->parameters().size(); ++k) {
    reference->parameters()[k].copy_(net->parameters()[k]);
  }
  return net;
}

// The mean over ranks 0..W-1 of the reference model's gradients on their batches, per
// parameter, summed in rank order and divided by W (how a reduce-scatter averages).
std::vector<torch::Tensor> averaged_reference_grads(Net& reference, int step, int W) {
  std::vector<std::vector<torch::Tensor>> per_rank;
  for (int r = 0; r < W; ++r) {
    reference->zero_grad();
    loss_of(reference, batch(step, r)).backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : reference->parameters()) grads.push_back(p.grad().clone());
    per_rank.push_back(grads);
  }
  std::vector<torch::Tensor> mean;
  for (size_t k = 0; k < per_rank[0].size(); ++k) {
    std::vector<torch::Tensor> column;
    for (int r = 0; r < W; ++r) column.push_back(per_rank[r][k]);
    mean.push_back(torch::stack(column).sum(0).div(W));
  }
  return mean;
}

FSDP_MUON_WORLD_TEST(FsdpDistributed, GradientShardsAreTheMeanOfTheRanksGradients) {
  const int W = world().size();
  const int rank = world().rank();
  Net reference{nullptr};
  Net net = make_net_pair(reference);
  auto groups = shard_module(*net, world_ptr());
  ASSERT_EQ(groups.size(), 3u);

  loss_of(net, batch(0, rank)).backward();
  // Before the reduce-scatter each rank's .grad() is its own batch's gradient.
  reference->zero_grad();
  loss_of(reference, batch(0, rank)).backward();
  const auto ref_params = reference->parameters();
  const auto params = net->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_TRUE(torch::equal(params[k].grad(), ref_params[k].grad())) << k;
  }
  for (auto& g : groups) g->reduce_scatter_grads();

  const auto mean = averaged_reference_grads(reference, 0, W);
  double max_diff = 0;
  size_t k = 0;
  for (auto& g : groups) {
    for (size_t i = 0; i < g->num_parameters(); ++i, ++k) {
      const auto [first, second] = g->held_range(i);
      const at::Tensor expected = mean[k].reshape({-1}).slice(0, first, second);
      const at::Tensor got = g->sharded_parameter(i).grad();
      ASSERT_EQ(got.numel(), expected.numel());
      if (got.numel() > 0)
        max_diff = std::max(max_diff, (got - expected).abs().max().item<double>());
      EXPECT_TRUE(close(got, expected, /*rtol=*/1e-6, /*atol=*/1e-7)) << g->slot(i).name;
    }
  }
  max_diff = global_max(max_diff);
  if (rank == 0)
    std::printf("W=%d: gradient shard vs mean of rank gradients, max |diff| %.3g\n", W, max_diff);
}

FSDP_MUON_WORLD_TEST(FsdpDistributed, AdamWOnShardsTrainsLikeSingleProcessAdamW) {
  const int W = world().size();
  const int rank = world().rank();
  Net reference{nullptr};
  Net net = make_net_pair(reference);
  auto groups = shard_module(*net, world_ptr());
  std::vector<torch::Tensor> sharded;
  for (auto& g : groups) {
    for (const auto& sp : g->sharded_parameters()) sharded.push_back(sp);
  }
  const auto opts = torch::optim::AdamWOptions(3e-2).weight_decay(0.05);
  torch::optim::AdamW adamw(sharded, opts);
  torch::optim::AdamW ref_adamw(reference->parameters(), opts);

  double max_diff = 0;
  for (int step = 0; step < 5; ++step) {
    for (auto& g : groups) g->zero_grad();
    loss_of(net, batch(step, rank)).backward();
    for (auto& g : groups) g->reduce_scatter_grads();
    adamw.step();
    for (auto& g : groups) g->refresh_model_weights();

    const auto mean = averaged_reference_grads(reference, step, W);
    const auto ref_params = reference->parameters();
    for (size_t k = 0; k < ref_params.size(); ++k) ref_params[k].mutable_grad() = mean[k];
    ref_adamw.step();

    const auto params = net->parameters();
    size_t k = 0;
    for (auto& g : groups) {
      for (size_t i = 0; i < g->num_parameters(); ++i, ++k) {
        SCOPED_TRACE("step " + std::to_string(step) + " " + g->slot(i).name);
        EXPECT_TRUE(inside(params[k], g->model_weights()));  // still the module's tensors
        max_diff = std::max(max_diff, (params[k] - ref_params[k]).abs().max().item<double>());
        EXPECT_TRUE(close(params[k], ref_params[k], /*rtol=*/1e-5, /*atol=*/1e-6));
      }
    }
  }
  max_diff = global_max(max_diff);
  if (rank == 0)
    std::printf("W=%d: 5 AdamW steps, max |sharded - single process| %.3g\n", W, max_diff);
}

FSDP_MUON_WORLD_TEST(FsdpDistributed, MixedPrecisionAveragesInTheChosenDtype) {
  const int W = world().size();
  const int rank = world().rank();
  for (auto reduce : {at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(c10::toString(reduce));
    at::Tensor a = original_value(1).requires_grad_(true);  // 3×7
    at::Tensor b = original_value(4).requires_grad_(true);  // 120
    const at::Tensor a0 = a.detach().clone();
    const at::Tensor b0 = b.detach().clone();
    FsdpParameterGroup group(
        {{"a", a}, {"b", b}}, world_ptr(),
        FsdpParameterGroupOptions().compute_dtype(at::kBFloat16).reduce_dtype(reduce));
    ASSERT_EQ(a.scalar_type(), at::kBFloat16);
    // Main weights start from the fp32 values.
    const auto [fa, sa] = group.held_range(0);
    EXPECT_TRUE(torch::equal(group.sharded_parameter(0), a0.reshape({-1}).slice(0, fa, sa)));
    // Gradient (r + 1) on rank r: the mean (W + 1) / 2 is exact in bf16 and in fp32.
    ((a.to(at::kFloat) + b.to(at::kFloat).sum()) * static_cast<double>(rank + 1)).sum().backward();
    group.reduce_scatter_grads();
    const double expected = (W + 1) / 2.0;
    for (size_t i = 0; i < 2; ++i) {
      const at::Tensor g = group.sharded_parameter(i).grad();
      EXPECT_EQ(g.scalar_type(), at::kFloat);
      const double each = i == 0 ? expected : expected * 21;  // b's gradient: 21 (r + 1)
      EXPECT_TRUE(torch::equal(g, torch::full_like(g, each)));
    }
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < 2; ++i) group.sharded_parameter(i).add_(0.001);
    }
    group.refresh_model_weights();
    EXPECT_TRUE(torch::equal(a, (a0 + 0.001).to(at::kBFloat16)));
    EXPECT_TRUE(torch::equal(b, (b0 + 0.001).to(at::kBFloat16)));
  }
}

// ---- construction agrees across ranks (docs/DESIGN.md §2: the same group on every rank) ----

// The message construction threw on this rank ("" when it did not throw).
std::string construction_error(Named params, FsdpParameterGroupOptions options = {}) {
  try {
    auto group = std::make_shared<FsdpParameterGroup>(std::move(params), world_ptr(), options);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

Named two_parameters() { return {{"a", torch::ones({4, 3})}, {"b", torch::ones({5})}}; }

// After a refused group the communicator still works on every rank: nobody aborted or left a
// collective half done.
void expect_world_still_works() {
  at::Tensor t = torch::ones({3});
  world().all_reduce(t);
  EXPECT_TRUE(torch::equal(t, torch::full({3}, world().size(), torch::kFloat)));
}

FSDP_MUON_WORLD_TEST(FsdpDistributed, AnExtraParameterOnOneRankIsAnErrorOnEveryRank) {
  const int W = world().size();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  Named params = two_parameters();
  if (world().rank() == W - 1) params.emplace_back("extra", torch::ones({2, 2}));
  const std::string error = construction_error(params, FsdpParameterGroupOptions().name("blk"));
  const std::string last = std::to_string(W - 1);
  EXPECT_NE(error.find("fsdp_muon::FsdpParameterGroup: group 'blk': the ranks built different "
                       "groups (rank " +
                       last + " differs from rank 0; this is rank " +
                       std::to_string(world().rank()) + " of " + std::to_string(W) +
                       "); first difference, parameter #2: rank 0 has no parameter, rank " + last +
                       " has 'extra' [2, 2] Float (rank 0 has 2 parameters, rank " + last + " 3)"),
            std::string::npos)
      << error;
  expect_world_still_works();
}

FSDP_MUON_WORLD_TEST(FsdpDistributed, ADifferentOrderOnOneRankIsAnErrorOnEveryRank) {
  const int W = world().size();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  Named params = two_parameters();
  if (world().rank() == 1) std::swap(params[0], params[1]);
  const std::string error = construction_error(params);
  EXPECT_NE(error.find("fsdp_muon::FsdpParameterGroup: the ranks built different groups (rank 1 "
                       "differs from rank 0; "),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("first difference, parameter #0: rank 0 has 'a' [4, 3] Float, rank 1 has "
                       "'b' [5] Float"),
            std::string::npos)
      << error;
  expect_world_still_works();
}

FSDP_MUON_WORLD_TEST(FsdpDistributed, ADifferentShapeOrOptionOnSomeRanksIsAnErrorOnEveryRank) {
  const int W = world().size();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  Named params = two_parameters();
  if (world().rank() >= 1) params[1].second = torch::ones({6});
  std::string error = construction_error(params);
  std::string ranks;
  for (int r = 1; r < W; ++r) ranks += (r > 1 ? ", " : "") + std::to_string(r);
  EXPECT_NE(
      error.find(std::string("the ranks built different groups (rank") + (W > 2 ? "s " : " ") +
                 ranks + (W > 2 ? " differ" : " differs") + " from rank 0"),
      std::string::npos)
      << error;
  EXPECT_NE(error.find("parameter #1: rank 0 has 'b' [5] Float, rank 1 has 'b' [6] Float"),
            std::string::npos)
      << error;
  // An option, not a parameter, differs.
  error = construction_error(
      two_parameters(), FsdpParameterGroupOptions().alignment_bytes(world().rank() == 1 ? 4 : 16));
  EXPECT_NE(error.find("first difference, rank 0 has options: name '', compute_dtype default, "
                       "main_dtype Float, reduce_dtype default, alignment_bytes 16, "
                       "broadcast_from_rank0 true, sharding_strategy optim, prefetch true, mesh "
                       "1x" +
                       std::to_string(W) +
                       "; rank 1 has options: name '', compute_dtype "
                       "default, main_dtype Float, reduce_dtype default, alignment_bytes 4"),
            std::string::npos)
      << error;
  expect_world_still_works();
}

// A parameter only one rank rejects (here an integer tensor) fails every rank, naming it,
// instead of leaving the others in the broadcast until the timeout.
FSDP_MUON_WORLD_TEST(FsdpDistributed, AParameterOneRankRejectsIsAnErrorOnEveryRank) {
  const int W = world().size();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  Named params = two_parameters();
  if (world().rank() == 1) params[1].second = torch::ones({5}, torch::kLong);
  const std::string error = construction_error(params);
  EXPECT_NE(error.find("first difference, rank 1 could not build its group: "
                       "fsdp_muon::FsdpParameterGroup: parameter 'b' has dtype Long; only "
                       "floating-point parameters can be sharded"),
            std::string::npos)
      << error;
  expect_world_still_works();
}

}  // namespace
}  // namespace fsdp_muon
