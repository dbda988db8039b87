// FsdpMuon on a replicate x shard mesh (HSDP, docs/DESIGN.md §3). CTest starts this under
// torchrun and mpirun with 4 and 6 ranks; each run covers the meshes of its world size (4: 2x2
// and 4x1; 6: 3x2 and 2x3, replicas x shard) and the 1-D mesh: every replica mode (the relay
// included, also against the direct scatter) bitwise equal to single-device Muon (fp32
// Newton–Schulz) step after step, NorMuon and matrix layouts among them; every replica holding
// the same bits after every step; the bytes of every communicator
// equal to the plan's; the 1-D mesh equal to groups on a plain communicator, bytes included;
// groups on different meshes an error on every rank.
//
// Gradients are written straight into the gradient shards, the same full values on every rank
// (so the reference sees exactly what FsdpMuon sees), except in the module test, which averages
// real per-rank gradients through the groups' two-stage reduction and hands the reference the
// averaged shards.

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "common/distributed_main.h"
#include "common/model_specs.h"
#include "common/stable_hash.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using testing::expect_error;
using testing::Spec;
using testing::world;
using testing::world_ptr;

// The shard sizes of the meshes this world size tests (replicas = W / shard size).
std::vector<int> hsdp_shard_sizes() {
  switch (world().size()) {
    case 4:
      return {2, 1};  // 2x2, 4x1
    case 6:
      return {2, 3};  // 3x2, 2x3
    default:
      return {};
  }
}

// One mesh per world and shard size for the whole process: make_device_mesh is a collective, and
// every rank runs the tests in the same order, so every rank makes the same meshes in the same
// order. Keyed by the rank's world communicator (in-process, every rank of every world is here);
// each entry holds its world, so no other world can take its address.
const DeviceMesh& mesh_with_shard_size(int shard_size) {
  static std::mutex mutex;
  static std::map<std::pair<const Communicator*, int>, DeviceMesh> meshes;
  const std::pair<const Communicator*, int> key{&world(), shard_size};
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = meshes.find(key);
    if (it != meshes.end()) return it->second;
  }
  DeviceMesh mesh = make_device_mesh(world_ptr(), shard_size);  // a collective: outside the lock
  std::lock_guard<std::mutex> lock(mutex);
  return meshes.emplace(key, std::move(mesh)).first->second;
}

// Awkward boundaries at shard sizes 1-3: a row of 1, a column of 1, sizes no shard size divides,
// 1-D parameters between matrices, shard ranks holding nothing of some matrices.
std::vector<std::vector<Spec>> model_specs() {
  return {{{"a.w1", {5, 7}}, {"a.b1", {7}}, {"a.row", {1, 9}}, {"a.w3", {13, 3}}},
          {{"b.w", {3, 11}}, {"b.big", {17, 6}}, {"b.norm", {5}}},
          {{"c.col", {9, 1}}, {"c.w", {6, 6}}}};
}

struct Model {
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<std::vector<at::Tensor>> reference;  // full tensors, [group][parameter]
};

// `mesh` null: the groups are built on the plain world communicator (today's 1-D groups).
Model make_model(uint64_t seed, const DeviceMesh* mesh,
                 const std::vector<std::vector<Spec>>& specs = model_specs()) {
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> drawn;
  {
    testing::SeededRandom random(seed);
    for (const auto& group_specs : specs) drawn.push_back(testing::random_parameters(group_specs));
  }
  Model model;
  for (size_t g = 0; g < specs.size(); ++g) {
    std::vector<std::pair<std::string, at::Tensor>> named = std::move(drawn[g]);
    std::vector<at::Tensor> reference;
    for (const auto& [name, t] : named) {
      reference.push_back(t.detach().clone().requires_grad_(true));
    }
    const auto options =
        FsdpParameterGroupOptions().broadcast_from_rank0(false).name("g" + std::to_string(g));
    model.groups.push_back(
        mesh ? std::make_shared<FsdpParameterGroup>(std::move(named), *mesh, options)
             : std::make_shared<FsdpParameterGroup>(std::move(named), world_ptr(), options));
    model.reference.push_back(std::move(reference));
  }
  return model;
}

