// qk_clip across real processes (torchrun / mpirun, W = 1-4, Gloo on CPU): the Kimi K2 rule
// against a hand computation on the full weights (fused QKV with biases: √γ on query and key
// rows; grouped keys: γ on the query rows only), the per-head maxima all-reduced over ranks, the
// attention logits of a real batch bounded by τ after the clip, under ZeRO-1 and ZeRO-3, and
// bad arguments as the same error on every rank; on a 1-D mesh and on an HSDP mesh.

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <torch/torch.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "common/distributed_main.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using testing::world;
using testing::world_ptr;

constexpr int64_t kModel = 5;  // model width: no world size up to 4 divides the rows
constexpr int64_t kHeads = 4;
constexpr int64_t kHeadDim = 1;  // heads of one row
constexpr int64_t kKvHeads = 2;  // the grouped layer: two query heads per key head

// A fused QKV projection with bias (multi-head) and separate grouped-query projections.
struct AttentionImpl : torch::nn::Module {
  AttentionImpl() {
    qkv = register_module("qkv", torch::nn::Linear(kModel, 3 * kHeads * kHeadDim));
    q = register_module(
        "q", torch::nn::Linear(torch::nn::LinearOptions(kModel, kHeads * kHeadDim).bias(false)));
    k = register_module(
        "k", torch::nn::Linear(torch::nn::LinearOptions(kModel, kKvHeads * kHeadDim).bias(false)));
  }
  torch::nn::Linear qkv{nullptr}, q{nullptr}, k{nullptr};
};
TORCH_MODULE(Attention);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fused = register_module("fused", Attention());
    grouped = register_module("grouped", Attention());
  }
  Attention fused{nullptr}, grouped{nullptr};
};
TORCH_MODULE(Net);

// [heads] max over the batch of head h's logits q_h·k_g(h) / √dh, from the module's weights.
at::Tensor head_max_logits(const at::Tensor& x, const at::Tensor& q, const at::Tensor& k,
                           int64_t kv_heads) {
  const int64_t n = x.size(0);
  const at::Tensor qh = q.view({n, kHeads, kHeadDim});
  const at::Tensor kh = k.view({n, kv_heads, kHeadDim}).repeat_interleave(kHeads / kv_heads, 1);
  // [heads, n, n]
  const at::Tensor logits =
      at::einsum("ihd,jhd->hij", {qh, kh}) / std::sqrt(static_cast<double>(kHeadDim));
  return std::get<0>(logits.flatten(1).max(1));
}

std::vector<QkClipLayer> layers() {
  return {
      QkClipLayer("fused.qkv.weight", "fused.qkv.weight", kHeads, kHeadDim)
          .key_row_offset(kHeads * kHeadDim)
          .query_bias("fused.qkv.bias")
          .key_bias("fused.qkv.bias"),
      QkClipLayer("grouped.q.weight", "grouped.k.weight", kHeads, kHeadDim).num_kv_heads(kKvHeads)};
}

// The HSDP mesh of these tests: two replicas where the world splits evenly, else one rank per
// shard group (W = 2: 2x1, 3: 3x1, 4: 2x2).
DeviceMesh replicated_mesh() {
  const int w = world().size();
  return make_device_mesh(world_ptr(), w % 2 == 0 ? w / 2 : 1);
}

struct ShardedModel {
  explicit ShardedModel(ShardingStrategy strategy, bool hsdp = false) {
    {
      testing::SeededRandom random(11);
      net = Net();
    }
    // Large weights, so some logits are far above the threshold.
    for (auto& p : net->parameters()) p.data().mul_(4);
    const auto options =
        ShardModuleOptions().group_options(FsdpParameterGroupOptions().sharding_strategy(strategy));
    groups = hsdp ? shard_module(*net, replicated_mesh(), options)
                  : shard_module(*net, world_ptr(), options);
  }
  // The module's full weights by name (gathered while resharded).
  std::map<std::string, at::Tensor> full_weights() {
    for (auto& g : groups) g->unshard();
    std::map<std::string, at::Tensor> out;
    for (const auto& item : net->named_parameters())
      out[item.key()] = item.value().detach().clone();
    for (auto& g : groups) g->reshard();
    return out;
  }
  // This rank's maxima [layers, heads] on its own batch, and the batch.
  at::Tensor rank_max_logits(const at::Tensor& x) {
    const auto w = full_weights();
    const at::Tensor qkv = at::linear(x, w.at("fused.qkv.weight"), w.at("fused.qkv.bias"));
    const at::Tensor fused =
        head_max_logits(x, qkv.slice(1, 0, kHeads * kHeadDim),
                        qkv.slice(1, kHeads * kHeadDim, 2 * kHeads * kHeadDim), kHeads);
    const at::Tensor grouped = head_max_logits(x, at::linear(x, w.at("grouped.q.weight")),
                                               at::linear(x, w.at("grouped.k.weight")), kKvHeads);
    return at::stack({fused, grouped});
  }
  Net net{nullptr};
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
};

