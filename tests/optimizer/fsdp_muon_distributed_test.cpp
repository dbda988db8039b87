// FsdpMuon across ranks (CTest runs this in-process at world sizes 1-4, and under torchrun and
// mpirun):
// exactness against single-device Muon, prefetch budgets and owner policies, traffic against the
// plan and the docs/DESIGN.md §7 minimum, transient memory, Muon + AdamW on a sharded module, and
// every construction and step error on every rank.
//
// Gradients are written straight into the gradient shards, the same full values on every rank,
// so the reference sees exactly the gradients FsdpMuon sees (no averaging-order noise); the
// module test averages real per-rank gradients and hands the reference the averaged shards.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "common/distributed_main.h"
#include "common/model_specs.h"
#include "common/test_util.h"
#include "muon/muon_test_util.h"
#include "muon/row_state.h"

namespace fsdp_muon {
namespace {

using testing::expect_error;
using testing::Spec;
using testing::world;
using testing::world_ptr;

// Boundaries in awkward places at every world size up to 4: a row of 1, a column of 1, sizes
// that no world size divides, 1-D parameters between matrices, and (for W >= 3) ranks that hold
// nothing of some matrices.
std::vector<std::vector<Spec>> model_specs() {
  return {{{"a.w1", {5, 7}}, {"a.b1", {7}}, {"a.row", {1, 9}}, {"a.w3", {13, 3}}},
          {{"b.w", {3, 11}}, {"b.tiny", {2, 2}}, {"b.big", {17, 6}}, {"b.norm", {5}}},
          {{"c.col", {9, 1}}, {"c.w", {6, 6}}}};
}

struct Model {
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<std::vector<at::Tensor>> reference;  // full tensors, [group][parameter]
};

Model make_model(uint64_t seed, const std::vector<std::vector<Spec>>& specs = model_specs(),
                 std::shared_ptr<Communicator> comm = world_ptr()) {
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> drawn;
  {
    testing::SeededRandom random(seed);
    for (const auto& group_specs : specs) drawn.push_back(testing::random_parameters(group_specs));
  }
  Model model;
  for (size_t g = 0; g < specs.size(); ++g) {
    std::vector<std::pair<std::string, at::Tensor>> named = std::move(drawn[g]);
    std::vector<at::Tensor> reference;
    for (const auto& [name, t] : named)
      reference.push_back(t.detach().clone().requires_grad_(true));
    model.groups.push_back(std::make_shared<FsdpParameterGroup>(
        std::move(named), comm,
        FsdpParameterGroupOptions().broadcast_from_rank0(false).name("g" + std::to_string(g))));
    model.reference.push_back(std::move(reference));
  }
  return model;
}

std::vector<at::Tensor> sharded_matrices(const Model& model) {
  std::vector<at::Tensor> out;
  for (const auto& group : model.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      if (group->slot(i).shape.size() == 2) out.push_back(group->sharded_parameter(i));
    }
  }
  return out;
}

std::vector<at::Tensor> reference_matrices(const Model& model) {
  std::vector<at::Tensor> out;
  for (const auto& params : model.reference) {
    for (const at::Tensor& p : params) {
      if (p.dim() == 2) out.push_back(p);
    }
  }
  return out;
}

// The same full gradients on every rank: each rank writes its slice into its gradient shard.
void feed_gradients(Model& model, uint64_t seed) {
  for (auto& group : model.groups) group->zero_grad();  // re-installs .grad() views set to None
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

// Every 2-D shard equals its slice of the reference, bit for bit; so do the model weights.
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

struct Case {
  std::string name;
  MuonOptions options;
};

std::vector<Case> exactness_cases() {
  std::vector<Case> cases;
  cases.push_back({"defaults_fp32", MuonOptions(0.02).newton_schulz(
                                        NewtonSchulzOptions().compute_dtype(at::kFloat))});
  cases.push_back({"no_nesterov_decoupled_spectral_simple",
                   MuonOptions(0.01)
                       .nesterov(false)
                       .weight_decay(0.1)
                       .weight_decay_method(WeightDecayMethod::kDecoupled)
                       .scale_mode(ScaleMode::kSpectral)
                       .newton_schulz(NewtonSchulzOptions()
                                          .coefficients(NsCoefficients::kSimple)
                                          .compute_dtype(at::kFloat))});
  cases.push_back({"l2_unit_rms_polar_express",
                   MuonOptions(0.03)
                       .weight_decay(0.05)
                       .weight_decay_method(WeightDecayMethod::kL2)
                       .scale_mode(ScaleMode::kUnitRmsNorm)
                       .newton_schulz(NewtonSchulzOptions()
                                          .coefficients(NsCoefficients::kPolarExpress)
                                          .steps(8)
                                          .compute_dtype(at::kFloat))});
  cases.push_back(
      {"independent_match_rms_cans", MuonOptions(0.02)
                                         .nesterov(false)
                                         .momentum(0.9)
                                         .weight_decay(0.01)
                                         .weight_decay_method(WeightDecayMethod::kIndependent)
                                         .scale_mode(ScaleMode::kMatchRmsAdamW)
                                         .newton_schulz(NewtonSchulzOptions()
                                                            .coefficients(NsCoefficients::kCans)
                                                            .compute_dtype(at::kFloat))});
  cases.push_back(
      {"palm_none_aol",
       MuonOptions(0.05)
           .weight_decay(0.2)
           .weight_decay_method(WeightDecayMethod::kPalm)
           .scale_mode(ScaleMode::kNone)
           .newton_schulz(
               NewtonSchulzOptions().coefficients(NsCoefficients::kAol).compute_dtype(at::kFloat))
           .extra_scale_factor(0.5)});
  cases.push_back({"deepseek_v4_cubic5_shape_scaling",
                   MuonOptions(0.02)
                       .newton_schulz(NewtonSchulzOptions()
                                          .coefficients(NsCoefficients::kDeepseekV4)
                                          .steps(10)
                                          .compute_dtype(at::kFloat))
                       .scale_mode(ScaleMode::kShapeScaling)});
  cases.push_back(
      {"cubic5",
       MuonOptions(0.02).newton_schulz(
           NewtonSchulzOptions().coefficients(NsCoefficients::kCubic5).compute_dtype(at::kFloat))});
  // Gram Newton-Schulz and AOL (docs/DESIGN.md §4): the owner runs them on the full matrix as
  // Muon does, so the bits are Muon's at every W.
  cases.push_back(
      {"gram", MuonOptions(0.02).newton_schulz(
                   NewtonSchulzOptions().method(NsMethod::kGram).compute_dtype(at::kFloat))});
  cases.push_back({"gram_restarts_1_3_polar_express",
                   MuonOptions(0.02).newton_schulz(NewtonSchulzOptions()
                                                       .method(NsMethod::kGram)
                                                       .gram_restarts({1, 3})
                                                       .coefficients(NsCoefficients::kPolarExpress)
                                                       .compute_dtype(at::kFloat))});
  cases.push_back({"auto_aol_turbo", MuonOptions(0.02).newton_schulz(
                                         NewtonSchulzOptions()
                                             .method(NsMethod::kAuto)
                                             .preconditioning(NsPreconditioning::kAol)
                                             .custom_coefficients({{4.6051, -9.6552, 5.6769},
                                                                   {4.7505, -6.0861, 2.1790},
                                                                   {2.7763, -2.3190, 0.5523},
                                                                   {2.4231, -2.2861, 0.8193}})
                                             .steps(4)
                                             .compute_dtype(at::kFloat))});
  cases.push_back({"bf16_defaults", MuonOptions(0.02)});
  cases.push_back({"bf16_spectral_decoupled",
                   MuonOptions(0.01).weight_decay(0.1).scale_mode(ScaleMode::kSpectral)});
  return cases;
}

// Two optimizer groups with different options: the first half of the matrices with `options`,
// the rest with half the learning rate and no Nesterov.
std::vector<torch::optim::OptimizerParamGroup> split_groups(const std::vector<at::Tensor>& params,
                                                            const MuonOptions& options) {
  const size_t half = params.size() / 2;
  std::vector<at::Tensor> first(params.begin(), params.begin() + half);
  std::vector<at::Tensor> second(params.begin() + half, params.end());
  MuonOptions other = options;
  other.lr(options.lr() * 0.5).nesterov(!options.nesterov());
  return {torch::optim::OptimizerParamGroup(first, std::make_unique<MuonOptions>(options)),
          torch::optim::OptimizerParamGroup(second, std::make_unique<MuonOptions>(other))};
}

FSDP_MUON_WORLD_TEST(FsdpMuonExactness, EqualsSingleDeviceMuonBitwise) {
  uint64_t seed = 1;
  for (const Case& c : exactness_cases()) {
    SCOPED_TRACE(c.name);
    Model model = make_model(seed);
    FsdpMuon fsdp(split_groups(sharded_matrices(model), c.options), c.options);
    Muon muon(split_groups(reference_matrices(model), c.options), c.options);
    for (int step = 0; step < 5; ++step) {
      feed_gradients(model, 1000 * seed + step);
      fsdp.step();
      muon.step();
    }
    expect_matches_reference(model, c.name);
    // Momentum is sharded: each rank keeps exactly its slice of the reference momentum.
    for (const FsdpMuonMatrix& m : fsdp.matrices()) {
      const auto& state = static_cast<const MuonParamState&>(
          *fsdp.state().at(m.sharded_parameter.unsafeGetTensorImpl()));
      EXPECT_EQ(state.step(), 5);
      EXPECT_EQ(state.momentum_buffer().numel(), m.sharded_parameter.numel());
    }
    ++seed;
  }
}

// A scheduler changing lr (and an edit of momentum and weight decay) on every rank alike after
// construction: still exactly single-device Muon with those options.
FSDP_MUON_WORLD_TEST(FsdpMuonExactness, OptionsChangedAlikeOnEveryRankEqualSingleDeviceMuon) {
  Model model = make_model(78);
  const MuonOptions options =
      MuonOptions(0.02).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
  FsdpMuon fsdp(split_groups(sharded_matrices(model), options), options);
  Muon muon(split_groups(reference_matrices(model), options), options);
  torch::optim::StepLR fsdp_schedule(fsdp, /*step_size=*/2, /*gamma=*/0.3);
  torch::optim::StepLR muon_schedule(muon, /*step_size=*/2, /*gamma=*/0.3);
  for (int step = 0; step < 6; ++step) {
    feed_gradients(model, 7800 + step);
    if (step == 3) {
      for (torch::optim::Optimizer* opt : {static_cast<torch::optim::Optimizer*>(&fsdp),
                                           static_cast<torch::optim::Optimizer*>(&muon)}) {
        static_cast<MuonOptions&>(opt->param_groups()[0].options()).momentum(0.8);
        static_cast<MuonOptions&>(opt->param_groups()[1].options()).weight_decay(0.1);
      }
    }
    fsdp.step();
    muon.step();
    fsdp_schedule.step();
    muon_schedule.step();
  }
  EXPECT_NE(fsdp.param_groups()[0].options().get_lr(), 0.02);  // the schedule did act
  expect_matches_reference(model, "options changed alike");
}

// Parameters without gradients (on every rank) are left alone, as single-device Muon does.
FSDP_MUON_WORLD_TEST(FsdpMuonExactness, ParametersWithoutGradientsAreSkipped) {
  Model model = make_model(77);
  const MuonOptions options =
      MuonOptions(0.02).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
  FsdpMuon fsdp(sharded_matrices(model), options);
  Muon muon(reference_matrices(model), options);
  for (int step = 0; step < 3; ++step) {
    feed_gradients(model, 7700 + step);
    // a.row and c.w have no gradient at step 1.
    if (step == 1) {
      model.groups[0]->sharded_parameter(2).mutable_grad() = at::Tensor();
      model.reference[0][2].mutable_grad() = at::Tensor();
      model.groups[2]->sharded_parameter(1).mutable_grad() = at::Tensor();
      model.reference[2][1].mutable_grad() = at::Tensor();
    }
    fsdp.step();
    muon.step();
    if (step == 1) {
      EXPECT_EQ(fsdp.last_step_stats().active_parameters, 6);
    }
  }
  expect_matches_reference(model, "skipped gradients");
}

// The name of matrix j of group g in the plan's numbering (the group's matrices in order).
std::string plan_name(const FsdpMuon& fsdp, size_t g, size_t j) {
  size_t k = 0;
  for (const FsdpMuonMatrix& m : fsdp.matrices()) {
    if (m.group_ordinal == g && k++ == j) return m.name;
  }
  return "";
}

// The four rates, in CostRates' order.
std::vector<double> values_of(const CostRates& rates) {
  return {rates.newton_schulz_flops_per_second(), rates.bytes_per_second(),
          rates.inter_node_bytes_per_second(), rates.exchange_latency_seconds()};
}

// The plan FsdpMuon caches is the planner's on the groups' own layout.
FSDP_MUON_WORLD_TEST(FsdpMuonPlan, MatchesThePlannerOnTheLayout) {
  Model model = make_model(5);
  for (const FsdpMuonConfig& config :
       {FsdpMuonConfig(),
        FsdpMuonConfig().planner(OwnerPlanOptions().owner_policy(OwnerPolicy::kHoldersOnly)),
        FsdpMuonConfig().planner(
            OwnerPlanOptions().owner_policy(OwnerPolicy::kAnyRank).prefetch_budget_bytes(300)),
        FsdpMuonConfig().planner(
            OwnerPlanOptions().max_bytes_ratio(1.0).prefetch_budget_bytes(0).overlap_communication(
                false)),
        FsdpMuonConfig()
            .planner(OwnerPlanOptions().max_bytes_ratio(kBytesRatioByCost))
            .rates(CostRates().bytes_per_second(1e15)),
        FsdpMuonConfig().planner(OwnerPlanOptions().owner_schedule(OwnerSchedule::kWindows)),
        FsdpMuonConfig().planner(OwnerPlanOptions()
                                     .owner_schedule(OwnerSchedule::kWindows)
                                     .owner_policy(OwnerPolicy::kHoldersOnly)
                                     .prefetch_budget_bytes(256)),
        FsdpMuonConfig().planner(OwnerPlanOptions()
                                     .owner_schedule(OwnerSchedule::kWindows)
                                     .owner_policy(OwnerPolicy::kAnyRank)
                                     .prefetch_budget_bytes(0))}) {
    // The plan counts what runs (docs/DESIGN.md §7): Gram where kAuto picks it, NorMuon's rows.
    for (const MuonOptions& options :
         {MuonOptions(), MuonOptions()
                             .newton_schulz(NewtonSchulzOptions()
                                                .method(NsMethod::kAuto)
                                                .preconditioning(NsPreconditioning::kAol))
                             .normalization(Normalization::kNorMuon)}) {
      const OwnerPolicy policy = config.planner().owner_policy();
      SCOPED_TRACE(std::string(to_string(policy)) + " " +
                   to_string(config.planner().owner_schedule()) + " budget " +
                   std::to_string(config.planner().prefetch_budget_bytes()) + " " +
                   to_string(options.newton_schulz().method()));
      FsdpMuon fsdp(sharded_matrices(model), options, config);
      std::vector<PlanGroup> groups;
      for (const auto& specs : model_specs()) {
        std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
        for (const Spec& s : specs) shapes.emplace_back(s.name, s.shape);
        groups.push_back(
            plan_group_from_shapes("", shapes, world().size(), options.newton_schulz()));
        for (PlanMatrix& pm : groups.back().matrices) {
          pm.per_row_state = options.normalization() == Normalization::kNorMuon;
        }
      }
      // The planning API is the single source of truth for what runs: the config's planner() at
      // the rates planned with (measured at construction where the config gives none).
      const OwnerPlan& planned = fsdp.owner_plan();
      if (config.rates()) {
        EXPECT_EQ(values_of(planned.rates), values_of(*config.rates()));
      }
      const OwnerPlan expected =
          plan_owners(groups, world().size(), config.planner(), planned.rates);
      EXPECT_EQ(fsdp.owner_plan().owner, expected.owner);
      EXPECT_EQ(fsdp.owner_plan().windows, expected.windows);
      EXPECT_EQ(fsdp.owner_plan().rounds, expected.rounds);
      EXPECT_EQ(fsdp.owner_plan().refresh_after_round, expected.refresh_after_round);
      EXPECT_EQ(fsdp.owner_plan().critical_path_planned(), expected.critical_path_planned());
      EXPECT_EQ(fsdp.owner_plan().schedule, config.planner().owner_schedule());
      EXPECT_EQ(fsdp.owner_plan().critical_path_ratio_planned(),
                expected.critical_path_ratio_planned());
      EXPECT_EQ(fsdp.owner_plan().cost_per_rank, expected.cost_per_rank);
      EXPECT_EQ(fsdp.owner_plan().gather_bytes_per_rank, expected.gather_bytes_per_rank);
      for (const FsdpMuonMatrix& m : fsdp.matrices()) {
        EXPECT_EQ(fsdp.owner_of(m.sharded_parameter), m.owner);
        if (policy == OwnerPolicy::kHoldersOnly) {
          const auto [first, second] = m.group->held_range(m.index, m.owner);
          EXPECT_LT(first, second) << m.name << " is owned by a rank that holds none of it";
        }
      }
      EXPECT_EQ(fsdp.owner_of(model.groups[0]->sharded_parameter(1)), -1);  // 1-D, not given
      EXPECT_EQ(fsdp.owner_plan().cost, expected.cost);
      EXPECT_EQ(fsdp.owner_plan().scatter_bytes_per_rank, expected.scatter_bytes_per_rank);
    }
  }
}

// Results are the same bits for every schedule, prefetch budget, policy and overlap setting; the
// bytes moved are what the plan predicts (under holders-only the docs/DESIGN.md §7 minimum);
// full matrices exist only on their owners, at most one round (two with overlap) at a time.
FSDP_MUON_WORLD_TEST(FsdpMuonSchedule, SchedulesBudgetsAndPoliciesGiveTheSameBitsAndPlannedBytes) {
  const int me = world().rank();
  const int w = world().size();
  struct Run {
    OwnerSchedule schedule;
    OwnerPolicy policy;
    int64_t budget;
    bool overlap;
    double max_bytes_ratio = 1.5;  // kBytesRatioByCost below: bytes made cheap, so it moves more
  };
  // Budget 0, a couple of groups (the owned bytes of the largest group), unlimited.
  const auto rounds = OwnerSchedule::kRounds;
  const auto windows = OwnerSchedule::kWindows;
  const std::vector<Run> runs = {{windows, OwnerPolicy::kHoldersOnly, 0, false},
                                 {windows, OwnerPolicy::kHoldersOnly, 800, false},
                                 {windows, OwnerPolicy::kHoldersOnly, kUnlimitedPrefetch, true},
                                 {windows, OwnerPolicy::kAnyRank, 0, true},
                                 {windows, OwnerPolicy::kAnyRank, kUnlimitedPrefetch, false},
                                 {windows, OwnerPolicy::kBalanced, 800, true},
                                 {rounds, OwnerPolicy::kHoldersOnly, 0, false},
                                 {rounds, OwnerPolicy::kHoldersOnly, 300, true},
                                 {rounds, OwnerPolicy::kAnyRank, 600, false},
                                 {rounds, OwnerPolicy::kBalanced, 0, true},
                                 {rounds, OwnerPolicy::kBalanced, 300, false},
                                 {rounds, OwnerPolicy::kBalanced, 300, true},
                                 {rounds, OwnerPolicy::kBalanced, kUnlimitedPrefetch, true},
                                 {rounds, OwnerPolicy::kBalanced, 300, true, kBytesRatioByCost}};
  std::vector<at::Tensor> first_result;
  for (const Run& run : runs) {
    SCOPED_TRACE(std::string(to_string(run.schedule)) + " " + to_string(run.policy) + " budget " +
                 std::to_string(run.budget) + (run.overlap ? " overlap" : "") + " bytes ratio " +
                 std::to_string(run.max_bytes_ratio));
    Model model = make_model(11);
    const MuonOptions options = MuonOptions(0.02).weight_decay(0.1).newton_schulz(
        NewtonSchulzOptions().compute_dtype(at::kFloat));
    FsdpMuon fsdp(sharded_matrices(model), options,
                  FsdpMuonConfig()
                      .planner(OwnerPlanOptions()
                                   .owner_schedule(run.schedule)
                                   .owner_policy(run.policy)
                                   .prefetch_budget_bytes(run.budget)
                                   .overlap_communication(run.overlap)
                                   .max_bytes_ratio(run.max_bytes_ratio))
                      .rates(CostRates().bytes_per_second(1e15)));
    Muon muon(reference_matrices(model), options);
    const OwnerPlan& plan = fsdp.owner_plan();
    if (run.schedule == windows) {
      EXPECT_TRUE(!plan.windows.empty());
      EXPECT_EQ(plan.rounds.size(), plan.windows.size());
      if (run.budget == 0) {
        EXPECT_EQ(fsdp.owner_plan().windows.size(), 3u);
      }
      if (run.budget == kUnlimitedPrefetch) {
        EXPECT_EQ(fsdp.owner_plan().windows.size(), 1u);
      }
    } else {
      EXPECT_TRUE(fsdp.owner_plan().windows.empty());
      // Everything fits one round; at 1e15 B/s splitting it would hide nothing.
      if (run.budget == kUnlimitedPrefetch) {
        EXPECT_EQ(plan.rounds.size(), 1u);
      }
    }
    // Every matrix is in exactly one round.
    size_t in_rounds = 0;
    for (const auto& round : plan.rounds) in_rounds += round.size();
    EXPECT_EQ(in_rounds, fsdp.matrices().size());

    if (w > 1) {  // the model really spreads matrices over ranks
      EXPECT_GT(std::accumulate(plan.gather_bytes_per_rank.begin(),
                                plan.gather_bytes_per_rank.end(), int64_t{0}),
                0);
    }
    // docs/DESIGN.md §7 by hand: each element held by a non-owner goes to its owner and back once.
    int64_t gather_min = 0;
    int64_t scatter_min = 0;
    for (const FsdpMuonMatrix& m : fsdp.matrices()) {
      for (int r = 0; r < w; ++r) {
        const auto [first, second] = m.group->held_range(m.index, r);
        if (r == m.owner) continue;
        if (r == me) gather_min += (second - first) * 4;
        if (m.owner == me) scatter_min += (second - first) * 4;
      }
    }
    if (run.policy == OwnerPolicy::kHoldersOnly && run.schedule == rounds) {
      // The same owners as the reference (per-window owners under kWindows may differ).
      EXPECT_EQ(plan.max_bytes_per_rank(), plan.holders_only_max_bytes);
    }
    if (run.policy == OwnerPolicy::kBalanced) {
      EXPECT_EQ(plan.max_bytes_ratio == 1.5, run.max_bytes_ratio == 1.5);
      EXPECT_LE(plan.max_bytes_per_rank(), plan.max_bytes_ratio * plan.holders_only_max_bytes);
    }
    // Transient full matrices: the owned ones of each round (by hand from the matrices), or of
    // two consecutive rounds with overlap.
    std::vector<int64_t> round_bytes;
    for (const auto& round : plan.rounds) {
      int64_t bytes = 0;
      for (const auto& [g, j] : round) {
        for (const FsdpMuonMatrix& m : fsdp.matrices()) {
          if (m.owner == me && m.group_ordinal == g && m.name == plan_name(fsdp, g, j)) {
            bytes += m.rows * m.cols * 4;
          }
        }
      }
      EXPECT_EQ(bytes, plan.round_full_bytes_per_rank[&round - plan.rounds.data()][me]);
      round_bytes.push_back(bytes);
    }
    int64_t transient = 0;
    ASSERT_EQ(plan.overlap_with_next.size(), round_bytes.size());
    for (size_t t = 0; t < round_bytes.size(); ++t) {
      if (plan.overlap_with_next[t]) {
        EXPECT_TRUE(run.overlap);
        // Two rounds are held at once only where both fit the budget.
        EXPECT_LE(round_bytes[t] + round_bytes[t + 1], run.budget);
      }
      const int64_t next = plan.overlap_with_next[t] ? round_bytes[t + 1] : 0;
      transient = std::max(transient, round_bytes[t] + next);
    }
    if (run.budget != kUnlimitedPrefetch) {
      // A round holds more than its share of the budget only when one matrix alone does.
      const int64_t share = run.overlap ? run.budget / 2 : run.budget;
      for (size_t t = 0; t < plan.rounds.size(); ++t) {
        if (run.schedule == rounds && plan.rounds[t].size() > 1) {
          for (int r = 0; r < w; ++r) {
            int64_t owned = 0;
            for (const auto& [g, j] : plan.rounds[t]) owned += plan.owner[g][j] == r;
            if (owned > 1) {
              EXPECT_LE(plan.round_full_bytes_per_rank[t][r], share) << "round " << t;
            }
          }
        }
      }
    }

    for (int step = 0; step < 4; ++step) {
      feed_gradients(model, 1100 + step);
      fsdp.step();
      muon.step();
      const FsdpMuonStepStats& stats = fsdp.last_step_stats();
      EXPECT_EQ(stats.gather_bytes, plan.gather_bytes_per_rank[me]);
      EXPECT_EQ(stats.scatter_bytes, plan.scatter_bytes_per_rank[me]);
      EXPECT_EQ(stats.gather_bytes, gather_min);
      EXPECT_EQ(stats.scatter_bytes, scatter_min);
      EXPECT_EQ(stats.max_transient_bytes, transient);
      EXPECT_EQ(stats.rounds, static_cast<int64_t>(plan.rounds.size()));
      bool owns_any = false;
      for (const FsdpMuonMatrix& m : fsdp.matrices()) owns_any |= m.owner == me;
      if (!owns_any) {
        EXPECT_EQ(stats.max_transient_bytes, 0);
      }
    }
    expect_matches_reference(model, "schedule");
    std::vector<at::Tensor> result;
    for (const auto& group : model.groups) result.push_back(group->main_weight_shard().clone());
    if (first_result.empty()) {
      first_result = result;
    } else {
      for (size_t g = 0; g < result.size(); ++g) EXPECT_TRUE(at::equal(result[g], first_result[g]));
    }
  }
}

// An MoE-like model: per layer a router, then experts of the same three shapes (and a 1xN
// matrix each), so an owner holds many same-shape matrices in one window.
std::vector<std::vector<Spec>> moe_specs() {
  std::vector<std::vector<Spec>> specs;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string l = "l" + std::to_string(layer) + ".";
    std::vector<Spec> group{{l + "router", {9, 13}}, {l + "norm", {13}}};
    for (int e = 0; e < 9; ++e) {
      const std::string x = l + "e" + std::to_string(e) + ".";
      group.push_back({x + "gate", {5, 13}});
      group.push_back({x + "up", {5, 13}});
      group.push_back({x + "down", {13, 5}});
      group.push_back({x + "row", {1, 7}});
    }
    specs.push_back(std::move(group));
  }
  return specs;
}

// Batched Newton–Schulz (docs/DESIGN.md §4, "Batching"): every mode gives single-device Muon's
// bits wherever FsdpMuon batches only bitwise calls (fp32 on one thread, which this test runs
// with, and anything under kNever); kAlways in bf16 batches non-bitwise calls and is held to
// rounding. The number of Newton–Schulz calls is the number of (shape, optimizer group) classes
// a rank owns per round when it batches, one per matrix when it does not.
FSDP_MUON_WORLD_TEST(FsdpMuonBatching, MoeExpertsEqualSingleDeviceMuonInEveryMode) {
  ASSERT_EQ(at::get_num_threads(), 1);
  const int me = world().rank();
  struct Run {
    NewtonSchulzBatching mode;
    c10::ScalarType compute_dtype;
    int64_t budget;
    bool batches;
    bool bitwise;
  };
  const std::vector<Run> runs = {
      {NewtonSchulzBatching::kWhereBitwise, at::kFloat, kUnlimitedPrefetch, true, true},
      {NewtonSchulzBatching::kWhereBitwise, at::kFloat, 0, true, true},
      {NewtonSchulzBatching::kAlways, at::kFloat, kUnlimitedPrefetch, true, true},
      {NewtonSchulzBatching::kNever, at::kFloat, kUnlimitedPrefetch, false, true},
      {NewtonSchulzBatching::kWhereBitwise, at::kBFloat16, kUnlimitedPrefetch, false, true},
      {NewtonSchulzBatching::kNever, at::kBFloat16, kUnlimitedPrefetch, false, true},
      {NewtonSchulzBatching::kAlways, at::kBFloat16, kUnlimitedPrefetch, true, false}};
  for (const Run& run : runs) {
    SCOPED_TRACE(std::string(to_string(run.mode)) +
                 (run.compute_dtype == at::kFloat ? " fp32" : " bf16") + " budget " +
                 std::to_string(run.budget));
    Model model = make_model(31, moe_specs());
    const MuonOptions options = MuonOptions(0.02).weight_decay(0.1).newton_schulz(
        NewtonSchulzOptions().compute_dtype(run.compute_dtype));
    FsdpMuon fsdp(split_groups(sharded_matrices(model), options), options,
                  FsdpMuonConfig().batch_newton_schulz(run.mode).planner(
                      OwnerPlanOptions().prefetch_budget_bytes(run.budget)));
    Muon muon(split_groups(reference_matrices(model), options), options);
    int64_t owned = 0;
    int64_t classes = 0;  // distinct (rows, cols, optimizer group) this rank owns, per round
    // The plan's (group, j): the j-th of the group's matrices in matrices().
    std::vector<std::vector<const FsdpMuonMatrix*>> of_group(fsdp.fsdp_groups().size());
    for (const FsdpMuonMatrix& m : fsdp.matrices()) of_group[m.group_ordinal].push_back(&m);
    for (const auto& round : fsdp.owner_plan().rounds) {
      std::vector<std::tuple<int64_t, int64_t, size_t>> seen;
      for (const auto& [g, j] : round) {
        const FsdpMuonMatrix& m = *of_group[g][j];
        if (m.owner != me) continue;
        ++owned;
        const auto key = std::make_tuple(m.rows, m.cols, m.param_group);
        if (std::find(seen.begin(), seen.end(), key) == seen.end()) seen.push_back(key);
      }
      classes += static_cast<int64_t>(seen.size());
    }
    for (int step = 0; step < 3; ++step) {
      feed_gradients(model, 3100 + step);
      fsdp.step();
      muon.step();
      const FsdpMuonStepStats& stats = fsdp.last_step_stats();
      EXPECT_EQ(stats.orthogonalized_matrices, owned);
      EXPECT_EQ(stats.newton_schulz_calls, run.batches ? classes : owned);
    }
    if (run.batches && run.budget == kUnlimitedPrefetch && world().size() <= 2) {
      // Few ranks own many experts each in one round: batching really happened. (Budget 0 is
      // one matrix per round, so nothing to batch.)
      EXPECT_LT(classes, owned);
    }
    if (run.bitwise) {
      expect_matches_reference(model, "batching");
      continue;
    }
    for (size_t g = 0; g < model.groups.size(); ++g) {
      for (size_t i = 0; i < model.groups[g]->num_parameters(); ++i) {
        const auto [first, second] = model.groups[g]->held_range(i);
        const at::Tensor expected =
            model.reference[g][i].detach().reshape({-1}).slice(0, first, second);
        EXPECT_TRUE(at::allclose(model.groups[g]->sharded_parameter(i), expected, 0, 1e-3))
            << model.groups[g]->slot(i).name;
      }
    }
  }
}

// NorMuon (docs/DESIGN.md §3, §4): each holder keeps the per-row state of the rows whose first
// element it holds, sends it to the owner with its piece of the matrix and takes it back with
// the update. Every run equals single-device Muon with NorMuon bit for bit, state included, at
// every W: plain, with Gram, restarts, AOL and Turbo-Muon's 4 steps, bf16 Newton–Schulz, under
// every owner policy and schedule, batched (MoE experts) and not; and under holders-only the
// bytes sent are the plan's and the hand count (elements plus row starts held by non-owners).
FSDP_MUON_WORLD_TEST(FsdpMuonNorMuon, EqualsSingleDeviceMuonWithNorMuonBitwise) {
  ASSERT_EQ(at::get_num_threads(), 1);
  const int me = world().rank();
  const int w = world().size();
  const MuonOptions normuon = MuonOptions(0.02)
                                  .weight_decay(0.05)
                                  .normalization(Normalization::kNorMuon)
                                  .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
  struct Run {
    std::string name;
    MuonOptions options;
    FsdpMuonConfig config;
    bool moe = false;
  };
  const auto holders_rounds = FsdpMuonConfig().planner(
      OwnerPlanOptions().owner_policy(OwnerPolicy::kHoldersOnly).prefetch_budget_bytes(300));
  std::vector<Run> runs = {
      {"defaults", normuon, FsdpMuonConfig()},
      {"beta2_eps_holders_only_rounds",
       MuonOptions(normuon).normuon_beta2(0.5).normuon_eps(1e-3).nesterov(false), holders_rounds},
      {"gram_restarts_any_rank_windows",
       MuonOptions(normuon).newton_schulz(NewtonSchulzOptions(normuon.newton_schulz())
                                              .method(NsMethod::kGram)
                                              .gram_restarts({1, 3})),
       FsdpMuonConfig().planner(OwnerPlanOptions()
                                    .owner_policy(OwnerPolicy::kAnyRank)
                                    .owner_schedule(OwnerSchedule::kWindows)
                                    .prefetch_budget_bytes(0))},
      {"gram_aol_turbo_4_steps_no_overlap",
       MuonOptions(normuon).newton_schulz(NewtonSchulzOptions(normuon.newton_schulz())
                                              .method(NsMethod::kGram)
                                              .preconditioning(NsPreconditioning::kAol)
                                              .custom_coefficients({{4.6051, -9.6552, 5.6769},
                                                                    {4.7505, -6.0861, 2.1790},
                                                                    {2.7763, -2.3190, 0.5523},
                                                                    {2.4231, -2.2861, 0.8193}})
                                              .steps(4)),
       FsdpMuonConfig().planner(
           OwnerPlanOptions().overlap_communication(false).prefetch_budget_bytes(400))},
      {"auto_aol_bf16",
       MuonOptions(normuon).newton_schulz(NewtonSchulzOptions(normuon.newton_schulz())
                                              .method(NsMethod::kAuto)
                                              .preconditioning(NsPreconditioning::kAol)
                                              .compute_dtype(at::kBFloat16)),
       FsdpMuonConfig()},
      {"moe_batched", normuon, FsdpMuonConfig(), true},
      {"moe_batched_gram_aol",
       MuonOptions(normuon).newton_schulz(NewtonSchulzOptions(normuon.newton_schulz())
                                              .method(NsMethod::kGram)
                                              .preconditioning(NsPreconditioning::kAol)),
       FsdpMuonConfig().planner(OwnerPlanOptions().prefetch_budget_bytes(2000)), true},
  };
  for (const Run& run : runs) {
    SCOPED_TRACE(run.name);
    Model model = run.moe ? make_model(41, moe_specs()) : make_model(41);
    FsdpMuon fsdp(split_groups(sharded_matrices(model), run.options), run.options, run.config);
    Muon muon(split_groups(reference_matrices(model), run.options), run.options);
    // docs/DESIGN.md §7 with NorMuon: each element and each row start held by a non-owner goes
    // to its owner and back once (4 bytes each: fp32 main weights and state).
    int64_t gather_min = 0;
    int64_t scatter_min = 0;
    for (const FsdpMuonMatrix& m : fsdp.matrices()) {
      for (int r = 0; r < w; ++r) {
        if (r == m.owner) continue;
        const auto held = m.group->held_range(m.index, r);
        const auto rows = detail::rows_starting_in(held, m.cols);
        const int64_t bytes = (held.second - held.first + rows.second - rows.first) * 4;
        if (r == me) gather_min += bytes;
        if (m.owner == me) scatter_min += bytes;
      }
    }
    int64_t calls = 0;
    for (int step = 0; step < 4; ++step) {
      feed_gradients(model, 4100 + step);
      fsdp.step();
      muon.step();
      const FsdpMuonStepStats& stats = fsdp.last_step_stats();
      EXPECT_EQ(stats.gather_bytes, fsdp.owner_plan().gather_bytes_per_rank[me]);
      EXPECT_EQ(stats.scatter_bytes, fsdp.owner_plan().scatter_bytes_per_rank[me]);
      if (run.config.planner().owner_policy() == OwnerPolicy::kHoldersOnly) {
        EXPECT_EQ(stats.gather_bytes, gather_min);
        EXPECT_EQ(stats.scatter_bytes, scatter_min);
      }
      calls += stats.newton_schulz_calls - stats.orthogonalized_matrices;
    }
    if (run.name == "moe_batched" && w <= 2) {
      // Few ranks own many same-shape experts in one round: NorMuon's batches really ran.
      EXPECT_LT(calls, 0) << "the experts were batched";
    }
    expect_matches_reference(model, run.name);
    // The state: the momentum slice and the rows this rank keeps of the reference's per-row
    // second moment, bit for bit.
    for (size_t g = 0; g < model.groups.size(); ++g) {
      const auto& group = model.groups[g];
      for (size_t i = 0; i < group->num_parameters(); ++i) {
        const ParameterSlot& slot = group->slot(i);
        if (slot.shape.size() != 2) continue;
        const at::Tensor& p = group->sharded_parameter(i);
        const at::Tensor& ref = model.reference[g][i];
        const auto& mine =
            static_cast<const MuonParamState&>(*fsdp.state().at(p.unsafeGetTensorImpl()));
        const auto& theirs =
            static_cast<const MuonParamState&>(*muon.state().at(ref.unsafeGetTensorImpl()));
        const auto held = group->held_range(i);
        const auto [first, last] = detail::rows_starting_in(held, slot.shape[1]);
        ASSERT_TRUE(mine.normuon_variance().defined()) << slot.name;
        EXPECT_TRUE(
            at::equal(mine.normuon_variance(), theirs.normuon_variance().slice(0, first, last)))
            << run.name << ": NorMuon state of " << slot.name << " on rank " << me;
        EXPECT_TRUE(at::equal(mine.momentum_buffer(), theirs.momentum_buffer().reshape({-1}).slice(
                                                          0, held.first, held.second)))
            << run.name << ": momentum of " << slot.name;
        EXPECT_GT(theirs.normuon_variance().abs().sum().item<double>(), 0) << slot.name;
      }
    }
  }
}

// The rows a rank keeps NorMuon state for tile every matrix in rank order, whatever the layout:
// a rank may hold elements and no row start, never the other way round.
FSDP_MUON_WORLD_TEST(FsdpMuonNorMuon, RowStateTilesEveryMatrix) {
  Model model = make_model(43);
  for (const auto& group : model.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const ParameterSlot& slot = group->slot(i);
      if (slot.shape.size() != 2) continue;
      int64_t next = 0;
      for (int r = 0; r < world().size(); ++r) {
        const auto held = group->held_range(i, r);
        const auto [first, last] = detail::rows_starting_in(held, slot.shape[1]);
        EXPECT_EQ(first, next) << slot.name << " rank " << r;
        EXPECT_LE(last - first, held.second - held.first) << slot.name << " rank " << r;
        next = last;
      }
      EXPECT_EQ(next, slot.shape[0]) << slot.name;
    }
  }
}