// The parameters FsdpMuon updates (2-D, or 3-D for a batched layout) and their references.
std::vector<at::Tensor> sharded_matrices(const Model& model) {
  std::vector<at::Tensor> out;
  for (const auto& group : model.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      if (group->slot(i).shape.size() >= 2) out.push_back(group->sharded_parameter(i));
    }
  }
  return out;
}

std::vector<at::Tensor> reference_matrices(const Model& model) {
  std::vector<at::Tensor> out;
  for (const auto& params : model.reference) {
    for (const at::Tensor& p : params) {
      if (p.dim() >= 2) out.push_back(p);
    }
  }
  return out;
}

// The same full gradients on every rank: each rank writes its slice into its gradient shard.
void feed_gradients(Model& model, uint64_t seed) {
  for (auto& group : model.groups) group->zero_grad();
  testing::SeededRandom random(seed);
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const at::Tensor full = at::randn(model.reference[g][i].sizes());
      const auto [first, second] = group->held_range(i);
      group->sharded_parameter(i).grad().copy_(full.reshape({-1}).slice(0, first, second));
      model.reference[g][i].mutable_grad() = full.clone();
    }
  }
}

// Every shard equals its slice of the reference, bit for bit; so do the model weights.
void expect_matches_reference(const Model& model, const std::string& what) {
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    const auto module_params = group->model_parameters();
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const at::Tensor& ref = model.reference[g][i];
      const auto [first, second] = group->held_range(i);
      const at::Tensor expected = ref.detach().reshape({-1}).slice(0, first, second);
      const at::Tensor& shard = group->sharded_parameter(i);
      EXPECT_TRUE(at::equal(shard, expected))
          << what << ": shard of " << group->slot(i).name << " on rank " << world().rank()
          << " differs by " << (shard - expected).abs().max().item<double>();
      EXPECT_TRUE(at::equal(module_params[i].detach(), ref.detach()))
          << what << ": model weight " << group->slot(i).name << " on rank " << world().rank();
    }
  }
}

// The library's stable hash over a tensor's bytes.
void hash_into(detail::StableHash& h, const at::Tensor& t) {
  const at::Tensor c = t.detach().contiguous();
  h.add(c.data_ptr(), c.nbytes());
}

// Every replica holds the same bits: each rank hashes its main weight shards, momentum and
// NorMuon state; the hashes are all-gathered over the world, and world rank r must equal the
// rank with its shard rank in replica 0 (rank r % shard_size).
void expect_replicas_identical(const Model& model, const FsdpMuon& fsdp, const DeviceMesh& mesh,
                               const std::string& what) {
  detail::StableHash h;
  for (const auto& group : model.groups) hash_into(h, group->main_weight_shard());
  for (const at::Tensor& p : sharded_matrices(model)) {
    auto it = fsdp.state().find(p.unsafeGetTensorImpl());
    if (it == fsdp.state().end()) continue;
    const auto& state = static_cast<const MuonParamState&>(*it->second);
    hash_into(h, state.momentum_buffer());
    if (state.normuon_variance().defined()) hash_into(h, state.normuon_variance());
  }
  int64_t mine = 0;
  const uint64_t value = h.value();
  std::memcpy(&mine, &value, sizeof mine);
  const at::Tensor send = at::full({1}, mine, at::kLong);
  const at::Tensor all = at::empty({world().size()}, at::kLong);
  world().all_gather(send, all);
  for (int r = 0; r < world().size(); ++r) {
    EXPECT_EQ(all[r].item<int64_t>(), all[r % mesh.shard_size()].item<int64_t>())
        << what << ": world rank " << r << " (replica " << r / mesh.shard_size()
        << ") differs from its shard rank in replica 0";
  }
}

