// Groups on a replicate x shard mesh (HSDP) across real processes (torchrun / mpirun, Gloo on
// CPU), on every mesh of the world with more than one replica (W = 4: 2x2 and 4x1; W = 6: 3x2,
// 2x3 and 6x1): after every step the replicas hold bitwise the same gradient and main-weight
// shards (a hash all-gathered over the world); AdamW on the shards stays within 1e-6 (relative)
// of DDP (full gradients all-reduced over the world, mean, the same AdamW); every sharding
// strategy, prefetch on and off, gives kOptim's bits; micro-batches; the bytes each communicator
// carries; the 1-D mesh bitwise (bytes included) what a group on the communicator does; errors on
// every rank. The model has a row of 1 and sizes no shard size divides, so some shard ranks hold
// nothing of some parameters.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "common/block_stack.h"
#include "common/distributed_main.h"
#include "common/stable_hash.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using testing::world;
using testing::world_ptr;

const std::vector<int64_t> kDims = {6, 11, 1, 7, 3};

using testing::Block;
using testing::Stack;

// World rank `rank`'s input at step `step`, micro-batch `micro`.
at::Tensor input_of(int rank, int step, int micro = 0) {
  testing::SeededRandom random(900 + 97 * step + 13 * micro + rank);
  return at::randn({3, kDims.front()});
}

constexpr int kSteps = 3;

// The model every run starts from, the same on every rank.
Stack seeded_stack() {
  testing::SeededRandom random(5);
  return Stack(kDims);
}

// Every mesh of the world with more than one replica, in the same order on every rank.
std::vector<DeviceMesh> hsdp_meshes() {
  std::vector<DeviceMesh> meshes;
  const int w = world().size();
  for (int shard_size = w - 1; shard_size >= 1; --shard_size) {
    if (w % shard_size == 0) meshes.push_back(make_device_mesh(world_ptr(), shard_size));
  }
  return meshes;
}

torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
}

// The library's stable hash over the bytes of `tensors`, as an int64 for an all-gather.
int64_t bits_hash(const std::vector<at::Tensor>& tensors) {
  detail::StableHash h;
  for (const at::Tensor& t : tensors) {
    const at::Tensor c = t.detach().contiguous().cpu();
    h.add(c.data_ptr(), c.nbytes()).add(uint64_t{0xff});  // and a boundary between tensors
  }
  int64_t out;
  const uint64_t value = h.value();
  std::memcpy(&out, &value, sizeof(out));
  return out;
}

// Every rank learns every rank's hash and checks that the ranks of each shard rank (one per
// replica) agree: the replicas are bitwise identical, and every rank reports it.
void expect_replicas_identical(const DeviceMesh& mesh, const std::vector<at::Tensor>& tensors,
                               const std::string& what) {
  at::Tensor all = at::empty({world().size()}, at::kLong);
  world().all_gather(at::full({1}, bits_hash(tensors), at::kLong), all);
  const int64_t* h = all.data_ptr<int64_t>();
  for (int r = 0; r < world().size(); ++r) {
    const int shard_rank = r % mesh.shard_size();
    EXPECT_EQ(h[r], h[mesh.world_rank(0, shard_rank)])
        << what << ": world rank " << r << " (replica " << r / mesh.shard_size()
        << ") differs from replica 0's shard rank " << shard_rank << " on mesh " << mesh.shape();
  }
}

struct Config {
  ShardingStrategy strategy = ShardingStrategy::kOptim;
  bool prefetch = true;
  int micro_batches = 1;
  std::string name() const {
    return std::string(to_string(strategy)) + (prefetch ? "" : ", no prefetch") +
           (micro_batches > 1 ? ", " + std::to_string(micro_batches) + " micro-batches" : "");
  }
};

// A sharded model trained kSteps with AdamW on its sharded parameters; after each step the
// gradient shards and the main-weight shards of every group, in order.
struct Trained {
  std::vector<std::vector<at::Tensor>> grads;    // [step][group * param]
  std::vector<std::vector<at::Tensor>> weights;  // [step][group * param]
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  Stack net{nullptr};
  // The bytes the communicators carried over the whole run (after construction).
  CommStats world_stats, shard_stats, replicate_stats;
};