// Overlapping the exchanges with Newton–Schulz changes when collectives run, never the bits: both
// settings equal single-device Muon (bf16 Newton–Schulz, several optimizer groups) and each other.
FSDP_MUON_WORLD_TEST(FsdpMuonSchedule, OverlapOnAndOffGiveTheSameBits) {
  std::vector<std::vector<at::Tensor>> results;
  for (const bool overlap : {false, true}) {
    for (const int64_t budget : {int64_t{0}, int64_t{400}}) {
      SCOPED_TRACE(std::string(overlap ? "overlap" : "no overlap") + " budget " +
                   std::to_string(budget));
      Model model = make_model(31);
      const MuonOptions options = MuonOptions(0.02).weight_decay(0.05);
      FsdpMuon fsdp(
          split_groups(sharded_matrices(model), options), options,
          FsdpMuonConfig().planner(
              OwnerPlanOptions().overlap_communication(overlap).prefetch_budget_bytes(budget)));
      Muon muon(split_groups(reference_matrices(model), options), options);
      if (budget == 0) {
        EXPECT_GT(fsdp.owner_plan().rounds.size(), 1u);  // something to overlap
      }
      for (int step = 0; step < 3; ++step) {
        feed_gradients(model, 3100 + step);
        fsdp.step();
        muon.step();
      }
      expect_matches_reference(model, "overlap");
      std::vector<at::Tensor> result;
      for (const auto& group : model.groups) result.push_back(group->main_weight_shard().clone());
      results.push_back(std::move(result));
    }
  }
  for (size_t k = 1; k < results.size(); ++k) {
    for (size_t g = 0; g < results[k].size(); ++g) {
      EXPECT_TRUE(at::equal(results[k][g], results[0][g])) << "setting " << k << " group " << g;
    }
  }
}