// The bytes of the last step, per communicator, are the plan's for this rank.
void expect_planned_bytes(const FsdpMuon& fsdp, const DeviceMesh& mesh, const std::string& what) {
  const OwnerPlan& plan = fsdp.owner_plan();
  const FsdpMuonStepStats& stats = fsdp.last_step_stats();
  // The plan's ranks: world ranks when owners span the replicas, shard ranks otherwise.
  const bool world_owners = plan.world_size == mesh.world->size() && mesh.replicas() > 1;
  const int at = world_owners ? mesh.world->rank() : mesh.shard->rank();
  ASSERT_EQ(plan.world_size, world_owners ? mesh.world->size() : mesh.shard_size()) << what;
  EXPECT_EQ(stats.gather_bytes, plan.gather_bytes_per_rank[at]) << what;
  EXPECT_EQ(stats.scatter_bytes, plan.scatter_bytes_per_rank[at]) << what;
  EXPECT_EQ(stats.gather_inter_node_bytes + stats.scatter_inter_node_bytes,
            plan.inter_node_bytes_per_rank[at])
      << what;
  EXPECT_EQ(stats.gather_inter_node_bytes, 0) << what << ": a gather left its replica";
  EXPECT_EQ(stats.gather_intra_node_bytes + stats.gather_inter_node_bytes, stats.gather_bytes);
  EXPECT_EQ(stats.scatter_intra_node_bytes + stats.scatter_inter_node_bytes, stats.scatter_bytes);
  if (plan.replica_newton_schulz == ReplicaNewtonSchulz::kOncePerReplica) {
    EXPECT_EQ(stats.scatter_inter_node_bytes, 0) << what;
  }
  if (world_owners) {
    // Each matrix reaches every other replica once: from its owner (direct), or from the
    // holders in the owner's replica (relay, an all-gather-v over each replicate group).
    EXPECT_TRUE(plan.replica_newton_schulz == ReplicaNewtonSchulz::kOncePerWorld ||
                plan.replica_newton_schulz == ReplicaNewtonSchulz::kOncePerWorldRelay)
        << what;
  }
}

// Owners span the replicas (direct or relayed).
bool once_per_world(const FsdpMuon& fsdp) {
  const ReplicaNewtonSchulz mode = fsdp.owner_plan().replica_newton_schulz;
  return mode == ReplicaNewtonSchulz::kOncePerWorld ||
         mode == ReplicaNewtonSchulz::kOncePerWorldRelay;
}

std::string mode_name(const DeviceMesh& mesh, ReplicaNewtonSchulz mode, const FsdpMuon& fsdp) {
  return mesh.shape() + " " + to_string(mode) + " -> " +
         to_string(fsdp.owner_plan().replica_newton_schulz);
}

constexpr ReplicaNewtonSchulz kModes[] = {
    ReplicaNewtonSchulz::kOncePerWorld, ReplicaNewtonSchulz::kOncePerReplica,
    ReplicaNewtonSchulz::kByCost, ReplicaNewtonSchulz::kOncePerWorldRelay};

// Runs `steps` steps of FsdpMuon and Muon side by side and checks after every step: the
// reference's bits, identical replicas, the plan's bytes.
void run_against_muon(Model& model, FsdpMuon& fsdp, Muon& muon, const DeviceMesh& mesh,
                      const std::string& what, uint64_t seed, int steps = 3) {
  for (int step = 0; step < steps; ++step) {
    const std::string at = what + " step " + std::to_string(step);
    feed_gradients(model, seed + step);
    fsdp.step();
    muon.step();
    expect_matches_reference(model, at);
    expect_replicas_identical(model, fsdp, mesh, at);
    expect_planned_bytes(fsdp, mesh, at);
  }
}