// `mesh`: on it; nullptr: on the world communicator (the communicator constructor).
Trained train(const DeviceMesh* mesh, const Config& config) {
  Trained run;
  run.net = seeded_stack();
  const ShardModuleOptions options = ShardModuleOptions().group_options(
      FsdpParameterGroupOptions().sharding_strategy(config.strategy).prefetch(config.prefetch));
  run.groups = mesh != nullptr ? shard_module(*run.net, *mesh, options)
                               : shard_module(*run.net, world_ptr(), options);
  const DeviceMesh& m = run.groups[0]->mesh();
  m.world->reset_stats();
  m.shard->reset_stats();
  m.replicate->reset_stats();
  std::vector<at::Tensor> params;
  for (const auto& g : run.groups) {
    for (const at::Tensor& p : g->sharded_parameters()) params.push_back(p);
  }
  torch::optim::AdamW adamw(params, adamw_options());
  for (int step = 0; step < kSteps; ++step) {
    for (const auto& g : run.groups) g->zero_grad();
    for (int micro = 0; micro < config.micro_batches; ++micro) {
      at::Tensor h = input_of(world().rank(), step, micro);
      for (size_t k = 0; k < run.groups.size(); ++k) {
        Block block = run.net->blocks[k];
        h = run.groups[k]->forward([&](const at::Tensor& x) { return block->forward(x); }, h);
      }
      h.pow(2).mean().backward();
    }
    for (const auto& g : run.groups) g->reduce_scatter_grads();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : params) grads.push_back(p.grad().clone());
    adamw.step();
    for (const auto& g : run.groups) g->refresh_model_weights();
    std::vector<at::Tensor> weights;
    for (const at::Tensor& p : params) weights.push_back(p.detach().clone());
    run.grads.push_back(std::move(grads));
    run.weights.push_back(std::move(weights));
  }
  run.world_stats = m.world->stats();
  run.shard_stats = m.shard->stats();
  run.replicate_stats = m.replicate->stats();
  return run;
}

// DDP: the unsharded model on every rank, its gradients all-reduced over the world (sum, then
// divided by W), the same AdamW; per step the full gradients and weights by name.
struct DdpRun {
  std::vector<std::map<std::string, at::Tensor>> grads, weights;
};

DdpRun train_ddp(int micro_batches) {
  DdpRun run;
  Stack net = seeded_stack();
  torch::optim::AdamW adamw(net->parameters(), adamw_options());
  const int w = world().size();
  for (int step = 0; step < kSteps; ++step) {
    adamw.zero_grad();
    for (int micro = 0; micro < micro_batches; ++micro) {
      net->forward(input_of(world().rank(), step, micro)).pow(2).mean().backward();
    }
    std::vector<at::Tensor> flat;
    for (const at::Tensor& p : net->parameters()) flat.push_back(p.grad().reshape({-1}));
    at::Tensor all = at::cat(flat);
    world().all_reduce(all);
    all.div_(w);
    int64_t at_ = 0;
    std::map<std::string, at::Tensor> grads;
    for (const auto& item : net->named_parameters()) {
      at::Tensor g = item.value().mutable_grad();
      g.copy_(all.narrow(0, at_, g.numel()).view_as(g));
      at_ += g.numel();
      grads[item.key()] = g.clone();
    }
    adamw.step();
    std::map<std::string, at::Tensor> weights;
    for (const auto& item : net->named_parameters()) weights[item.key()] = item.value().clone();
    run.grads.push_back(std::move(grads));
    run.weights.push_back(std::move(weights));
  }
  return run;
}

double relative_difference(const at::Tensor& got, const at::Tensor& want) {
  if (want.numel() == 0) return 0;
  const double scale = std::max(want.abs().max().item<double>(), 1e-30);
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / scale;
}

// The held slice of each parameter against DDP's full tensor, within `tolerance` (relative).
void expect_near_ddp(const Trained& run, const DdpRun& ddp, double tolerance,
                     const std::string& what) {
  for (int step = 0; step < kSteps; ++step) {
    size_t k = 0;
    for (const auto& g : run.groups) {
      for (size_t i = 0; i < g->num_parameters(); ++i, ++k) {
        const std::string& name = g->slot(i).name;
        const auto [first, second] = g->held_range(i);
        const at::Tensor want_grad = ddp.grads[step].at(name).flatten().slice(0, first, second);
        const at::Tensor want = ddp.weights[step].at(name).flatten().slice(0, first, second);
        ASSERT_EQ(run.grads[step][k].numel(), want.numel()) << name;
        EXPECT_LE(relative_difference(run.grads[step][k], want_grad), tolerance)
            << what << ", step " << step << ", gradient of " << name << " on rank "
            << world().rank();
        EXPECT_LE(relative_difference(run.weights[step][k], want), tolerance)
            << what << ", step " << step << ", weights of " << name << " on rank "
            << world().rank();
      }
    }
  }
}

void expect_bitwise(const Trained& got, const Trained& want, const std::string& what) {
  for (int step = 0; step < kSteps; ++step) {
    for (size_t k = 0; k < want.grads[step].size(); ++k) {
      EXPECT_TRUE(at::equal(got.grads[step][k], want.grads[step][k]))
          << what << ": gradient shard " << k << " differs at step " << step;
      EXPECT_TRUE(at::equal(got.weights[step][k], want.weights[step][k]))
          << what << ": main-weight shard " << k << " differs at step " << step;
    }
  }
}