// One round moves one buffer: groups with different main dtypes whose matrices share a round are
// an error on every rank, naming both groups and the fix; one group per window runs.
FSDP_MUON_WORLD_TEST(FsdpMuonSchedule, GroupsSharingARoundNeedOneMainDtype) {
  std::vector<at::Tensor> weights;
  {
    testing::SeededRandom random(41);
    weights = {at::randn({5, 3}), at::randn({5, 3})};
  }
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    groups.push_back(std::make_shared<FsdpParameterGroup>(
        std::vector<std::pair<std::string, at::Tensor>>{
            {"w" + std::to_string(groups.size()), weights[groups.size()]}},
        world_ptr(),
        FsdpParameterGroupOptions().broadcast_from_rank0(false).main_dtype(dtype).name(
            "g" + std::to_string(groups.size()))));
  }
  const std::vector<at::Tensor> params = {groups[0]->sharded_parameter(0),
                                          groups[1]->sharded_parameter(0)};
  try {
    FsdpMuon fsdp(
        params, MuonOptions(),
        FsdpMuonConfig().planner(OwnerPlanOptions().prefetch_budget_bytes(kUnlimitedPrefetch)));
    ADD_FAILURE() << "expected an error: one round mixes fp32 and fp64 groups";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("different main dtypes"), std::string::npos) << what;
    EXPECT_NE(what.find("'g0'"), std::string::npos) << what;
    EXPECT_NE(what.find("'g1'"), std::string::npos) << what;
  }
  FsdpMuon windows(
      params, MuonOptions(),
      FsdpMuonConfig().planner(
          OwnerPlanOptions().owner_schedule(OwnerSchedule::kWindows).prefetch_budget_bytes(0)));
  EXPECT_EQ(windows.owner_plan().rounds.size(), 2u);
}