// Every replica mode on every mesh of this world: single-device Muon's bits after every step,
// the same bits in every replica, the planned bytes; kByCost's choice is the planner's.
FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, EveryModeEqualsSingleDeviceMuonOnEveryMesh) {
  if (hsdp_shard_sizes().empty()) GTEST_SKIP() << "runs at world sizes 4 and 6";
  uint64_t seed = 100;
  for (int shard_size : hsdp_shard_sizes()) {
    const DeviceMesh& mesh = mesh_with_shard_size(shard_size);
    ASSERT_EQ(mesh.replicas() * mesh.shard_size(), world().size());
    for (ReplicaNewtonSchulz mode : kModes) {
      Model model = make_model(++seed, &mesh);
      const MuonOptions options = MuonOptions(0.02).weight_decay(0.1).newton_schulz(
          NewtonSchulzOptions().compute_dtype(at::kFloat));
      // No prefetch budget: a round per owned matrix, overlapped, so that the rounds'
      // gathers and scatters interleave across the world.
      FsdpMuon fsdp(sharded_matrices(model), options,
                    FsdpMuonConfig().planner(
                        OwnerPlanOptions().replica_newton_schulz(mode).prefetch_budget_bytes(0)));
      Muon muon(reference_matrices(model), options);
      const std::string what = mode_name(mesh, mode, fsdp);
      SCOPED_TRACE(what);
      if (mode != ReplicaNewtonSchulz::kByCost) {
        EXPECT_EQ(fsdp.owner_plan().replica_newton_schulz, mode);
      }
      EXPECT_GT(fsdp.owner_plan().rounds.size(), 1u);
      run_against_muon(model, fsdp, muon, mesh, what, 1000 * seed);
      // Once per world the updates crossed replicas; once per replica nothing left one.
      const at::Tensor inter =
          at::full({1}, fsdp.last_step_stats().scatter_inter_node_bytes, at::kLong);
      world().all_reduce(inter);
      if (once_per_world(fsdp)) {
        EXPECT_GT(inter.item<int64_t>(), 0);
      } else {
        EXPECT_EQ(inter.item<int64_t>(), 0);
      }
    }
  }
}

// The planner on this mesh's shape, from parameter shapes alone, at the config's given rates.
OwnerPlan expected_plan(const DeviceMesh& mesh, const MuonOptions& options,
                        const FsdpMuonConfig& config) {
  std::vector<PlanGroup> groups;
  for (const auto& specs : model_specs()) {
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
    for (const Spec& s : specs) shapes.emplace_back(s.name, s.shape);
    groups.push_back(
        plan_group_from_shapes("", shapes, mesh.shard_size(), options.newton_schulz()));
  }
  return plan_owners(groups, MeshShape{mesh.replicas(), mesh.shard_size()}, config.planner(),
                     config.rates().value());
}

// kByCost is resolved at construction by the planner, the same on every rank: with Newton–Schulz
// made expensive and the network between replicas cheap, or the other way round (the other rates
// CostRates' defaults, nothing measured), FsdpMuon runs the planner's choice (and its owners),
// and describe() says which.
FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, ByCostRunsThePlannersChoice) {
  if (hsdp_shard_sizes().empty()) GTEST_SKIP() << "runs at world sizes 4 and 6";
  const MuonOptions options =
      MuonOptions(0.02).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
  for (int shard_size : hsdp_shard_sizes()) {
    const DeviceMesh& mesh = mesh_with_shard_size(shard_size);
    for (const auto& [flops, inter_node] : {std::pair{1e3, 1e30}, std::pair{1e30, 1.0}}) {
      const FsdpMuonConfig config =
          FsdpMuonConfig()
              .planner(OwnerPlanOptions().replica_newton_schulz(ReplicaNewtonSchulz::kByCost))
              .rates(CostRates().newton_schulz_flops_per_second(flops).inter_node_bytes_per_second(
                  inter_node));
      Model model = make_model(7, &mesh);
      FsdpMuon fsdp(sharded_matrices(model), options, config);
      const OwnerPlan expected = expected_plan(mesh, options, config);
      SCOPED_TRACE(mode_name(mesh, ReplicaNewtonSchulz::kByCost, fsdp));
      EXPECT_EQ(fsdp.owner_plan().replica_newton_schulz, expected.replica_newton_schulz);
      EXPECT_EQ(fsdp.owner_plan().owner, expected.owner);
      EXPECT_EQ(fsdp.owner_plan().rounds, expected.rounds);
      const std::string text = fsdp.describe();
      EXPECT_NE(text.find("mesh " + mesh.shape()), std::string::npos) << text;
      EXPECT_NE(text.find(std::string("by_cost -> ") + to_string(expected.replica_newton_schulz)),
                std::string::npos)
          << text;
      EXPECT_NE(text.find("predicted"), std::string::npos) << text;
    }
  }
}

