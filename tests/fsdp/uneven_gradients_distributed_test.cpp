// Uneven gradients across real processes (torchrun, mpirun; world sizes 2 and 3, Gloo on CPU):
// an MoE-like model whose expert 2 receives no token on rank 1, which therefore never runs that
// expert and gives its parameters no gradient. Under every sharding strategy the run must equal,
// bit for bit, the run in which rank 1 computes that expert on an empty batch (an explicit zero
// gradient): the reductions start in the same order on every rank whatever gradients exist. A
// rank that skips a whole group's forward() gets the same clear error as every other rank in
// backward, instead of mismatched collectives (an abort or a hang).

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "common/distributed_main.h"

namespace fsdp_muon {
namespace {

using testing::world;
using testing::world_ptr;

constexpr int64_t kIn = 7;
constexpr int64_t kHidden = 5;
constexpr int64_t kOut = 3;
constexpr int64_t kExperts = 3;
constexpr int64_t kTokens = 6;

// Token t goes to expert t % 3, except on rank 1, where it goes to t % 2: expert 2 gets nothing.
int64_t expert_of(int64_t token) { return world().rank() == 1 ? token % 2 : token % kExperts; }

struct Moe {
  explicit Moe(ShardingStrategy strategy) {
    {
      testing::SeededRandom random(11);
      w_in = at::randn({kHidden, kIn}).mul_(0.4).requires_grad_(true);
      for (int64_t k = 0; k < kExperts; ++k) {
        expert_w.push_back(at::randn({kHidden, kHidden}).mul_(0.4).requires_grad_(true));
        expert_b.push_back(at::randn({kHidden}).mul_(0.1).requires_grad_(true));
      }
      w_out = at::randn({kOut, kHidden}).mul_(0.4).requires_grad_(true);
    }
    auto options = [&](const std::string& name) {
      return FsdpParameterGroupOptions().name(name).sharding_strategy(strategy);
    };
    in = std::make_shared<FsdpParameterGroup>(
        std::vector<std::pair<std::string, at::Tensor>>{{"in.w", w_in}}, world_ptr(),
        options("in"));
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (int64_t k = 0; k < kExperts; ++k) {
      named.emplace_back("e" + std::to_string(k) + ".w", expert_w[k]);
      named.emplace_back("e" + std::to_string(k) + ".b", expert_b[k]);
    }
    experts = std::make_shared<FsdpParameterGroup>(named, world_ptr(), options("experts"));
    out = std::make_shared<FsdpParameterGroup>(
        std::vector<std::pair<std::string, at::Tensor>>{{"out.w", w_out}}, world_ptr(),
        options("out"));
    share_forward_order(groups());
    std::vector<at::Tensor> matrices, vectors;
    for (const auto& g : groups()) {
      for (size_t i = 0; i < g->num_parameters(); ++i) {
        (g->slot(i).shape.size() == 2 ? matrices : vectors).push_back(g->sharded_parameter(i));
      }
    }
    muon = std::make_unique<FsdpMuon>(
        matrices, MuonOptions(0.02).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)));
    adamw = std::make_unique<torch::optim::AdamW>(vectors, torch::optim::AdamWOptions(0.01));
  }

  std::vector<std::shared_ptr<FsdpParameterGroup>> groups() const { return {in, experts, out}; }

  // One step. `skip_empty`: an expert without tokens is not run at all (its parameters get no
  // gradient); otherwise it runs on an empty batch (a zero gradient). `skip_group`: this rank
  // does not run the experts group's forward() at all.
  void step(int index, bool skip_empty, bool skip_group = false) {
    for (const auto& g : groups()) g->zero_grad();
    at::Tensor x;
    {
      testing::SeededRandom random(100 * index + world().rank());
      x = at::randn({kTokens, kIn});
    }
    at::Tensor h =
        in->forward([&](const at::Tensor& t) { return at::tanh(t.matmul(w_in.t())); }, x);
    if (!skip_group) {
      h = experts->forward(
          [&](const at::Tensor& t) {
            at::Tensor y = t;
            for (int64_t k = 0; k < kExperts; ++k) {
              std::vector<int64_t> tokens;
              for (int64_t i = 0; i < kTokens; ++i) {
                if (expert_of(i) == k) tokens.push_back(i);
              }
              if (tokens.empty() && skip_empty) continue;
              const at::Tensor idx = at::tensor(tokens, at::kLong);
              const at::Tensor yk =
                  at::tanh(t.index_select(0, idx).matmul(expert_w[k].t()) + expert_b[k]);
              y = y.index_add(0, idx, yk);
            }
            return y;
          },
          h);
    }
    const at::Tensor z = out->forward([&](const at::Tensor& t) { return t.matmul(w_out.t()); }, h);
    z.pow(2).mean().backward();
    for (const auto& g : groups()) g->reduce_scatter_grads();
    adamw->step();
    muon->step();
  }

  at::Tensor w_in, w_out;
  std::vector<at::Tensor> expert_w, expert_b;
  std::shared_ptr<FsdpParameterGroup> in, experts, out;
  std::unique_ptr<FsdpMuon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
};

class UnevenGradients : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(UnevenGradients, AnExpertWithoutTokensOnOneRankEqualsAnExplicitZeroGradient) {
  testing::on_every_world([&] {
    if (world().size() < 2) GTEST_SKIP() << "needs a rank 1";
    Moe skipped(GetParam());
    Moe explicit_zero(GetParam());
    for (int step = 1; step <= 3; ++step) {
      skipped.step(step, /*skip_empty=*/true);
      explicit_zero.step(step, /*skip_empty=*/false);
    }
    const auto a = skipped.groups();
    const auto b = explicit_zero.groups();
    for (size_t g = 0; g < a.size(); ++g) {
      EXPECT_TRUE(at::equal(a[g]->main_weight_shard(), b[g]->main_weight_shard()))
          << "group " << a[g]->name() << " on rank " << world().rank() << " under "
          << to_string(GetParam());
    }
    // And the run trained: the experts moved.
    Moe untrained(GetParam());
    EXPECT_FALSE(at::equal(a[1]->main_weight_shard(), untrained.experts->main_weight_shard()) &&
                 a[1]->main_weight_shard().numel() > 0);
  });
}

TEST_P(UnevenGradients, ARankThatSkipsAGroupsForwardFailsOnEveryRank) {
  testing::on_every_world([&] {
    if (world().size() < 2) GTEST_SKIP() << "needs a rank 1";
    if (GetParam() == ShardingStrategy::kOptim) {
      GTEST_SKIP() << "under kOptim a skipped forward() is zero gradients, reduced explicitly";
    }
    Moe moe(GetParam());
    moe.step(1, /*skip_empty=*/true);
    try {
      moe.step(2, /*skip_empty=*/true, /*skip_group=*/world().rank() == 1);
      ADD_FAILURE() << "no error on rank " << world().rank();
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      for (const std::string& needle :
           {std::string("the ranks ran different groups' forward() before this backward"),
            std::string("rank 0 ran [in, experts, out]"), std::string("rank 1 ran [in, out]")}) {
        EXPECT_NE(msg.find(needle), std::string::npos)
            << "rank " << world().rank() << ": message lacks '" << needle << "': " << msg;
      }
    }
    // The groups recover: the next step runs on every rank.
    moe.step(3, /*skip_empty=*/true);
    moe.step(4, /*skip_empty=*/true);
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, UnevenGradients,
                         ::testing::Values(ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                           ShardingStrategy::kOptimGradsParams),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace fsdp_muon