// A rank that owns nothing allocates no full matrix: at W=4 with one small matrix per group, two
// ranks own nothing.
FSDP_MUON_WORLD_TEST(FsdpMuonSchedule, RanksOwningNothingAllocateNothing) {
  Model model = make_model(21, {{{"x", {3, 4}}}, {{"y", {2, 5}}}});
  FsdpMuon fsdp(
      sharded_matrices(model),
      MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)),
      FsdpMuonConfig().planner(OwnerPlanOptions().prefetch_budget_bytes(kUnlimitedPrefetch)));
  Muon muon(reference_matrices(model),
            MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)));
  feed_gradients(model, 2100);
  fsdp.step();
  muon.step();
  int64_t owned = 0;
  for (const FsdpMuonMatrix& m : fsdp.matrices()) {
    if (m.owner == world().rank()) owned += m.rows * m.cols * 4;
  }
  EXPECT_EQ(fsdp.last_step_stats().max_transient_bytes, owned);
  if (world().rank() >= 2) {
    EXPECT_EQ(owned, 0);
  }
  expect_matches_reference(model, "owning nothing");
}

// ---- a sharded module with AdamW for the rest ----

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 11));
    fc2 = register_module("fc2", torch::nn::Linear(11, 5));
    fc3 = register_module("fc3", torch::nn::Linear(torch::nn::LinearOptions(5, 3).bias(false)));
    gain = register_parameter("gain", at::ones({3}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc3(at::tanh(fc2(at::tanh(fc1(x))))) * gain; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  at::Tensor gain;
};
TORCH_MODULE(Net);

FSDP_MUON_WORLD_TEST(FsdpMuonModule, TrainsExactlyLikeSingleDeviceMuonPlusAdamW) {
  const int me = world().rank();
  const int w = world().size();
  Net net{nullptr};
  Net ref{nullptr};
  {
    testing::SeededRandom random(3);
    net = Net();
    ref = Net();
  }
  {
    at::NoGradGuard no_grad;
    auto src = net->parameters();
    auto dst = ref->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  auto groups = shard_module(*net, world_ptr());
  std::vector<at::Tensor> matrices, others;
  for (const auto& group : groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      (group->slot(i).shape.size() == 2 ? matrices : others).push_back(group->sharded_parameter(i));
    }
  }
  std::vector<at::Tensor> ref_matrices, ref_others;
  for (const auto& p : ref->parameters()) (p.dim() == 2 ? ref_matrices : ref_others).push_back(p);
  ASSERT_EQ(matrices.size(), 3u);
  ASSERT_EQ(others.size(), 3u);

  const MuonOptions muon_options = MuonOptions(0.02).weight_decay(0.01).newton_schulz(
      NewtonSchulzOptions().compute_dtype(at::kFloat));
  const auto adamw_options = torch::optim::AdamWOptions(0.01).weight_decay(0.01);
  FsdpMuon fsdp(matrices, muon_options);
  torch::optim::AdamW adamw(others, adamw_options);
  Muon ref_muon(ref_matrices, muon_options);
  torch::optim::AdamW ref_adamw(ref_others, adamw_options);

  for (int step = 0; step < 5; ++step) {
    for (auto& group : groups) group->zero_grad();
    at::Tensor x;
    {
      testing::SeededRandom random(500 + 10 * step + me);  // each rank its own batch
      x = at::randn({4, 6});
    }
    net->forward(x).pow(2).mean().backward();
    for (auto& group : groups) group->reduce_scatter_grads();
    // The reference gets the averaged gradients FsdpMuon and AdamW see: the gathered shards.
    auto ref_params = ref->named_parameters();
    for (auto& group : groups) {
      at::Tensor full = at::empty({group->padded_numel()}, group->grad_shard().options());
      world().all_gather(group->grad_shard(), full);
      for (size_t i = 0; i < group->num_parameters(); ++i) {
        const ParameterSlot& slot = group->slot(i);
        ref_params[slot.name].mutable_grad() =
            full.narrow(0, slot.offset, slot.numel).view(slot.shape).clone();
      }
    }
    adamw.step();  // first: FsdpMuon's step refreshes the model weights of its groups
    fsdp.step();
    // The module's own group ("gain") has no matrix, so FsdpMuon does not know it.
    for (auto& group : groups) {
      if (std::find(fsdp.fsdp_groups().begin(), fsdp.fsdp_groups().end(), group) ==
          fsdp.fsdp_groups().end()) {
        group->refresh_model_weights();
      }
    }
    ref_adamw.step();
    ref_muon.step();
  }
  auto ref_params = ref->named_parameters();
  for (const auto& group : groups) {
    const auto module_params = group->model_parameters();
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const std::string& name = group->slot(i).name;
      const at::Tensor expected = ref_params[name].detach();
      const auto [first, second] = group->held_range(i);
      const at::Tensor shard = group->sharded_parameter(i);
      const at::Tensor slice = expected.reshape({-1}).slice(0, first, second);
      EXPECT_TRUE(at::equal(shard, slice))
          << name << " on rank " << me << " of " << w << ": max difference "
          << (shard - slice).abs().max().item<double>();
      EXPECT_TRUE(at::equal(module_params[i].detach(), expected)) << name;
    }
  }
}