// NorMuon (its per-row state travels with each matrix and comes back to the holders of every
// replica) and two optimizer groups, under every mode, on the first mesh of this world.
FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, NorMuonEqualsSingleDeviceMuon) {
  if (hsdp_shard_sizes().empty()) GTEST_SKIP() << "runs at world sizes 4 and 6";
  const DeviceMesh& mesh = mesh_with_shard_size(hsdp_shard_sizes().front());
  for (ReplicaNewtonSchulz mode : kModes) {
    Model model = make_model(21, &mesh);
    const MuonOptions options = MuonOptions(0.02)
                                    .normalization(Normalization::kNorMuon)
                                    .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
    MuonOptions other = options;
    other.lr(0.01).nesterov(false);
    const auto split = [&](const std::vector<at::Tensor>& params) {
      const size_t half = params.size() / 2;
      return std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup(
              std::vector<at::Tensor>(params.begin(), params.begin() + half),
              std::make_unique<MuonOptions>(options)),
          torch::optim::OptimizerParamGroup(
              std::vector<at::Tensor>(params.begin() + half, params.end()),
              std::make_unique<MuonOptions>(other))};
    };
    FsdpMuon fsdp(split(sharded_matrices(model)), options,
                  FsdpMuonConfig().planner(OwnerPlanOptions().replica_newton_schulz(mode)));
    Muon muon(split(reference_matrices(model)), options);
    const std::string what = "normuon " + mode_name(mesh, mode, fsdp);
    SCOPED_TRACE(what);
    run_against_muon(model, fsdp, muon, mesh, what, 2100, 4);
  }
}

// The relay and the direct scatter side by side on every mesh of this world, NorMuon on (its
// row state rides in both stages): the same bits in the weights, momentum and row state after
// every step, and as many bytes cross replicas in all.
FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, RelayEqualsDirectBitwise) {
  if (hsdp_shard_sizes().empty()) GTEST_SKIP() << "runs at world sizes 4 and 6";
  for (int shard_size : hsdp_shard_sizes()) {
    const DeviceMesh& mesh = mesh_with_shard_size(shard_size);
    const MuonOptions options = MuonOptions(0.02)
                                    .weight_decay(0.1)
                                    .normalization(Normalization::kNorMuon)
                                    .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
    const auto config = [](ReplicaNewtonSchulz mode) {
      return FsdpMuonConfig().planner(
          OwnerPlanOptions().replica_newton_schulz(mode).prefetch_budget_bytes(0));
    };
    Model direct_model = make_model(41, &mesh);
    Model relay_model = make_model(41, &mesh);
    FsdpMuon direct(sharded_matrices(direct_model), options,
                    config(ReplicaNewtonSchulz::kOncePerWorld));
    FsdpMuon relay(sharded_matrices(relay_model), options,
                   config(ReplicaNewtonSchulz::kOncePerWorldRelay));
    const std::string what = "relay vs direct " + mesh.shape();
    SCOPED_TRACE(what);
    // The owners may differ (the relay spreads by its own bytes): the bits may not.
    for (int step = 0; step < 3; ++step) {
      feed_gradients(direct_model, 4100 + step);
      feed_gradients(relay_model, 4100 + step);
      direct.step();
      relay.step();
      for (size_t g = 0; g < direct_model.groups.size(); ++g) {
        EXPECT_TRUE(at::equal(relay_model.groups[g]->main_weight_shard(),
                              direct_model.groups[g]->main_weight_shard()))
            << "group " << g << " step " << step;
      }
      const std::vector<at::Tensor> a = sharded_matrices(direct_model);
      const std::vector<at::Tensor> b = sharded_matrices(relay_model);
      for (size_t i = 0; i < a.size(); ++i) {
        const auto& x =
            static_cast<const MuonParamState&>(*direct.state().at(a[i].unsafeGetTensorImpl()));
        const auto& y =
            static_cast<const MuonParamState&>(*relay.state().at(b[i].unsafeGetTensorImpl()));
        EXPECT_TRUE(at::equal(x.momentum_buffer(), y.momentum_buffer())) << i;
        EXPECT_TRUE(at::equal(x.normuon_variance(), y.normuon_variance())) << i;
      }
      expect_replicas_identical(relay_model, relay, mesh, what);
      expect_planned_bytes(relay, mesh, what);
    }
    // Across the world the same bytes cross replicas: every replica receives each update once.
    const at::Tensor inter = at::tensor({direct.last_step_stats().scatter_inter_node_bytes,
                                         relay.last_step_stats().scatter_inter_node_bytes});
    world().all_reduce(inter);
    EXPECT_EQ(inter[0].item<int64_t>(), inter[1].item<int64_t>());
  }
}