void expect_replicas_identical(const DeviceMesh& mesh, const Trained& run,
                               const std::string& what) {
  for (int step = 0; step < kSteps; ++step) {
    expect_replicas_identical(mesh, run.grads[step],
                              what + ", gradient shards at step " + std::to_string(step));
    expect_replicas_identical(mesh, run.weights[step],
                              what + ", main-weight shards at step " + std::to_string(step));
  }
}

FSDP_MUON_WORLD_TEST(Hsdp, GroupsAreShardedOverTheShardGroupAndLaidOutInShardRanks) {
  if (world().size() == 1) GTEST_SKIP() << "a mesh of several replicas needs two ranks";
  bool some_rank_holds_nothing = false;
  for (const DeviceMesh& mesh : hsdp_meshes()) {
    SCOPED_TRACE("mesh " + mesh.shape());
    Stack net = seeded_stack();
    const auto groups = shard_module(*net, mesh);
    for (const auto& g : groups) {
      EXPECT_EQ(g->communicator(), mesh.shard);
      EXPECT_TRUE(g->mesh().same_as(mesh));
      EXPECT_EQ(g->padded_numel(), g->shard_numel() * mesh.shard_size());
      for (size_t i = 0; i < g->num_parameters(); ++i) {
        int64_t next = 0;
        for (int s = 0; s < mesh.shard_size(); ++s) {
          const auto [first, second] = g->held_range(i, s);
          if (first == second) {
            some_rank_holds_nothing = true;
            continue;
          }
          EXPECT_EQ(first, next) << "shard ranks tile each parameter in order";
          next = second;
        }
        EXPECT_EQ(next, g->slot(i).numel);
        EXPECT_EQ(g->held_range(i), g->held_range(i, mesh.shard->rank()));
      }
    }
  }
  if (world().size() == 4 || world().size() == 6) {
    EXPECT_TRUE(some_rank_holds_nothing) << "the model should leave some shard rank empty";
  }
}

// The heart of HSDP: every strategy, prefetch on and off, on every mesh.
FSDP_MUON_WORLD_TEST(Hsdp, ReplicasStayBitwiseIdenticalAndAdamWFollowsDdpUnderEveryStrategy) {
  if (world().size() == 1) GTEST_SKIP() << "a mesh of several replicas needs two ranks";
  const DdpRun ddp = train_ddp(1);
  for (const DeviceMesh& mesh : hsdp_meshes()) {
    const Trained base = train(&mesh, Config{});
    const std::string where = "mesh " + mesh.shape();
    expect_replicas_identical(mesh, base, where + ", optim");
    expect_near_ddp(base, ddp, 1e-6, where + ", optim");
    for (ShardingStrategy strategy : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                      ShardingStrategy::kOptimGradsParams}) {
      for (bool prefetch : {true, false}) {
        const Config config{strategy, prefetch};
        if (strategy == ShardingStrategy::kOptim && prefetch) continue;  // `base`
        const Trained run = train(&mesh, config);
        expect_bitwise(run, base, where + ", " + config.name() + " against optim");
        expect_replicas_identical(mesh, run, where + ", " + config.name());
      }
    }
  }
}

FSDP_MUON_WORLD_TEST(Hsdp, MicroBatchesFollowDdp) {
  if (world().size() == 1) GTEST_SKIP() << "a mesh of several replicas needs two ranks";
  const DdpRun ddp = train_ddp(2);
  for (const DeviceMesh& mesh : hsdp_meshes()) {
    for (ShardingStrategy strategy : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads}) {
      const Config config{strategy, true, 2};
      const std::string what = "mesh " + mesh.shape() + ", " + config.name();
      const Trained run = train(&mesh, config);
      expect_replicas_identical(mesh, run, what);
      expect_near_ddp(run, ddp, 1e-6, what);
    }
  }
}

// Per reduction, the shard group sends its reduce-scatter's minimum ((S - 1) blocks of a shard)
// and the replicas one all-reduce of the shard (2 (R - 1) / R of it, the ring minimum); nothing
// else crosses the replicas during training.
FSDP_MUON_WORLD_TEST(Hsdp, EachCommunicatorCarriesTheMinimumOfItsStage) {
  if (world().size() == 1) GTEST_SKIP() << "a mesh of several replicas needs two ranks";
  for (const DeviceMesh& mesh : hsdp_meshes()) {
    for (ShardingStrategy strategy : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                      ShardingStrategy::kOptimGradsParams}) {
      const Config config{strategy, true};
      const Trained run = train(&mesh, config);
      const int R = mesh.replicas();
      const int S = mesh.shard_size();
      int64_t all_reduce = 0, reduce_scatter = 0;
      for (const auto& g : run.groups) {
        const int64_t shard_bytes = g->shard_numel() * 4;
        all_reduce += 2 * (R - 1) * shard_bytes / R;
        reduce_scatter += (S - 1) * shard_bytes;
      }
      SCOPED_TRACE("mesh " + mesh.shape() + ", " + config.name());
      EXPECT_EQ(run.replicate_stats.all_reduce_bytes, kSteps * all_reduce);
      EXPECT_EQ(run.replicate_stats.total_bytes(), run.replicate_stats.all_reduce_bytes);
      EXPECT_EQ(run.replicate_stats.calls, kSteps * static_cast<int64_t>(run.groups.size()));
      EXPECT_EQ(run.shard_stats.reduce_scatter_bytes, kSteps * reduce_scatter);
    }
  }
}