// ---- the cost model's rates: measured at construction, or given (docs/DESIGN.md §7) ----

// The rates a FsdpMuon planned with, as every rank sees them: rank 0's, after checking that
// every rank has exactly the same, and that the stats report the plan's.
std::vector<double> rates_alike(const FsdpMuon& fsdp) {
  const FsdpMuonStepStats& st = fsdp.last_step_stats();
  EXPECT_EQ(values_of(st.rates), values_of(fsdp.owner_plan().rates));
  std::vector<double> mine = values_of(st.rates);
  mine.push_back(st.rates_measured ? 1.0 : 0.0);
  const at::Tensor send = at::tensor(mine, at::kDouble);
  const at::Tensor all = at::empty({world().size() * send.numel()}, at::kDouble);
  world().all_gather(send, all);
  for (int r = 0; r < world().size(); ++r) {
    EXPECT_TRUE(
        at::equal(all.narrow(0, r * send.numel(), send.numel()), all.narrow(0, 0, send.numel())))
        << "rank " << r << " planned with other rates than rank 0";
  }
  return mine;
}

// FsdpMuonConfig::rates left std::nullopt: measured, alike on every rank; what nothing measures
// keeps CostRates' default, and describe() says which.
FSDP_MUON_WORLD_TEST(FsdpMuonCalibration, RatesMeasuredAlikeOnEveryRank) {
  Model model = make_model(61);
  const CostRates defaults;
  FsdpMuon fsdp(sharded_matrices(model), MuonOptions());
  EXPECT_FALSE(fsdp.config().rates().has_value());
  const std::vector<double> rates = rates_alike(fsdp);
  const FsdpMuonStepStats& st = fsdp.last_step_stats();
  EXPECT_TRUE(st.rates_measured);
  EXPECT_GT(rates[0], 0);
  EXPECT_NE(rates[0], defaults.newton_schulz_flops_per_second());
  const std::string described = fsdp.describe();
  EXPECT_NE(described.find("rates measured at construction"), std::string::npos) << described;
  if (world().size() > 1) {
    EXPECT_GT(rates[1], 0);
    EXPECT_NE(rates[1], defaults.bytes_per_second());
    EXPECT_GE(rates[3], 0);
    EXPECT_NE(rates[3], defaults.exchange_latency_seconds());
    EXPECT_NE(described.find("nothing to measure it on: inter_node_bytes_per_second)"),
              std::string::npos)
        << described;
  } else {  // nothing moves: the link rates are CostRates' defaults
    EXPECT_EQ(rates[1], defaults.bytes_per_second());
    EXPECT_EQ(rates[3], defaults.exchange_latency_seconds());
    EXPECT_NE(described.find("nothing to measure it on: bytes_per_second, "
                             "inter_node_bytes_per_second, exchange_latency_seconds)"),
              std::string::npos)
        << described;
  }
  EXPECT_EQ(rates[2], defaults.inter_node_bytes_per_second());  // one replica
  EXPECT_EQ(st.predicted_seconds, fsdp.owner_plan().pipelined_seconds());
  EXPECT_GT(st.predicted_seconds, 0);
}

// FsdpMuonConfig::rates given: the plan is made at exactly those rates (the others CostRates'
// defaults, not measured), nothing is measured, and the stats, describe() and the plan say so.
FSDP_MUON_WORLD_TEST(FsdpMuonCalibration, GivenRatesArePlannedWithExactly) {
  Model model = make_model(61);
  const CostRates one_rate = CostRates().bytes_per_second(1e9);
  const CostRates every_rate = CostRates()
                                   .newton_schulz_flops_per_second(1e12)
                                   .bytes_per_second(2e9)
                                   .inter_node_bytes_per_second(3e8)
                                   .exchange_latency_seconds(1e-3);
  for (const CostRates& given : {one_rate, every_rate, CostRates()}) {
    const FsdpMuonConfig config = FsdpMuonConfig().rates(given);
    FsdpMuon fsdp(sharded_matrices(model), MuonOptions(), config);
    std::vector<double> expected = values_of(given);
    expected.push_back(0.0);  // not measured
    EXPECT_EQ(rates_alike(fsdp), expected);
    EXPECT_FALSE(fsdp.last_step_stats().rates_measured);
    EXPECT_EQ(values_of(fsdp.owner_plan().rates), values_of(given));
    const std::string described = fsdp.describe();
    EXPECT_NE(described.find("rates given by FsdpMuonConfig::rates"), std::string::npos)
        << described;
    // The plan is the planner's at those rates.
    std::vector<PlanGroup> groups;
    for (const auto& specs : model_specs()) {
      std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
      for (const Spec& s : specs) shapes.emplace_back(s.name, s.shape);
      groups.push_back(plan_group_from_shapes("", shapes, world().size(), NewtonSchulzOptions()));
    }
    const OwnerPlan expected_plan = plan_owners(groups, world().size(), config.planner(), given);
    EXPECT_EQ(fsdp.owner_plan().owner, expected_plan.owner);
    EXPECT_EQ(fsdp.owner_plan().rounds, expected_plan.rounds);
    EXPECT_EQ(fsdp.owner_plan().round_gather_seconds, expected_plan.round_gather_seconds);
    EXPECT_EQ(fsdp.owner_plan().pipelined_seconds(), expected_plan.pipelined_seconds());
  }
  // Given on some ranks, measured on the others: the same error on every rank, no hang.
  if (world().size() > 1) {
    expect_error(
        [&] {
          FsdpMuon(sharded_matrices(model), MuonOptions(),
                   world().rank() == 0 ? FsdpMuonConfig().rates(one_rate) : FsdpMuonConfig());
        },
        {"fsdp_muon::FsdpMuon: " + std::to_string(world().size() - 1) + " of " +
         std::to_string(world().size()) +
         " ranks measure the cost model's rates at construction and the others do not"});
  }
}

// ---- errors: a clear message on every rank, no hang ----

FSDP_MUON_WORLD_TEST(FsdpMuonErrors, NotAShardedParameter) {
  Model model = make_model(31);
  at::Tensor plain = at::zeros({4, 4}, at::requires_grad());
  expect_error([&] { FsdpMuon(std::vector<at::Tensor>{plain}, MuonOptions()); },
               {"not a sharded parameter"});
  // Mixed in with sharded ones: the ranks still agree to fail (the fingerprint exchange runs).
  auto params = sharded_matrices(model);
  params.insert(params.begin() + 1, plain);
  expect_error([&] { FsdpMuon(params, MuonOptions()); },
               {"parameter 1 of parameter group 0", "not a sharded parameter"});
  // The module's own tensor is not the sharded one either.
  expect_error(
      [&] {
        FsdpMuon(std::vector<at::Tensor>{model.groups[0]->model_parameters()[0]}, MuonOptions());
      },
      {"not a sharded parameter"});
  // Only rank 0 passes a bad tensor: every rank fails, none hangs.
  auto uneven = sharded_matrices(model);
  if (world().rank() == 0) uneven.push_back(plain);
  if (world().rank() == 0) {
    expect_error([&] { FsdpMuon(uneven, MuonOptions()); }, {"not a sharded parameter"});
  } else {
    expect_error([&] { FsdpMuon(uneven, MuonOptions()); },
                 {"fsdp_muon::FsdpMuon failed on rank 0 of"});
  }
}

FSDP_MUON_WORLD_TEST(FsdpMuonErrors, NonMatrixParameters) {
  Model model = make_model(32);
  std::vector<at::Tensor> all;
  for (const auto& group : model.groups) {
    for (const auto& p : group->sharded_parameters()) all.push_back(p);
  }
  expect_error(
      [&] { FsdpMuon(all, MuonOptions()); },
      {"only 2-D parameters", "2 are not", "'a.b1' [7]", "'b.norm' [5]", "skip_non_matrix(true)"});
  // Skipped with skip_non_matrix: the matrices still train exactly.
  const MuonOptions options = MuonOptions().skip_non_matrix(true).newton_schulz(
      NewtonSchulzOptions().compute_dtype(at::kFloat));
  FsdpMuon fsdp(all, options);
  Muon muon(reference_matrices(model), options);
  EXPECT_EQ(fsdp.matrices().size(), 8u);
  feed_gradients(model, 3200);
  const at::Tensor bias_before = model.groups[0]->sharded_parameter(1).clone();
  fsdp.step();
  muon.step();
  EXPECT_TRUE(at::equal(model.groups[0]->sharded_parameter(1), bias_before));
  // The reference 1-D tensors were never stepped either, so everything matches.
  expect_matches_reference(model, "skip_non_matrix");
}