// Row blocks of a fused weight and batched experts (docs/DESIGN.md §3, "Layouts"): each block a
// matrix of its own, owned anywhere in the world, on every mesh of this world.
FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, LayoutsEqualSingleDeviceMuon) {
  if (hsdp_shard_sizes().empty()) GTEST_SKIP() << "runs at world sizes 4 and 6";
  const std::vector<std::vector<Spec>> specs{{{"attn.qkv", {12, 5}}, {"attn.norm", {5}}},
                                             {{"experts.w", {3, 4, 6}}, {"mlp.row", {1, 7}}}};
  for (int shard_size : hsdp_shard_sizes()) {
    const DeviceMesh& mesh = mesh_with_shard_size(shard_size);
    for (ReplicaNewtonSchulz mode :
         {ReplicaNewtonSchulz::kOncePerWorld, ReplicaNewtonSchulz::kOncePerReplica,
          ReplicaNewtonSchulz::kOncePerWorldRelay}) {
      Model model = make_model(31, &mesh, specs);
      const MuonOptions base =
          MuonOptions(0.02).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
      const auto groups = [&](const std::vector<at::Tensor>& p) {
        MuonOptions qkv = base;
        qkv.matrix_layout(MatrixLayout::row_blocks({6, 3, 3}));
        MuonOptions experts = base;
        experts.matrix_layout(MatrixLayout::batched());
        return std::vector<torch::optim::OptimizerParamGroup>{
            torch::optim::OptimizerParamGroup({p[0]}, std::make_unique<MuonOptions>(qkv)),
            torch::optim::OptimizerParamGroup({p[1]}, std::make_unique<MuonOptions>(experts)),
            torch::optim::OptimizerParamGroup({p[2]}, std::make_unique<MuonOptions>(base))};
      };
      FsdpMuon fsdp(groups(sharded_matrices(model)), base,
                    FsdpMuonConfig().planner(OwnerPlanOptions().replica_newton_schulz(mode)));
      Muon muon(groups(reference_matrices(model)), base);
      EXPECT_EQ(fsdp.matrices().size(), 7u);  // 3 blocks, 3 experts, 1 row
      const std::string what = "layouts " + mode_name(mesh, mode, fsdp);
      SCOPED_TRACE(what);
      run_against_muon(model, fsdp, muon, mesh, what, 3100);
    }
  }
}

// Real per-rank gradients through the groups' two-stage reduction (reduce-scatter in the shard
// group, then all-reduce across replicas): FsdpMuon equals Muon on the averaged gradients the
// groups hand it, and the replicas stay identical, on every mesh under once-per-world (direct
// on the first mesh, relayed on the others).
FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, AveragedPerRankGradientsEqualSingleDeviceMuon) {
  if (hsdp_shard_sizes().empty()) GTEST_SKIP() << "runs at world sizes 4 and 6";
  for (int shard_size : hsdp_shard_sizes()) {
    const DeviceMesh& mesh = mesh_with_shard_size(shard_size);
    Model model = make_model(51, &mesh);
    const MuonOptions options =
        MuonOptions(0.02).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
    const ReplicaNewtonSchulz mode = shard_size == hsdp_shard_sizes().front()
                                         ? ReplicaNewtonSchulz::kOncePerWorld
                                         : ReplicaNewtonSchulz::kOncePerWorldRelay;
    FsdpMuon fsdp(sharded_matrices(model), options,
                  FsdpMuonConfig().planner(OwnerPlanOptions().replica_newton_schulz(mode)));
    Muon muon(reference_matrices(model), options);
    const std::string what = "per-rank gradients " + mesh.shape() + " " + to_string(mode);
    for (int step = 0; step < 3; ++step) {
      for (size_t g = 0; g < model.groups.size(); ++g) {
        auto& group = model.groups[g];
        group->zero_grad();
        auto params = group->model_parameters();
        {
          testing::SeededRandom random(5100 + 10 * step + world().rank());  // each rank its own
          for (at::Tensor& p : params) p.mutable_grad() = at::randn(p.sizes());
        }
        group->reduce_scatter_grads();
        // The reference gets what FsdpMuon sees: the averaged shards, gathered in the shard
        // group.
        at::Tensor full = at::empty({group->padded_numel()}, group->grad_shard().options());
        mesh.shard->all_gather(group->grad_shard(), full);
        for (size_t i = 0; i < group->num_parameters(); ++i) {
          const ParameterSlot& slot = group->slot(i);
          model.reference[g][i].mutable_grad() =
              full.narrow(0, slot.offset, slot.numel).view(slot.shape).clone();
        }
      }
      fsdp.step();
      muon.step();
      const std::string at = what + " step " + std::to_string(step);
      expect_matches_reference(model, at);
      expect_replicas_identical(model, fsdp, mesh, at);
    }
  }
}

