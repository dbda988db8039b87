// clip_grad_norm across real processes (torchrun / mpirun, W = 1-4, Gloo on CPU): the norm and the
// clipped gradient shards against torch::nn::utils::clip_grad_norm_ on the full, rank-averaged
// (DDP) gradients of an unsharded copy of the model, under every sharding strategy, for the
// 2-norm, another p and the inf-norm, also on every HSDP mesh of the world (replicas hold the same
// shards, so the norm must be summed over the shard group only); a NaN gradient under each
// non-finite mode; bad arguments, groups on two meshes, arguments that differ between ranks.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "common/block_stack.h"
#include "common/distributed_main.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using testing::world;
using testing::world_ptr;

// A row of 1, a column of 1 and sizes no world size up to 4 divides: at W >= 2 some rank holds
// nothing of some parameter.
const std::vector<int64_t> kDims = {6, 11, 1, 7, 3};

using testing::Block;
using testing::Stack;

at::Tensor input_of(int rank) {
  testing::SeededRandom random(700 + rank);
  return at::randn({4, kDims.front()});
}

// The sharded model after one backward and reduce_scatter_grads(), and an unsharded copy with
// the gradients DDP would have (the mean over ranks of each rank's gradients).
struct ShardedModel {
  // On `mesh` when given, else on the world communicator.
  explicit ShardedModel(ShardingStrategy strategy, double gradient_scale = 1.0,
                        const DeviceMesh* mesh = nullptr) {
    {
      testing::SeededRandom random(5);
      net = Stack(kDims);
    }
    {
      testing::SeededRandom random(5);
      reference = Stack(kDims);
    }
    const ShardModuleOptions options =
        ShardModuleOptions().group_options(FsdpParameterGroupOptions().sharding_strategy(strategy));
    groups = mesh != nullptr ? shard_module(*net, *mesh, options)
                             : shard_module(*net, world_ptr(), options);
    for (auto& g : groups) g->zero_grad();
    at::Tensor h = input_of(world().rank());
    for (size_t k = 0; k < groups.size(); ++k) {
      Block block = net->blocks[k];
      h = groups[k]->forward([&](const at::Tensor& x) { return block->forward(x); }, h);
    }
    (h.pow(2).mean() * gradient_scale).backward();
    for (auto& g : groups) g->reduce_scatter_grads();

    const int w = world().size();
    for (int r = 0; r < w; ++r) {
      (reference->forward(input_of(r)).pow(2).mean() * gradient_scale / w).backward();
    }
  }

  // The slice of the reference gradient each sharded parameter of this rank holds.
  std::vector<std::pair<std::string, std::pair<at::Tensor, at::Tensor>>> shard_and_reference() {
    std::map<std::string, at::Tensor> full;
    for (const auto& item : reference->named_parameters()) full[item.key()] = item.value().grad();
    std::vector<std::pair<std::string, std::pair<at::Tensor, at::Tensor>>> pairs;
    for (const auto& g : groups) {
      for (size_t i = 0; i < g->num_parameters(); ++i) {
        const std::string& name = g->slot(i).name;
        EXPECT_TRUE(full.count(name)) << "no reference parameter '" << name << "'";
        const auto [first, second] = g->held_range(i);
        pairs.push_back(
            {name, {g->sharded_parameter(i).grad(), full[name].flatten().slice(0, first, second)}});
      }
    }
    return pairs;
  }

  Stack net{nullptr};
  Stack reference{nullptr};
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
};

double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

const ShardingStrategy kStrategies[] = {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                        ShardingStrategy::kOptimGradsParams};