// Forwards every collective to another communicator: a distinct Communicator object on the
// same ranks, as a second mesh would be.
class ForwardingCommunicator final : public Communicator {
 public:
  explicit ForwardingCommunicator(std::shared_ptr<Communicator> inner)
      : Communicator(inner->rank(), inner->size()), inner_(std::move(inner)) {}
  c10::Device device() const override { return inner_->device(); }
  std::string backend_name() const override { return "forwarding"; }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                       const at::Tensor& recv, const std::vector<int64_t>& recv_counts) override {
    inner_->all_to_all_v(send, send_counts, recv, recv_counts);
  }
  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override {
    inner_->all_gather(send, recv);
  }
  void do_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                       const std::vector<int64_t>& recv_counts) override {
    inner_->all_gather_v(send, recv, recv_counts);
  }
  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    inner_->reduce_scatter_mean(send, recv);
  }
  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    inner_->all_reduce(tensor, op);
  }
  void do_broadcast(const at::Tensor& tensor, int root) override {
    inner_->broadcast(tensor, root);
  }
  void do_barrier() override { inner_->barrier(); }

 private:
  std::shared_ptr<Communicator> inner_;
};

FSDP_MUON_WORLD_TEST(FsdpMuonErrors, GroupsOnDifferentCommunicators) {
  Model a = make_model(33);
  Model b = make_model(34, {{{"other.w", {4, 3}}}},
                       std::make_shared<ForwardingCommunicator>(world_ptr()));
  auto params = sharded_matrices(a);
  params.push_back(b.groups[0]->sharded_parameter(0));
  expect_error([&] { FsdpMuon(params, MuonOptions()); },
               {"'g0'", "'other.w'", "different meshes", "communicators"});
}

FSDP_MUON_WORLD_TEST(FsdpMuonErrors, ParameterListsDifferAcrossRanks) {
  if (world().size() == 1) GTEST_SKIP() << "needs two ranks";
  const bool odd = world().rank() == 1;
  // Order.
  {
    Model model = make_model(35);
    auto params = sharded_matrices(model);
    if (odd) std::reverse(params.begin(), params.end());
    expect_error([&] { FsdpMuon(params, MuonOptions()); },
                 {"fsdp_muon::FsdpMuon: the ranks constructed different optimizers (rank(s) 1 "
                  "differ from rank 0; this is rank " +
                      std::to_string(world().rank()),
                  "first difference, parameter group 0 parameter 0: rank 0 has FSDP group 'g0' ",
                  "'a.w1' [5, 7], rank 1 has FSDP group 'g2' ", "'c.w' [6, 6]"});
  }
  // Names and shapes: the groups themselves differ, so FsdpParameterGroup refuses them on every
  // rank before FsdpMuon sees them.
  {
    auto specs = model_specs();
    if (odd) specs[1][0].name = "b.renamed";
    expect_error([&] { make_model(36, specs); },
                 {"fsdp_muon::FsdpParameterGroup: group 'g1': the ranks built different groups",
                  "rank 1 has 'b.renamed'"});
  }
  {
    auto specs = model_specs();
    if (odd) specs[2][1].shape = {4, 9};
    expect_error([&] { make_model(37, specs); },
                 {"the ranks built different groups", "rank 1 has", "[4, 9]"});
  }
  // Missing parameter.
  {
    Model model = make_model(38);
    auto params = sharded_matrices(model);
    if (odd) params.pop_back();
    expect_error([&] { FsdpMuon(params, MuonOptions()); },
                 {"the ranks constructed different optimizers",
                  "parameter group 0 parameters: rank 0 has 8, rank 1 has 7"});
  }
}

// Every option that changes the math (and every distribution setting) differing on one rank,
// down to one ulp of a double, is refused at construction on every rank, naming the option.
// An invalid option on one rank only, with the rate calibration on (the default): every rank
// fails naming the option, before any of the calibration's exchanges (issue 32, item 5).
FSDP_MUON_WORLD_TEST(FsdpMuonErrors, AnInvalidOptionOnOneRankIsNamedOnEveryRank) {
  if (world().size() == 1) GTEST_SKIP() << "needs two ranks";
  const bool odd = world().rank() == world().size() - 1;
  Model model = make_model(71);
  const std::vector<std::pair<std::function<void(MuonOptions&)>, std::string>> cases = {
      {[](MuonOptions& o) { o.newton_schulz().steps(0); }, "invalid newton_schulz().steps() 0"},
      {[](MuonOptions& o) { o.newton_schulz().eps(0.0); }, "invalid newton_schulz().eps() 0"},
      {[](MuonOptions& o) { o.newton_schulz().method(NsMethod::kGram).gram_restarts({9}); },
       "gram_restarts"},
  };
  for (const auto& [change, needle] : cases) {
    MuonOptions options =
        MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
    if (odd) change(options);
    // The rank with the bad option reports its own error; the others name that rank.
    const std::string others = "fsdp_muon::FsdpMuon failed on rank " +
                               std::to_string(world().size() - 1) + " of " +
                               std::to_string(world().size());
    expect_error([&] { FsdpMuon(sharded_matrices(model), options); },
                 odd ? std::vector<std::string>{needle} : std::vector<std::string>{others, needle},
                 needle);
  }
  // The world still works: a valid construction on every rank goes through.
  FsdpMuon ok(sharded_matrices(model),
              MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)));
  EXPECT_EQ(ok.matrices().size(), sharded_matrices(model).size());
}

FSDP_MUON_WORLD_TEST(FsdpMuonErrors, OptionsDifferAcrossRanks) {
  if (world().size() == 1) GTEST_SKIP() << "needs two ranks";
  const int odd = world().size() - 1;  // the rank that differs
  const bool here = world().rank() == odd;
  const std::string r = "rank " + std::to_string(odd) + " has ";
  struct OptionCase {
    std::string needle;  // after "first difference, "
    std::function<void(MuonOptions&)> change;
  };
  const std::vector<OptionCase> option_cases = {
      {"parameter group 0 lr: rank 0 has 0x1.47ae147ae147bp-6 (0.02), " + r +
           "0x1.47ae147ae147cp-6 (0.02)",
       [](MuonOptions& o) { o.lr(std::nextafter(0.02, 1.0)); }},
      {"parameter group 0 momentum: rank 0 has 0x1.e666666666666p-1 (0.95), " + r +
           "0x1.ccccccccccccdp-1 (0.9)",
       [](MuonOptions& o) { o.momentum(0.9); }},
      {"parameter group 0 nesterov: rank 0 has true, " + r + "false",
       [](MuonOptions& o) { o.nesterov(false); }},
      {"parameter group 0 weight_decay: rank 0 has 0x0p+0 (0), " + r + "0x1.999999999999ap-4 (0.1)",
       [](MuonOptions& o) { o.weight_decay(0.1); }},
      {"parameter group 0 weight_decay_method: rank 0 has decoupled, " + r + "l2",
       [](MuonOptions& o) { o.weight_decay_method(WeightDecayMethod::kL2); }},
      {"parameter group 0 newton_schulz.steps: rank 0 has 5, " + r + "6",
       [](MuonOptions& o) { o.newton_schulz().steps(6); }},
      {"parameter group 0 newton_schulz.coefficients: rank 0 has quintic, " + r + "polar_express",
       [](MuonOptions& o) { o.newton_schulz().coefficients(NsCoefficients::kPolarExpress); }},
      {"parameter group 0 newton_schulz.custom_coefficients: rank 0 has {}, " + r +
           "{(0x1p+1, -0x1p+0, 0x0p+0)}",
       [](MuonOptions& o) {
         o.newton_schulz().custom_coefficients({{2.0, -1.0, 0.0}});
       }},
      {"parameter group 0 scale_mode: rank 0 has shape_scaling, " + r + "spectral",
       [](MuonOptions& o) { o.scale_mode(ScaleMode::kSpectral); }},
      {"parameter group 0 extra_scale_factor: rank 0 has 0x1p+0 (1), " + r + "0x1p-1 (0.5)",
       [](MuonOptions& o) { o.extra_scale_factor(0.5); }},
      {"parameter group 0 newton_schulz.eps: rank 0 has 0x1.ad7f29abcaf48p-24 (1e-07), " + r +
           "0x1.0c6f7a0b5ed8dp-20 (1e-06)",
       [](MuonOptions& o) { o.newton_schulz().eps(1e-6); }},
      {"parameter group 0 newton_schulz.compute_dtype: rank 0 has BFloat16, " + r + "Float",
       [](MuonOptions& o) { o.newton_schulz().compute_dtype(at::kFloat); }},
      {"parameter group 0 skip_non_matrix: rank 0 has false, " + r + "true",
       [](MuonOptions& o) { o.skip_non_matrix(true); }},
      {"parameter group 0 newton_schulz.method: rank 0 has standard, " + r + "gram",
       [](MuonOptions& o) { o.newton_schulz().method(NsMethod::kGram); }},
      {"parameter group 0 newton_schulz.gram_restarts: rank 0 has {2}, " + r + "{1, 3}",
       [](MuonOptions& o) {
         o.newton_schulz().gram_restarts({1, 3});
       }},
      {"parameter group 0 newton_schulz.preconditioning: rank 0 has none, " + r + "aol",
       [](MuonOptions& o) { o.newton_schulz().preconditioning(NsPreconditioning::kAol); }},
      {"parameter group 0 normalization: rank 0 has none, " + r + "normuon",
       [](MuonOptions& o) { o.normalization(Normalization::kNorMuon); }},
      {"parameter group 0 normuon_beta2: rank 0 has 0x1.e666666666666p-1 (0.95), " + r +
           "0x1.ccccccccccccdp-1 (0.9)",
       [](MuonOptions& o) { o.normuon_beta2(0.9); }},
      {"parameter group 0 normuon_eps: rank 0 has 0x1.5798ee2308c3ap-27 (1e-08), " + r +
           "0x1.0c6f7a0b5ed8dp-20 (1e-06)",
       [](MuonOptions& o) { o.normuon_eps(1e-6); }},
  };
  Model model = make_model(42);
  const auto params = sharded_matrices(model);
  for (const OptionCase& c : option_cases) {
    MuonOptions options;
    if (here) c.change(options);
    expect_error([&] { FsdpMuon(params, options); },
                 {"fsdp_muon::FsdpMuon: the ranks constructed different optimizers (rank(s) " +
                      std::to_string(odd) + " differ from rank 0",
                  "first difference, " + c.needle + ". Every rank must construct"},
                 c.needle);
  }
  // The second of two parameter groups.
  {
    MuonOptions options;
    auto groups = split_groups(params, options);
    if (here) static_cast<MuonOptions&>(groups[1].options()).lr(0.5);
    expect_error(
        [&] { FsdpMuon(groups, options); },
        {"first difference, parameter group 1 lr: rank 0 has 0x1.47ae147ae147bp-7 (0.01), " + r +
         "0x1p-1 (0.5)"});
  }
  // A distribution setting.
  {
    FsdpMuonConfig config;
    if (here) config.batch_newton_schulz(NewtonSchulzBatching::kNever);
    expect_error([&] { FsdpMuon(params, MuonOptions(), config); },
                 {"first difference, batch_newton_schulz: rank 0 has auto, " + r + "never"});
  }
  // The HSDP settings (issue 21): the ranks must plan alike even on a 1-D mesh.
  {
    FsdpMuonConfig config;
    if (here) config.planner().replica_newton_schulz(ReplicaNewtonSchulz::kOncePerWorld);
    expect_error([&] { FsdpMuon(params, MuonOptions(), config); },
                 {"first difference, planner.replica_newton_schulz: rank 0 has by_cost, " + r +
                  "once_per_world"});
  }
  {
    // Given rates (given on every rank or on none: see GivenRatesArePlannedWithExactly).
    FsdpMuonConfig config = FsdpMuonConfig().rates(CostRates());
    if (here) config.rates()->inter_node_bytes_per_second(5e10);
    expect_error([&] { FsdpMuon(params, MuonOptions(), config); },
                 {"first difference, rates.inter_node_bytes_per_second: rank 0 has "
                  "0x1.74876e8p+34 "
                  "(2.5e+10), " +
                  r + "0x1.74876e8p+35 (5e+10)"});
  }
  // Alike everywhere, any of them is fine.
  FsdpMuon alike(params, MuonOptions(std::nextafter(0.02, 1.0))
                             .newton_schulz(NewtonSchulzOptions().method(NsMethod::kGram)));
}