// The 1-D mesh of the whole world is today's FsdpMuon, bit for bit and byte for byte: groups on
// make_device_mesh(world, W) against groups on the plain communicator, in every replica mode
// (with one replica they are one plan).
FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, OneDimensionalMeshIsTodayBitwiseBytesIncluded) {
  const DeviceMesh mesh = make_device_mesh(world_ptr(), world().size());
  ASSERT_TRUE(mesh.one_dimensional());
  for (ReplicaNewtonSchulz mode : kModes) {
    SCOPED_TRACE(to_string(mode));
    Model on_mesh = make_model(61, &mesh);
    Model today = make_model(61, nullptr);
    const MuonOptions options = MuonOptions(0.02)
                                    .normalization(Normalization::kNorMuon)
                                    .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
    const FsdpMuonConfig config =
        FsdpMuonConfig().planner(OwnerPlanOptions().replica_newton_schulz(mode));
    FsdpMuon a(sharded_matrices(on_mesh), options, config);
    FsdpMuon b(sharded_matrices(today), options, config);
    EXPECT_EQ(a.owner_plan().owner, b.owner_plan().owner);
    EXPECT_EQ(a.owner_plan().rounds, b.owner_plan().rounds);
    EXPECT_EQ(a.owner_plan().world_size, world().size());
    for (int step = 0; step < 3; ++step) {
      feed_gradients(on_mesh, 6100 + step);
      feed_gradients(today, 6100 + step);
      a.step();
      b.step();
      for (size_t g = 0; g < today.groups.size(); ++g) {
        EXPECT_TRUE(
            at::equal(on_mesh.groups[g]->main_weight_shard(), today.groups[g]->main_weight_shard()))
            << "group " << g << " step " << step;
      }
      const FsdpMuonStepStats& x = a.last_step_stats();
      const FsdpMuonStepStats& y = b.last_step_stats();
      EXPECT_EQ(x.gather_bytes, y.gather_bytes);
      EXPECT_EQ(x.scatter_bytes, y.scatter_bytes);
      EXPECT_EQ(x.gather_intra_node_bytes, y.gather_bytes);
      EXPECT_EQ(x.scatter_intra_node_bytes, y.scatter_bytes);
      EXPECT_EQ(x.gather_inter_node_bytes + x.scatter_inter_node_bytes, 0);
      EXPECT_EQ(x.check_bytes, y.check_bytes);
      EXPECT_EQ(x.refresh_bytes, y.refresh_bytes);
      EXPECT_EQ(x.max_transient_bytes, y.max_transient_bytes);
      EXPECT_EQ(x.rounds, y.rounds);
      EXPECT_EQ(x.newton_schulz_calls, y.newton_schulz_calls);
      expect_planned_bytes(a, mesh, "1-D");
    }
  }
}