at::Tensor batch_of(int rank) {
  testing::SeededRandom random(900 + rank);
  return at::randn({6, kModel});
}

// (strategy, HSDP): on a mesh of several replicas the maxima come from every rank of every
// replica, and every replica ends with the same weights.
class QkClip : public ::testing::TestWithParam<std::tuple<ShardingStrategy, bool>> {};

TEST_P(QkClip, ScalesQueryAndKeyRowsByTheReportsRuleFromTheRanksLargestLogits) {
  testing::on_every_world([&] {
    ShardedModel s(std::get<0>(GetParam()), std::get<1>(GetParam()));
    const auto before = s.full_weights();
    const at::Tensor local = s.rank_max_logits(batch_of(world().rank()));
    // What the all-reduce must give: the largest over every rank's batch.
    std::vector<at::Tensor> all;
    for (int r = 0; r < world().size(); ++r) all.push_back(s.rank_max_logits(batch_of(r)));
    const at::Tensor global = std::get<0>(at::stack(all).max(0)).to(at::kDouble);
    const double tau = global.median().item<double>();  // about half the heads clip
    ASSERT_GT(tau, 0) << "the seed gives no positive logits to clip";

    const QkClipResult result = qk_clip(s.groups, layers(), tau, local);
    EXPECT_TRUE(torch::equal(result.max_logits, global));
    // By hand: γ per head, √γ on a fused head's query and key rows (bias too), γ on a grouped
    // head's query rows.
    const at::Tensor gamma = at::clamp_max(tau / global, 1.0);
    EXPECT_TRUE(at::allclose(result.factors, gamma, 0, 0));
    EXPECT_EQ(result.clipped_heads, (global > tau).sum().item<int64_t>());
    std::map<std::string, at::Tensor> expected = before;
    const int64_t q = kHeads * kHeadDim;
    for (int64_t h = 0; h < kHeads; ++h) {
      const double f = gamma[0][h].item<double>();
      for (const char* name : {"fused.qkv.weight", "fused.qkv.bias"}) {
        for (int64_t row : {h * kHeadDim, q + h * kHeadDim}) {
          expected[name].narrow(0, row, kHeadDim).mul_(std::sqrt(f));
        }
      }
      expected["grouped.q.weight"]
          .narrow(0, h * kHeadDim, kHeadDim)
          .mul_(gamma[1][h].item<double>());
    }
    const auto after = s.full_weights();
    for (const auto& [name, want] : expected) {
      EXPECT_TRUE(torch::equal(after.at(name), want)) << name << " on rank " << world().rank();
    }
    // The main-weight shards hold the same values as the refreshed model weights.
    for (const auto& g : s.groups) {
      for (size_t i = 0; i < g->num_parameters(); ++i) {
        const auto [first, second] = g->held_range(i);
        EXPECT_TRUE(torch::equal(g->sharded_parameter(i),
                                 expected.at(g->slot(i).name).flatten().slice(0, first, second)))
            << g->slot(i).name;
      }
    }
    // On the same batches, no head's logit exceeds τ any more (rounding aside).
    for (int r = 0; r < world().size(); ++r) {
      EXPECT_LE(s.rank_max_logits(batch_of(r)).max().item<double>(), tau * (1 + 1e-5));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, QkClip,
                         ::testing::Combine(::testing::Values(ShardingStrategy::kOptim,
                                                              ShardingStrategy::kOptimGradsParams),
                                            ::testing::Bool()));

FSDP_MUON_WORLD_TEST(QkClipErrors, BadArgumentsFailOnEveryRank) {
  ShardedModel s(ShardingStrategy::kOptim);
  const at::Tensor logits = at::ones({2, kHeads});
  testing::expect_error(
      [&] {
        qk_clip(s.groups, {QkClipLayer("fused.qkv.weight", "nope.weight", kHeads, kHeadDim)}, 1.0,
                logits.narrow(0, 0, 1));
      },
      {"fsdp_muon::qk_clip: layer 0's key weight 'nope.weight' is in none of the groups"});
  testing::expect_error(
      [&] {
        qk_clip(s.groups,
                {QkClipLayer("fused.qkv.weight", "fused.qkv.weight", kHeads, kHeadDim)
                     .key_row_offset(3 * kHeads * kHeadDim)},
                1.0, logits.narrow(0, 0, 1));
      },
      {"key rows [12, 16) do not fit 'fused.qkv.weight' with 12 rows"});
  testing::expect_error(
      [&] {
        qk_clip(
            s.groups,
            {QkClipLayer("grouped.q.weight", "grouped.k.weight", kHeads, kHeadDim).num_kv_heads(3)},
            1.0, logits.narrow(0, 0, 1));
      },
      {"num_kv_heads (3) must divide num_heads (4)"});
  testing::expect_error(
      [&] {
        qk_clip(s.groups, layers(), 1.0, at::ones({2, 3}));
      },
      {"max_logits must be [layers, heads] = [2, 4]"});
  testing::expect_error([&] { qk_clip(s.groups, layers(), 0.0, logits); },
                        {"threshold must be a positive number"});
  // One rank's bad input fails every rank, none waits in the all-reduce.
  testing::expect_error(
      [&] {
        qk_clip(s.groups, layers(), 1.0,
                world().rank() == world().size() - 1 ? at::ones({1, kHeads}) : logits);
      },
      {"max_logits must be [layers, heads]"});
  // A NaN maximum on the last rank only is an error on every rank: a maximum over ranks would
  // drop it wherever it met a number first (issue 32, item 3).
  at::Tensor with_nan = logits.clone();
  if (world().rank() == world().size() - 1) with_nan[1][2] = std::nan("");
  testing::expect_error([&] { qk_clip(s.groups, layers(), 1.0, with_nan); },
                        {"a maximum logit is NaN or Inf on some rank; nothing was clipped"});
}

// Ranks that pass other arguments: before the agreement another τ or head count clipped the
// replicas apart silently, and another layer count aborted a rank inside Gloo (the maxima's
// all-reduce had another size). Now every rank fails naming the argument and the ranks; the
// weights stay as they were. A one-layer [1, heads] max_logits is a valid call.
FSDP_MUON_WORLD_TEST(QkClipErrors, ArgumentsThatDifferBetweenRanksFailOnEveryRank) {
  const int w = world().size();
  ShardedModel s(ShardingStrategy::kOptimGradsParams);
  const at::Tensor logits = at::ones({2, kHeads});
  const QkClipResult one_layer = qk_clip(s.groups, {layers()[0]}, 1e9, logits.narrow(0, 0, 1));
  EXPECT_EQ(one_layer.clipped_heads, 0);
  EXPECT_EQ(one_layer.max_logits.sizes(), (std::vector<int64_t>{1, kHeads}));
  if (w == 1) return;
  const std::map<std::string, at::Tensor> before = s.full_weights();
  const int last = w - 1;
  const bool odd_one = world().rank() == last;
  const std::string ranks = "rank(s) " + std::to_string(last) + " differ from rank 0";
  const std::string theirs = "rank " + std::to_string(last) + " has ";
  testing::expect_error([&] { qk_clip(s.groups, layers(), odd_one ? 0.5 : 0.25, logits); },
                        {"fsdp_muon::qk_clip: the ranks disagree on its arguments", ranks,
                         "threshold: rank 0 has 0.25, " + theirs + "0.5"},
                        "threshold");
  testing::expect_error(
      [&] {
        const std::vector<QkClipLayer> all = layers();
        qk_clip(s.groups, odd_one ? std::vector<QkClipLayer>{all[0]} : all, 0.25,
                odd_one ? logits.narrow(0, 0, 1) : logits);
      },
      {ranks, "layers: rank 0 has 2, " + theirs + "1"}, "a layer fewer");
  testing::expect_error(
      [&] {
        std::vector<QkClipLayer> other = layers();
        if (odd_one) other[1].num_kv_heads(1);
        qk_clip(s.groups, other, 0.25, logits);
      },
      {ranks, "layer 1: rank 0 has query 'grouped.q.weight'", "2 kv heads", "1 kv heads"},
      "another kv head count");
  const std::map<std::string, at::Tensor> after = s.full_weights();
  for (const auto& [name, t] : before) EXPECT_TRUE(at::equal(t, after.at(name))) << name;

  if (w != 4) return;
  // A 2x2 mesh: replica 1 (world ranks 2 and 3) passes another τ.
  ShardedModel m(ShardingStrategy::kOptim, /*hsdp=*/true);
  const int replica = world().rank() / 2;
  testing::expect_error(
      [&] { qk_clip(m.groups, layers(), replica == 1 ? 0.5 : 0.25, logits); },
      {"rank(s) 2, 3 differ from rank 0", "threshold: rank 0 has 0.25, rank 2 has 0.5"},
      "threshold on a 2x2 mesh");
}

}  // namespace
}  // namespace fsdp_muon