// Options changed after construction (a scheduler stepped on one rank only, an edit on one rank)
// make the next step an error on every rank, naming the option and both values, before anything
// changes; stepped alike again, training goes on.
FSDP_MUON_WORLD_TEST(FsdpMuonErrors, OptionsChangedOnOneRankFailTheStep) {
  if (world().size() == 1) GTEST_SKIP() << "needs two ranks";
  const int odd = world().size() - 1;
  const bool here = world().rank() == odd;
  Model model = make_model(43);
  FsdpMuon fsdp(split_groups(sharded_matrices(model), MuonOptions(0.02)), MuonOptions(0.02));
  // LibTorch's StepLR changes nothing on its first step(), then halves the lrs at every one.
  torch::optim::StepLR schedule(fsdp, /*step_size=*/1, /*gamma=*/0.5);
  feed_gradients(model, 4300);
  fsdp.step();
  schedule.step();
  const auto shards = [&] {
    std::vector<at::Tensor> out;
    for (const auto& group : model.groups) out.push_back(group->main_weight_shard().clone());
    return out;
  };
  const auto unchanged = [&](const std::vector<at::Tensor>& before) {
    const auto now = shards();
    for (size_t g = 0; g < now.size(); ++g) EXPECT_TRUE(at::equal(now[g], before[g])) << g;
  };
  const std::vector<at::Tensor> before = shards();
  auto& group0 = static_cast<MuonOptions&>(fsdp.param_groups()[0].options());
  auto& group1 = static_cast<MuonOptions&>(fsdp.param_groups()[1].options());
  if (here) schedule.step();  // lr 0.02 -> 0.01 and 0.01 -> 0.005 on one rank
  feed_gradients(model, 4301);
  const std::string mine_lr0 = here ? "0x1.47ae147ae147bp-7 (0.01)" : "0x1.47ae147ae147bp-6 (0.02)";
  const std::string mine_lr1 =
      here ? "0x1.47ae147ae147bp-8 (0.005)" : "0x1.47ae147ae147bp-7 (0.01)";
  expect_error([&] { fsdp.step(); },
               {"fsdp_muon::FsdpMuon: the optimizer options differ across ranks at step() call 2: "
                "lr of parameter group 0 (rank 0 has 0x1.47ae147ae147bp-6 (0.02), this rank has " +
                    mine_lr0 +
                    "); lr of parameter group 1 (rank 0 has 0x1.47ae147ae147bp-7 (0.01), this "
                    "rank has " +
                    mine_lr1 + ")",
                "step every scheduler on every rank", "Nothing was changed"});
  unchanged(before);
  // The others catch up: alike again, the step runs.
  if (!here) schedule.step();
  fsdp.step();
  EXPECT_EQ(fsdp.last_step_stats().active_parameters, 8);
  const std::vector<at::Tensor> later = shards();
  // Momentum and weight decay, one rank.
  if (here) group0.momentum(0.9);
  if (here) group1.weight_decay(0.25);
  feed_gradients(model, 4302);
  expect_error([&] { fsdp.step(); },
               {"momentum of parameter group 0 (rank 0 has 0x1.e666666666666p-1 (0.95), this rank "
                "has " +
                std::string(here ? "0x1.ccccccccccccdp-1 (0.9)" : "0x1.e666666666666p-1 (0.95)") +
                "); weight_decay of parameter group 1 (rank 0 has 0x0p+0 (0), this rank has " +
                (here ? "0x1p-2 (0.25)" : "0x0p+0 (0)") + ")"});
  unchanged(later);
  if (here) group0.momentum(0.95);
  if (here) group1.weight_decay(0.0);
  // Any other option, e.g. the Newton-Schulz dtype of the second group.
  if (here) group1.newton_schulz().compute_dtype(at::kFloat);
  expect_error([&] { fsdp.step(); },
               {"another option of parameter group 1 (not lr, momentum or weight_decay; this "
                "rank's options " +
                std::string(here ? "differ from" : "equal") + " rank 0's)"});
  unchanged(later);
  if (here) group1.newton_schulz().compute_dtype(at::kBFloat16);
  fsdp.step();
}

FSDP_MUON_WORLD_TEST(FsdpMuonErrors, RanksDisagreeOnGradients) {
  if (world().size() == 1) GTEST_SKIP() << "needs two ranks";
  Model model = make_model(39);
  FsdpMuon fsdp(sharded_matrices(model),
                MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)));
  feed_gradients(model, 3900);
  std::vector<at::Tensor> before;
  for (const auto& group : model.groups) before.push_back(group->main_weight_shard().clone());
  if (world().rank() == world().size() - 1) {
    model.groups[1]->sharded_parameter(2).mutable_grad() = at::Tensor();  // b.big
  }
  expect_error([&] { fsdp.step(); }, {"ranks disagree on which parameters have gradients",
                                      "'b.big' on " + std::to_string(world().size() - 1) + " of " +
                                          std::to_string(world().size())});
  // Nothing was changed by the failed step.
  for (size_t g = 0; g < model.groups.size(); ++g) {
    EXPECT_TRUE(at::equal(model.groups[g]->main_weight_shard(), before[g]));
  }
  EXPECT_TRUE(fsdp.state().empty());
  // Agreeing again, the optimizer works.
  feed_gradients(model, 3901);
  fsdp.step();
  EXPECT_EQ(fsdp.last_step_stats().active_parameters, 8);
}

FSDP_MUON_WORLD_TEST(FsdpMuonErrors, AddParamGroupAfterConstruction) {
  Model model = make_model(40);
  auto params = sharded_matrices(model);
  const at::Tensor extra = params.back();
  params.pop_back();
  FsdpMuon fsdp(params, MuonOptions());
  expect_error([&] { fsdp.add_param_group(torch::optim::OptimizerParamGroup({extra})); },
               {"add_param_group after construction is not supported"});
  // Through the base class (not virtual) on rank 0 only: every rank's next step fails.
  if (world().rank() == 0) {
    static_cast<torch::optim::Optimizer&>(fsdp).add_param_group(
        torch::optim::OptimizerParamGroup({extra}, std::make_unique<MuonOptions>()));
  }
  feed_gradients(model, 4000);
  expect_error([&] { fsdp.step(); }, {"parameter groups were changed after construction on 1 of " +
                                      std::to_string(world().size())});
}

// A backward through every group's module parameters (a loss whose gradients every rank gets
// alike), without reduce-scattering them.
void backward_through(const Model& model) {
  at::Tensor loss = at::zeros({});
  for (const auto& group : model.groups) {
    for (const at::Tensor& p : group->model_parameters()) loss = loss + (p * p).sum();
  }
  loss.backward();
}

// ZeRO-1 (the default strategy) keeps a backward's gradients in the group until
// reduce_scatter_grads(); a step before it would train on stale gradient shards. It is an error on
// every rank naming the fix; micro-batches (several backwards, one reduce-scatter) and zero_grad()
// are fine.
FSDP_MUON_WORLD_TEST(FsdpMuonErrors, ZeroOneStepWithoutReduceScatterIsAnError) {
  Model model = make_model(41);
  for (const auto& group : model.groups) {
    ASSERT_EQ(group->sharding_strategy(), ShardingStrategy::kOptim);
  }
  FsdpMuon fsdp(sharded_matrices(model),
                MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)));
  const auto shards = [&] {
    std::vector<at::Tensor> out;
    for (const auto& group : model.groups) out.push_back(group->main_weight_shard().clone());
    return out;
  };
  const auto expect_shards = [&](const std::vector<at::Tensor>& expected, bool equal) {
    const auto now = shards();
    for (size_t g = 0; g < now.size(); ++g) {
      if (now[g].numel() > 0) {
        EXPECT_EQ(at::equal(now[g], expected[g]), equal) << g;
      }
    }
  };
  const std::string w = std::to_string(world().size());
  // Forgotten everywhere: every rank refuses, nothing changes.
  for (const auto& group : model.groups) group->zero_grad();
  backward_through(model);
  for (const auto& group : model.groups) EXPECT_TRUE(group->has_unreduced_gradients());
  const std::vector<at::Tensor> start = shards();
  expect_error([&] { fsdp.step(); },
               {"fsdp_muon::FsdpMuon: a backward wrote gradients that were never reduce-scattered",
                "'g0' on " + w + " of " + w + " rank(s), 'g1' on " + w + " of " + w +
                    " rank(s), 'g2' on " + w + " of " + w + " rank(s)",
                "call group->reduce_scatter_grads() after backward"});
  expect_shards(start, true);
  EXPECT_TRUE(fsdp.state().empty());
  // Forgotten for one group: only that one is named.
  model.groups[0]->reduce_scatter_grads();
  model.groups[1]->reduce_scatter_grads();
  EXPECT_FALSE(model.groups[0]->has_unreduced_gradients());
  expect_error([&] { fsdp.step(); },
               {"never reduce-scattered into the gradient shards of FSDP group(s) 'g2' on " + w +
                " of " + w + " rank(s) (sharding"});
  expect_shards(start, true);
  // Done: the step runs.
  model.groups[2]->reduce_scatter_grads();
  fsdp.step();
  EXPECT_EQ(fsdp.last_step_stats().active_parameters, 8);
  const std::vector<at::Tensor> after_one = shards();
  expect_shards(start, false);
  // Two micro-batches, one reduce-scatter: legal.
  for (const auto& group : model.groups) group->zero_grad();
  backward_through(model);
  backward_through(model);
  for (const auto& group : model.groups) group->reduce_scatter_grads();
  fsdp.step();
  expect_shards(after_one, false);
  // zero_grad() after a backward drops its gradients: nothing is left unreduced.
  backward_through(model);
  for (const auto& group : model.groups) {
    group->zero_grad();
    EXPECT_FALSE(group->has_unreduced_gradients());
  }
  fsdp.step();
}

// One rank skips a ZeRO-1 group's reduce_scatter_grads() (issue 32, item 7): it meets the
// others' reduce-scatter with the step's agreement and both wait out the timeout, which no
// message can shorten (the skipping rank sends nothing the others could read). Before, every rank
// then saw a bare communicator error; now the skipping rank names its unreduced group, the others
// the call every rank must make. Its own CTest entry, with a 3 s timeout.
FSDP_MUON_WORLD_TEST(FsdpMuonErrors, OneRankSkippingZeroOneReduceScatterIsNamed) {
  if (world().size() < 3 || testing::timeout_seconds() > 10) {
    GTEST_SKIP() << "runs at W >= 3 with FSDP_MUON_TEST_TIMEOUT_SECONDS <= 10 (its own CTest "
                    "entry): a rank misses a collective on purpose";
  }
  Model model = make_model(42);
  FsdpMuon fsdp(sharded_matrices(model),
                MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)),
                FsdpMuonConfig().rates(CostRates()));
  const bool skips = world().rank() == 1;
  backward_through(model);
  model.groups[0]->reduce_scatter_grads();
  model.groups[1]->reduce_scatter_grads();
  expect_error(
      [&] {
        if (!skips) model.groups[2]->reduce_scatter_grads();
        fsdp.step();
      },
      skips ? std::vector<std::string>{"fsdp_muon::Communicator::all_reduce",
                                       "this rank holds gradients of FSDP group(s) 'g2' that were "
                                       "never reduce-scattered",
                                       "this rank missed the call"}
            : std::vector<std::string>{"fsdp_muon::Communicator::reduce_scatter",
                                       "group 'g2': reduce_scatter_grads(), sharding "
                                       "strategy optim: every rank must call it for every group"});
}