// Groups on different meshes (another shape, or the same shape made twice) are an error on every
// rank, naming both groups and their meshes.
// check_replicas_every(2): a replica whose weights changed alone (issue 32, item 6) trained on
// silently before; now the next checked step fails on every rank naming the replica and the
// parameter, and changes nothing. Unchecked calls and agreeing replicas pass.
FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, ReplicaCheckNamesTheReplicaWhoseWeightsDiverged) {
  if (hsdp_shard_sizes().empty()) GTEST_SKIP() << "runs at world sizes 4 and 6";
  const int w = world().size();
  for (const int shard_size : hsdp_shard_sizes()) {
    SCOPED_TRACE("shard size " + std::to_string(shard_size));
    const DeviceMesh& mesh = mesh_with_shard_size(shard_size);
    Model model = make_model(81, &mesh);
    FsdpMuon fsdp(sharded_matrices(model), MuonOptions().lr(0.02),
                  FsdpMuonConfig().check_replicas_every(2).rates(CostRates()));
    for (int call = 1; call <= 2; ++call) {
      feed_gradients(model, 300 + call);
      fsdp.step();
    }
    // The last world rank (the last replica) changes one element of the first parameter it
    // holds a piece of; every rank can tell which from the held ranges.
    const int last_shard_rank = (w - 1) % shard_size;
    std::string changed;
    for (const auto& group : model.groups) {
      for (size_t i = 0; changed.empty() && i < group->num_parameters(); ++i) {
        const auto [a, b] = group->held_range(i, last_shard_rank);
        if (b > a) changed = group->slot(i).name;
        if (b > a && world().rank() == w - 1) {
          group->sharded_parameter(i).detach().view(-1)[0].add_(1.0);
        }
      }
    }
    ASSERT_FALSE(changed.empty());
    feed_gradients(model, 303);
    fsdp.step();  // call 3 is not checked: the replicas now differ and nothing notices
    std::vector<at::Tensor> before;
    for (const auto& group : model.groups) {
      for (const at::Tensor& p : group->sharded_parameters()) before.push_back(p.detach().clone());
    }
    feed_gradients(model, 304);
    const int replicas = w / shard_size;
    expect_error(
        [&] { fsdp.step(); },
        {"fsdp_muon::FsdpMuon: the replicas' weights diverged before step() call 4",
         "replica " + std::to_string(replicas - 1) + " (world rank " + std::to_string(w - 1) +
             ", shard rank " + std::to_string(last_shard_rank) + ")",
         "in parameter '" + changed + "'", "Nothing was changed"});
    size_t k = 0;
    for (const auto& group : model.groups) {
      for (const at::Tensor& p : group->sharded_parameters()) {
        EXPECT_TRUE(at::equal(p, before[k++])) << "the refused step changed a shard";
      }
    }
  }
  expect_error(
      [&] {
        FsdpMuon(sharded_matrices(make_model(82, &mesh_with_shard_size(2))), MuonOptions(),
                 FsdpMuonConfig().check_replicas_every(-1).rates(CostRates()));
      },
      {"check_replicas_every must be >= 0"});
  expect_error(
      [&] {
        FsdpMuon(sharded_matrices(make_model(83, &mesh_with_shard_size(2))), MuonOptions(),
                 FsdpMuonConfig()
                     .check_replicas_every(1)
                     .rates(CostRates())
                     .check_gradient_agreement(false)
                     .non_finite_gradients(NonFiniteGradients::kIgnore));
      },
      {"check_replicas_every(1) needs check_gradient_agreement(true)"});
}

FSDP_MUON_WORLD_TEST(FsdpMuonHsdp, MixedMeshesAreAnErrorOnEveryRank) {
  if (hsdp_shard_sizes().empty()) GTEST_SKIP() << "runs at world sizes 4 and 6";
  const DeviceMesh& mesh = mesh_with_shard_size(2);
  const DeviceMesh one_d = make_device_mesh(world_ptr(), world().size());
  const DeviceMesh again = make_device_mesh(world_ptr(), 2);  // the same shape, another mesh
  const std::string shape = mesh.shape();
  for (const DeviceMesh* other : {&one_d, &again}) {
    Model a = make_model(71, &mesh);
    Model b = make_model(72, other, {{{"other.w", {4, 3}}}});
    std::vector<at::Tensor> params = sharded_matrices(a);
    params.push_back(b.groups[0]->sharded_parameter(0));
    expect_error([&] { FsdpMuon(params, MuonOptions()); },
                 {"fsdp_muon::FsdpMuon: ", "'g0' (mesh " + shape + ")",
                  "(parameter 'other.w', mesh " + other->shape() + ")", "different meshes",
                  "same DeviceMesh"});
  }
}

}  // namespace
}  // namespace fsdp_muon