void expect_matches_torch(ShardingStrategy strategy, double max_norm, double norm_type,
                          const DeviceMesh* mesh = nullptr) {
  SCOPED_TRACE(std::string("strategy ") + to_string(strategy) + ", max_norm " +
               std::to_string(max_norm) + ", norm_type " + std::to_string(norm_type) +
               (mesh ? ", mesh " + mesh->shape() : std::string()));
  ShardedModel s(strategy, 1.0, mesh);
  const double norm = clip_grad_norm(s.groups, max_norm, norm_type);
  const double expected =
      torch::nn::utils::clip_grad_norm_(s.reference->parameters(), max_norm, norm_type);
  EXPECT_LE(relative(norm, expected), 1e-6) << norm << " vs " << expected;
  for (const auto& [name, tensors] : s.shard_and_reference()) {
    const auto& [shard, want] = tensors;
    ASSERT_EQ(shard.numel(), want.numel()) << name;
    if (want.numel() == 0) continue;
    const double scale = std::max(want.abs().max().item<double>(), 1e-30);
    EXPECT_LE((shard.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / scale,
              1e-6)
        << name << " on rank " << world().rank();
  }
}

FSDP_MUON_WORLD_TEST(ClipGradNorm, TwoNormMatchesTorchOnTheFullGradientsUnderEveryStrategy) {
  for (ShardingStrategy strategy : kStrategies) {
    expect_matches_torch(strategy, /*max_norm=*/0.05, 2.0);  // clips
    expect_matches_torch(strategy, /*max_norm=*/1e6, 2.0);   // leaves the gradients alone
  }
}

FSDP_MUON_WORLD_TEST(ClipGradNorm, InfAndOtherNormsMatchTorch) {
  for (ShardingStrategy strategy : kStrategies) {
    expect_matches_torch(strategy, 0.01, std::numeric_limits<double>::infinity());
    expect_matches_torch(strategy, 0.05, 3.0);
  }
}

// Every mesh of the world with more than one replica (W = 4: 2x2 and 4x1).
std::vector<DeviceMesh> hsdp_meshes() {
  std::vector<DeviceMesh> meshes;
  const int w = world().size();
  for (int shard_size = 1; shard_size < w; ++shard_size) {
    if (w % shard_size == 0) meshes.push_back(make_device_mesh(world_ptr(), shard_size));
  }
  return meshes;
}

// Under HSDP every replica holds the same gradient shards: the norm is the full averaged
// gradient's (summed over the shard group, not over the world, which would count each element
// once per replica), and every replica clips alike.
FSDP_MUON_WORLD_TEST(ClipGradNorm, OnAMeshMatchesTorchOnTheFullAveragedGradients) {
  if (world().size() == 1) GTEST_SKIP() << "a mesh of several replicas needs two ranks";
  for (const DeviceMesh& mesh : hsdp_meshes()) {
    for (ShardingStrategy strategy : kStrategies) {
      expect_matches_torch(strategy, 0.05, 2.0, &mesh);
    }
    expect_matches_torch(ShardingStrategy::kOptim, 0.01, std::numeric_limits<double>::infinity(),
                         &mesh);
    expect_matches_torch(ShardingStrategy::kOptimGrads, 0.05, 3.0, &mesh);
  }
}

FSDP_MUON_WORLD_TEST(ClipGradNorm, GroupsOnTwoMeshesAreAnErrorOnEveryRank) {
  if (world().size() == 1) GTEST_SKIP() << "a mesh of several replicas needs two ranks";
  const DeviceMesh mesh = make_device_mesh(world_ptr(), 1);
  ShardedModel flat(ShardingStrategy::kOptim);
  ShardedModel replicated(ShardingStrategy::kOptim, 1.0, &mesh);
  testing::expect_error(
      [&] {
        clip_grad_norm(
            std::vector<std::shared_ptr<FsdpParameterGroup>>{flat.groups[0], replicated.groups[1]},
            1.0);
      },
      {"fsdp_muon::clip_grad_norm: group 'b1' is on another communicator than group 'b0' (mesh " +
           mesh.shape() + " against 1x" + std::to_string(world().size()) + ")",
       "in a call of their own"});
}

// A NaN gradient on the last rank only: every rank sees a NaN norm and acts on it the same way.
// A NaN on the last rank only reaches every rank's norm, for the sum of powers and for the
// largest element alike (a maximum over ranks would drop a NaN that meets a number first).
FSDP_MUON_WORLD_TEST(ClipGradNorm, NonFiniteNormFollowsTheMode) {
  const bool poisoned = world().rank() == world().size() - 1;
  for (const double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE("norm_type " + std::to_string(norm_type));
    for (NonFiniteGradients mode :
         {NonFiniteGradients::kSkipStep, NonFiniteGradients::kThrow, NonFiniteGradients::kIgnore}) {
      SCOPED_TRACE(to_string(mode));
      ShardedModel s(ShardingStrategy::kOptim);
      // The last rank's first non-empty gradient shard gets a NaN.
      at::Tensor poisoned_grad;
      for (const auto& g : s.groups) {
        for (const at::Tensor& p : g->sharded_parameters()) {
          if (!poisoned_grad.defined() && p.grad().numel() > 0) poisoned_grad = p.grad();
        }
      }
      ASSERT_TRUE(poisoned_grad.defined());
      if (poisoned) poisoned_grad.view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
      std::vector<at::Tensor> before;
      for (const auto& g : s.groups) {
        for (const at::Tensor& p : g->sharded_parameters()) before.push_back(p.grad().clone());
      }
      if (mode == NonFiniteGradients::kThrow) {
        testing::expect_error(
            [&] { clip_grad_norm(s.groups, 0.05, norm_type, mode); },
            {"fsdp_muon::clip_grad_norm: the gradients' total norm is ", "a NaN or Inf gradient"});
        continue;
      }
      const double norm = clip_grad_norm(s.groups, 0.05, norm_type, mode);
      EXPECT_TRUE(std::isnan(norm));
      size_t k = 0;
      for (const auto& g : s.groups) {
        for (const at::Tensor& p : g->sharded_parameters()) {
          const at::Tensor& was = before[k++];
          if (mode == NonFiniteGradients::kSkipStep) {
            EXPECT_TRUE(at::allclose(p.grad(), was, 0, 0, /*equal_nan=*/true))
                << "kSkipStep changed a gradient";
          } else if (p.grad().numel() > 0) {
            EXPECT_TRUE(p.grad().isnan().all().item<bool>()) << "kIgnore scales by NaN, as torch";
          }
        }
      }
    }
  }
}

FSDP_MUON_WORLD_TEST(ClipGradNorm, BadArgumentsAreClearErrors) {
  ShardedModel s(ShardingStrategy::kOptim);
  testing::expect_error(
      [&] { clip_grad_norm(std::vector<std::shared_ptr<FsdpParameterGroup>>{}, 1.0); },
      {"fsdp_muon::clip_grad_norm: no groups"});
  testing::expect_error([&] { clip_grad_norm(s.groups, 0.0); }, {"max_norm must be a positive"});
  testing::expect_error([&] { clip_grad_norm(s.groups, 1.0, -1.0); },
                        {"norm_type must be positive"});
  testing::expect_error(
      [&] {
        clip_grad_norm(std::vector<std::shared_ptr<FsdpParameterGroup>>{s.groups[0], s.groups[0]},
                       1.0);
      },
      {"is given twice"});
}

// Every gradient shard of the groups, cloned.
std::vector<at::Tensor> gradient_copies(const ShardedModel& s) {
  std::vector<at::Tensor> copies;
  for (const auto& g : s.groups) {
    for (const at::Tensor& p : g->sharded_parameters()) copies.push_back(p.grad().clone());
  }
  return copies;
}

// One rank (the last, or on a 2x2 mesh a whole replica) passes another argument: before the
// agreement each rank clipped by its own and the replicas drifted apart silently. Now every rank
// fails naming the argument and the ranks, and no gradient changes.
FSDP_MUON_WORLD_TEST(ClipGradNorm, ArgumentsThatDifferBetweenRanksFailOnEveryRank) {
  const int w = world().size();
  if (w == 1) GTEST_SKIP() << "one rank cannot disagree with itself";
  const int last = w - 1;
  const bool odd_one = world().rank() == last;
  const std::string ranks = "rank(s) " + std::to_string(last) + " differ from rank 0";
  ShardedModel s(ShardingStrategy::kOptimGrads);
  const std::vector<at::Tensor> before = gradient_copies(s);
  testing::expect_error([&] { clip_grad_norm(s.groups, odd_one ? 0.5 : 1.0); },
                        {"fsdp_muon::clip_grad_norm: the ranks disagree on its arguments", ranks,
                         "max_norm: rank 0 has 1, rank " + std::to_string(last) + " has 0.5"},
                        "max_norm");
  testing::expect_error(
      [&] {
        clip_grad_norm(s.groups, 1.0, odd_one ? std::numeric_limits<double>::infinity() : 2.0);
      },
      {ranks, "norm_type: rank 0 has 2, rank " + std::to_string(last) + " has inf"}, "norm_type");
  testing::expect_error(
      [&] {
        clip_grad_norm(s.groups, 1.0, 2.0,
                       odd_one ? NonFiniteGradients::kThrow : NonFiniteGradients::kSkipStep);
      },
      {ranks, "non_finite: rank 0 has skip_step"}, "non_finite");
  std::vector<std::shared_ptr<FsdpParameterGroup>> reversed(s.groups.rbegin(), s.groups.rend());
  testing::expect_error([&] { clip_grad_norm(odd_one ? reversed : s.groups, 1.0); },
                        {ranks, "groups: rank 0 has ['b0'"}, "groups in another order");
  const std::vector<at::Tensor> after = gradient_copies(s);
  for (size_t k = 0; k < before.size(); ++k) EXPECT_TRUE(at::equal(before[k], after[k])) << k;

  if (w != 4) return;
  // On a 2x2 mesh the replicas clip alike or the weights of the replicas diverge: replica 1
  // (world ranks 2 and 3) asks for another max_norm.
  const DeviceMesh mesh = make_device_mesh(world_ptr(), 2);
  ShardedModel m(ShardingStrategy::kOptim, 1.0, &mesh);
  testing::expect_error(
      [&] { clip_grad_norm(m.groups, mesh.replica() == 1 ? 0.5 : 1.0); },
      {"rank(s) 2, 3 differ from rank 0", "max_norm: rank 0 has 1, rank 2 has 0.5"},
      "max_norm on a 2x2 mesh");
}

}  // namespace
}  // namespace fsdp_muon