// A NaN in one rank's piece of one gradient: under each NonFiniteGradients mode every rank
// reaches the same outcome (the check rides on the agreement all-reduce).
FSDP_MUON_WORLD_TEST(FsdpMuonNonFinite, EveryModeAgreesOnEveryRank) {
  const int w = world().size();
  const int me = world().rank();
  for (const NonFiniteGradients mode :
       {NonFiniteGradients::kIgnore, NonFiniteGradients::kSkipStep, NonFiniteGradients::kThrow}) {
    SCOPED_TRACE(to_string(mode));
    Model model = make_model(50);
    const std::shared_ptr<FsdpParameterGroup>& group = model.groups[0];
    const size_t index = 0;  // 'a.w1', 5 x 7
    int holder = -1;         // the last rank that holds part of it
    for (int r = 0; r < w; ++r) {
      if (group->held_range(index, r).second > group->held_range(index, r).first) holder = r;
    }
    FsdpMuon fsdp(sharded_matrices(model), MuonOptions(),
                  FsdpMuonConfig().non_finite_gradients(mode));
    feed_gradients(model, 5000);
    const at::Tensor& poisoned = group->sharded_parameter(index);
    if (me == holder) poisoned.grad()[0] = std::numeric_limits<float>::quiet_NaN();
    std::vector<at::Tensor> before;
    for (const at::Tensor& p : sharded_matrices(model)) before.push_back(p.detach().clone());
    const auto unchanged = [&] {
      const auto now = sharded_matrices(model);
      for (size_t k = 0; k < now.size(); ++k) EXPECT_TRUE(at::equal(now[k], before[k])) << k;
    };
    if (mode == NonFiniteGradients::kThrow) {
      expect_error([&] { fsdp.step(); },
                   {"non-finite gradients (NaN or Inf) in 1 parameter(s): 'a.w1' on 1 of " +
                    std::to_string(w) + " rank(s)"});
      unchanged();
      continue;
    }
    fsdp.step();
    if (mode == NonFiniteGradients::kSkipStep) {
      EXPECT_TRUE(fsdp.last_step_stats().skipped);
      EXPECT_EQ(fsdp.last_step_stats().non_finite_parameters, 1);
      EXPECT_EQ(fsdp.skipped_steps(), 1);
      unchanged();
      feed_gradients(model, 5001);  // finite again: the next step runs
      fsdp.step();
      EXPECT_FALSE(fsdp.last_step_stats().skipped);
      EXPECT_EQ(fsdp.skipped_steps(), 1);
      if (poisoned.numel() > 0) {
        EXPECT_FALSE(at::equal(poisoned, before[0]));
      }
    } else {
      EXPECT_EQ(fsdp.last_step_stats().non_finite_parameters, 0);  // not checked
      EXPECT_TRUE(poisoned.numel() == 0 || at::isnan(poisoned).all().item<bool>());
    }
  }
}

// The check reads a group's gradient shard once (docs/DESIGN.md §4, "Kernels per step"), so it
// must still tell the group's matrices from its other parameters, and still check a matrix whose
// .grad() is not a view of the shard. A NaN in a bias FsdpMuon does not hold: the step runs, with
// the bits of a step without it. A NaN in a matrix's gradient that is a tensor of its own, on one
// rank: the step is skipped on every rank, naming it.
FSDP_MUON_WORLD_TEST(FsdpMuonNonFinite, TheShardCheckTellsMatricesFromTheRest) {
  const int w = world().size();
  const int me = world().rank();
  const auto last_holder = [&](const FsdpParameterGroup& group, size_t index) {
    int holder = -1;
    for (int r = 0; r < w; ++r) {
      if (group.held_range(index, r).second > group.held_range(index, r).first) holder = r;
    }
    return holder;
  };
  Model poisoned = make_model(52);
  Model clean = make_model(52);
  FsdpMuon with_nan(sharded_matrices(poisoned),
                    MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)));
  FsdpMuon without(sharded_matrices(clean),
                   MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)));
  feed_gradients(poisoned, 5200);
  feed_gradients(clean, 5200);
  const FsdpParameterGroup& g0 = *poisoned.groups[0];  // 'a.b1' (index 1) is a bias
  if (me == last_holder(g0, 1)) {
    g0.sharded_parameter(1).grad()[0] = std::numeric_limits<float>::quiet_NaN();
  }
  with_nan.step();
  without.step();
  EXPECT_FALSE(with_nan.last_step_stats().skipped);
  EXPECT_EQ(with_nan.last_step_stats().non_finite_parameters, 0);
  const auto a = sharded_matrices(poisoned);
  const auto b = sharded_matrices(clean);
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(at::equal(a[k], b[k])) << k;

  // 'c.w' (group 2, index 1): a gradient of its own on every rank, NaN on its last holder.
  feed_gradients(poisoned, 5201);
  const at::Tensor& cw = poisoned.groups[2]->sharded_parameter(1);
  cw.mutable_grad() = cw.grad().clone();
  if (me == last_holder(*poisoned.groups[2], 1)) {
    cw.grad()[0] = std::numeric_limits<float>::quiet_NaN();
  }
  std::vector<at::Tensor> before;
  for (const at::Tensor& p : a) before.push_back(p.detach().clone());
  with_nan.step();
  EXPECT_TRUE(with_nan.last_step_stats().skipped);
  EXPECT_EQ(with_nan.last_step_stats().non_finite_parameters, 1);
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(at::equal(a[k], before[k])) << k;
}

// The default (kSkipStep): a NaN on one rank skips the step on every rank, leaving weights and
// momentum bit for bit as they were, and rank 0 alone warns once, naming the step and the
// parameter; the next finite step runs and warns nothing.
FSDP_MUON_WORLD_TEST(FsdpMuonNonFinite, DefaultSkipsTheStepAndWarnsOnRankZero) {
  EXPECT_EQ(FsdpMuonConfig().non_finite_gradients(), NonFiniteGradients::kSkipStep);
  const int w = world().size();
  const int me = world().rank();
  Model model = make_model(51);
  const std::shared_ptr<FsdpParameterGroup>& group = model.groups[1];
  const size_t index = 2;  // 'b.big', 17 x 6
  int holder = -1;         // the last rank that holds part of it
  for (int r = 0; r < w; ++r) {
    if (group->held_range(index, r).second > group->held_range(index, r).first) holder = r;
  }
  FsdpMuon fsdp(sharded_matrices(model),
                MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat)));
  test::WarningCollector warnings;
  feed_gradients(model, 5100);
  fsdp.step();  // step 1: finite, creates the momentum
  const auto snapshot = [&] {
    std::vector<at::Tensor> out;
    for (const FsdpMuonMatrix& m : fsdp.matrices()) {
      out.push_back(m.sharded_parameter.detach().clone());
      const auto& state = static_cast<const MuonParamState&>(
          *fsdp.state().at(m.sharded_parameter.unsafeGetTensorImpl()));
      out.push_back(state.momentum_buffer().clone());
      out.push_back(at::tensor(state.step()));
    }
    for (const auto& g : model.groups) out.push_back(g->model_weights().clone());
    return out;
  };
  const std::vector<at::Tensor> before = snapshot();
  feed_gradients(model, 5101);
  if (me == holder)
    group->sharded_parameter(index).grad()[0] = std::numeric_limits<float>::infinity();
  fsdp.step();  // step 2: skipped everywhere
  EXPECT_TRUE(fsdp.last_step_stats().skipped);
  EXPECT_EQ(fsdp.last_step_stats().non_finite_parameters, 1);
  EXPECT_EQ(fsdp.skipped_steps(), 1);
  const std::vector<at::Tensor> after = snapshot();
  ASSERT_EQ(after.size(), before.size());
  for (size_t k = 0; k < after.size(); ++k) EXPECT_TRUE(at::equal(after[k], before[k])) << k;
  if (me == 0) {
    ASSERT_EQ(warnings.messages.size(), 1u);
    const std::string& line = warnings.messages[0];
    for (const std::string& needle :
         {std::string("fsdp_muon::FsdpMuon: skipped step 2 "), std::string("1 skipped so far"),
          "NaN or Inf in the gradient of 'b.big' on 1 of " + std::to_string(w) + " rank(s)",
          std::string("weights and momentum are unchanged")}) {
      EXPECT_NE(line.find(needle), std::string::npos) << "'" << needle << "' not in: " << line;
    }
    EXPECT_EQ(line.find('\n'), std::string::npos) << "not one line: " << line;
  } else {
    EXPECT_TRUE(warnings.messages.empty()) << "rank " << me << " warned: " << warnings.messages[0];
  }
  feed_gradients(model, 5102);
  fsdp.step();  // step 3: finite again, runs, warns nothing
  EXPECT_FALSE(fsdp.last_step_stats().skipped);
  EXPECT_EQ(fsdp.skipped_steps(), 1);
  EXPECT_EQ(warnings.messages.size(), me == 0 ? 1u : 0u);
  const at::Tensor& first = fsdp.matrices()[0].sharded_parameter;
  if (first.numel() > 0) {
    EXPECT_FALSE(at::equal(first, before[0]));
  }
}

// Without the agreement all-reduce (for loops that guarantee agreement) the step gives the same
// bits and sends nothing for the check; the non-finite check, which needs it, is refused.
FSDP_MUON_WORLD_TEST(FsdpMuonAgreement, OffGivesTheSameBitsWithoutTheCheck) {
  const MuonOptions options =
      MuonOptions(0.02).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
  Model checked = make_model(90);
  Model unchecked = make_model(90);
  FsdpMuon with(sharded_matrices(checked), options);
  FsdpMuon without(sharded_matrices(unchecked), options,
                   FsdpMuonConfig().check_gradient_agreement(false).non_finite_gradients(
                       NonFiniteGradients::kIgnore));
  for (int step = 0; step < 3; ++step) {
    feed_gradients(checked, 9000 + step);
    feed_gradients(unchecked, 9000 + step);
    with.step();
    without.step();
    EXPECT_EQ(without.last_step_stats().check_bytes, 0);
    EXPECT_EQ(without.last_step_stats().active_parameters,
              with.last_step_stats().active_parameters);
  }
  if (world().size() > 1) {
    EXPECT_GT(with.last_step_stats().check_bytes, 0);
  }
  const auto a = sharded_matrices(checked);
  const auto b = sharded_matrices(unchecked);
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(at::equal(a[k], b[k])) << k;
  expect_error(
      [&] {
        FsdpMuon(sharded_matrices(checked), options,
                 FsdpMuonConfig().check_gradient_agreement(false).non_finite_gradients(
                     NonFiniteGradients::kSkipStep));
      },
      {"non_finite_gradients(skip_step) needs check_gradient_agreement(true)"});
  // The default is kSkipStep, so turning the agreement off alone names the fix.
  expect_error(
      [&] {
        FsdpMuon(sharded_matrices(checked), options,
                 FsdpMuonConfig().check_gradient_agreement(false));
      },
      {"non_finite_gradients(skip_step) needs check_gradient_agreement(true)",
       "non_finite_gradients(NonFiniteGradients::kIgnore)"});
}

}  // namespace
}  // namespace fsdp_muon