// make_device_mesh(world, W) is the 1-D mesh: a group on it does exactly what a group on the
// communicator does, bit for bit and byte for byte (no collective more or less).
FSDP_MUON_WORLD_TEST(Hsdp, TheOneDimensionalMeshIsBitwiseTheCommunicator) {
  const DeviceMesh flat = make_device_mesh(world_ptr(), world().size());
  EXPECT_TRUE(flat.one_dimensional());
  for (ShardingStrategy strategy : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                    ShardingStrategy::kOptimGradsParams}) {
    const Config config{strategy, true};
    const Trained on_comm = train(nullptr, config);
    const Trained on_mesh = train(&flat, config);
    expect_bitwise(on_mesh, on_comm, std::string("1-D mesh, ") + config.name());
    EXPECT_EQ(on_mesh.world_stats.total_bytes(), on_comm.world_stats.total_bytes());
    EXPECT_EQ(on_mesh.world_stats.reduce_scatter_bytes, on_comm.world_stats.reduce_scatter_bytes);
    EXPECT_EQ(on_mesh.world_stats.all_gather_bytes, on_comm.world_stats.all_gather_bytes);
    EXPECT_EQ(on_mesh.world_stats.calls, on_comm.world_stats.calls);
    EXPECT_EQ(on_mesh.replicate_stats.calls, 0);
    EXPECT_EQ(on_comm.replicate_stats.calls, 0);
    EXPECT_EQ(on_mesh.groups[0]->communicator(), world_ptr());
  }
}

std::vector<std::pair<std::string, at::Tensor>> two_parameters() {
  return {{"a", torch::ones({4, 3})}, {"b", torch::ones({5})}};
}

FSDP_MUON_WORLD_TEST(Hsdp, ErrorsAreRaisedOnEveryRank) {
  const int w = world().size();
  if (w == 1) GTEST_SKIP() << "a mesh of several replicas needs two ranks";
  // A shard size that does not divide the world (make_device_mesh's own check): W = 4 and 6
  // take 3 and 4, a world without such a size one more than itself.
  int bad = w + 1;
  for (int s = w - 1; s >= 2; --s) {
    if (w % s != 0) bad = s;
  }
  testing::expect_error([&] { make_device_mesh(world_ptr(), bad); },
                        {"fsdp_muon::make_device_mesh: shard_size=" + std::to_string(bad) +
                         " does not divide the world size " + std::to_string(w)});
  const DeviceMesh mesh = make_device_mesh(world_ptr(), w / 2);
  // The ranks of the lower half build the group on the communicator (a 1-D mesh), the others
  // on the mesh: the agreement over the world names the two shapes.
  testing::expect_error(
      [&] {
        if (world().rank() < w / 2) {
          FsdpParameterGroup(two_parameters(), world_ptr());
        } else {
          FsdpParameterGroup(two_parameters(), mesh);
        }
      },
      {"fsdp_muon::FsdpParameterGroup: the ranks built different groups",
       "mesh 1x" + std::to_string(w), "mesh " + mesh.shape()});
  // A mesh assembled by hand whose sizes do not multiply.
  testing::expect_error(
      [&] {
        FsdpParameterGroup(two_parameters(), DeviceMesh{world_ptr(), world_ptr(), mesh.replicate});
      },
      {"fsdp_muon::FsdpParameterGroup: the mesh is inconsistent",
       "build it with make_device_mesh()"});
  testing::expect_error(
      [&] {
        FsdpParameterGroup(two_parameters(), DeviceMesh{world_ptr(), nullptr, nullptr});
      },
      {"fsdp_muon::FsdpParameterGroup: the mesh has a null communicator"});
  testing::expect_error(
      [&] {
        Stack net = seeded_stack();
        shard_module(*net, DeviceMesh{nullptr, nullptr, nullptr});
      },
      {"fsdp_muon::shard_module: the mesh has a null communicator"});
  // The world still works: a group on the mesh builds.
  FsdpParameterGroup ok(two_parameters(), mesh);
  EXPECT_EQ(ok.communicator(), mesh.shard);
}

}  // namespace
}  // namespace fsdp_muon
