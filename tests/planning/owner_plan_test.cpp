// Owner planner against hand-computed cases (docs/DESIGN.md §3, §7), and plan statistics on real
// model shapes (Llama-3-8B) against the numbers the design quotes.

#include <fsdp_muon/optimizer/fsdp_muon.h>
#include <fsdp_muon/planning/owner_plan.h>

#include <algorithm>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "planning/owner_plan_internal.h"

namespace fsdp_muon {
namespace {

// A matrix held by the ranks in `pieces` (rank -> number of elements, in rank order).
PlanMatrix matrix(const std::string& name, int64_t rows, int64_t cols, int world_size,
                  const std::vector<std::pair<int, int64_t>>& pieces) {
  PlanMatrix m;
  m.name = name;
  m.rows = rows;
  m.cols = cols;
  m.held.assign(world_size, {0, 0});
  int64_t cursor = 0;
  for (const auto& [rank, count] : pieces) {
    m.held[rank] = {cursor, cursor + count};
    cursor += count;
  }
  // Ranks after the last piece hold an empty range at the end, like the flat layout gives.
  for (int r = 0; r < world_size; ++r) {
    if (m.held[r].first == m.held[r].second) m.held[r] = {cursor, cursor};
  }
  return m;
}

// Holders-only owners, one round over all groups (no budget), one exchange in flight: the plan
// the examples below work out by hand. Under kBalanced a fixed byte limit of 1.5x (not the
// default cost model), so that the hand cases do not depend on the rates.
OwnerPlanOptions holders_only() {
  return OwnerPlanOptions()
      .owner_policy(OwnerPolicy::kHoldersOnly)
      .max_bytes_ratio(1.5)
      .prefetch_budget_bytes(kUnlimitedPrefetch)
      .overlap_communication(false);
}

// The schedule in windows of groups (OwnerSchedule::kWindows), each exchange alone in flight.
OwnerPlanOptions windows() { return holders_only().owner_schedule(OwnerSchedule::kWindows); }

// docs/DESIGN.md §7: the planner counts what runs on each matrix. For an m × km matrix (either
// orientation), by hand from the iterations (docs/DESIGN.md §4):
//   standard, 5 steps: per step A = X·Xᵀ (2k·m³), A·A (2m³), B·X (2k·m³): 5·(4k + 2)·m³;
//   Gram, 5 steps, restart before step 2: R = X·Xᵀ (2k·m³), then per step Z = b·R + c·R²
//     (2m³), Q ← Q·Z + a·Q (2m³, not on the step after a (re)start), R ← (Z + aI)·R·(Z + aI)
//     (4m³, not before a restart nor after the last step), the restart X ← Q·X, R ← X·Xᵀ
//     (4k·m³) and the final Q·X (2k·m³): (5·8 − 2·2 − 2·4)·m³ + 8k·m³ = (28 + 8k)·m³;
//   restarts before steps 1 and 3: (5·8 − 3·2 − 3·4)·m³ + 12k·m³ = (22 + 12k)·m³;
//   AOL reuses its X·Xᵀ as the first step's A (standard) or as R_0 (Gram): no extra GEMM.
TEST(OwnerPlanTest, PlanMatrixFlopsCountWhatRuns) {
  const int64_t m = 64;
  const int64_t m3 = m * m * m;
  const auto flops = [](int64_t rows, int64_t cols, const NewtonSchulzOptions& ns) {
    PlanMatrix pm;
    pm.rows = rows;
    pm.cols = cols;
    pm.newton_schulz = ns;
    return plan_matrix_flops(pm);
  };
  const NewtonSchulzOptions standard;
  const NewtonSchulzOptions gram = NewtonSchulzOptions().method(NsMethod::kGram);
  const NewtonSchulzOptions auto_ = NewtonSchulzOptions().method(NsMethod::kAuto);
  for (const int64_t k : {1, 2, 4}) {
    SCOPED_TRACE("k = " + std::to_string(k));
    EXPECT_EQ(flops(m, k * m, standard), 5 * (4 * k + 2) * m3);
    EXPECT_EQ(flops(k * m, m, standard), 5 * (4 * k + 2) * m3);
    EXPECT_EQ(flops(m, k * m, standard), newton_schulz_flops(m, k * m, 5));
    EXPECT_EQ(flops(m, k * m, gram), (28 + 8 * k) * m3);
    EXPECT_EQ(flops(k * m, m, gram), (28 + 8 * k) * m3);
    EXPECT_EQ(flops(m, k * m, NewtonSchulzOptions(gram).gram_restarts({1, 3})), (22 + 12 * k) * m3);
    EXPECT_EQ(flops(m, k * m, NewtonSchulzOptions().preconditioning(NsPreconditioning::kAol)),
              5 * (4 * k + 2) * m3);
    EXPECT_EQ(flops(m, k * m, NewtonSchulzOptions(gram).preconditioning(NsPreconditioning::kAol)),
              (28 + 8 * k) * m3);
    // One step fewer with AOL (Turbo-Muon's 4-step schedule): 4 standard steps, or Gram with 4
    // steps: (4·8 − 2·2 − 2·4)·m³ + 8k·m³.
    const NewtonSchulzOptions turbo = NewtonSchulzOptions()
                                          .preconditioning(NsPreconditioning::kAol)
                                          .custom_coefficients({{4.6051, -9.6552, 5.6769},
                                                                {4.7505, -6.0861, 2.1790},
                                                                {2.7763, -2.3190, 0.5523},
                                                                {2.4231, -2.2861, 0.8193}})
                                          .steps(4);
    EXPECT_EQ(flops(m, k * m, turbo), 4 * (4 * k + 2) * m3);
    EXPECT_EQ(flops(m, k * m, NewtonSchulzOptions(turbo).method(NsMethod::kGram)),
              (20 + 8 * k) * m3);
  }
  // kAuto takes the cheaper per shape, with the function newton_schulz() decides by: standard
  // for a square (30 < 36), Gram from aspect 2 (44 < 50); at aspect 1.5 both count 40·m³ and a
  // tie stays standard.
  EXPECT_EQ(flops(m, m, auto_), 30 * m3);
  EXPECT_EQ(flops(m, 2 * m, auto_), 44 * m3);
  EXPECT_EQ(flops(4 * m, m, auto_), 60 * m3);
  EXPECT_EQ(resolve_ns_method(m, 3 * m / 2, auto_), NsMethod::kStandard);
  EXPECT_EQ(flops(m, 3 * m / 2, auto_), 40 * m3);
  EXPECT_EQ(flops(m, 3 * m / 2, gram), 40 * m3);
  // The plan's cost is this count.
  PlanMatrix wide = matrix("wide", m, 4 * m, 1, {{0, 4 * m * m}});
  wide.newton_schulz = gram;
  const OwnerPlan plan = plan_owners({{"g", {wide}}}, 1, holders_only());
  EXPECT_EQ(plan.cost[0][0], (28 + 32) * m3);
}

// W = 2, each matrix split evenly: a square A (64×64) and two wide B (32×512, aspect 16). Costed
// as standard quintic, B (330·32³ = 10.8 M) outweighs A (30·64³ = 7.9 M): B1 → rank 0, B2 →
// rank 1, A → rank 0 (tie, lowest rank). With Gram, B (156·32³ = 5.1 M) is cheaper than A (9.4 M
// as Gram, 7.9 M as standard under kAuto): A → rank 0, then both B on rank 1.
TEST(OwnerPlanTest, PlanBalancesByTheMethodThatRuns) {
  const auto model = [](const NewtonSchulzOptions& ns) {
    std::vector<PlanMatrix> matrices = {matrix("A", 64, 64, 2, {{0, 2048}, {1, 2048}}),
                                        matrix("B1", 32, 512, 2, {{0, 8192}, {1, 8192}}),
                                        matrix("B2", 32, 512, 2, {{0, 8192}, {1, 8192}})};
    for (PlanMatrix& pm : matrices) pm.newton_schulz = ns;
    return std::vector<PlanGroup>{{"g", matrices}};
  };
  const OwnerPlan standard = plan_owners(model(NewtonSchulzOptions()), 2, holders_only());
  EXPECT_EQ(standard.cost[0], (std::vector<int64_t>{30 * 262144, 330 * 32768, 330 * 32768}));
  EXPECT_EQ(standard.owner[0], (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(standard.cost_per_rank, (std::vector<int64_t>{30 * 262144 + 330 * 32768, 330 * 32768}));

  const OwnerPlan gram =
      plan_owners(model(NewtonSchulzOptions().method(NsMethod::kGram)), 2, holders_only());
  EXPECT_EQ(gram.cost[0], (std::vector<int64_t>{36 * 262144, 156 * 32768, 156 * 32768}));
  EXPECT_EQ(gram.owner[0], (std::vector<int>{0, 1, 1}));

  const OwnerPlan by_shape =
      plan_owners(model(NewtonSchulzOptions().method(NsMethod::kAuto)), 2, holders_only());
  EXPECT_EQ(by_shape.cost[0], (std::vector<int64_t>{30 * 262144, 156 * 32768, 156 * 32768}));
  EXPECT_EQ(by_shape.owner[0], (std::vector<int>{0, 1, 1}));
  EXPECT_LT(by_shape.critical_path_planned(), standard.critical_path_planned());
}

// NorMuon's per-row state travels with its matrix (docs/DESIGN.md §3): a non-owner sends its
// elements and one value per row that starts in them. A 3 × 4 matrix split 5 / 7 at W = 2: rank
// 0 holds the starts of rows 0 and 1, rank 1 that of row 2 (element 8); rank 0 owns it (equal
// load, lowest rank), so rank 1 sends 7 elements and 1 row and gets as many back.
TEST(OwnerPlanTest, NorMuonRowStateIsCountedInTheBytes) {
  PlanMatrix pm = matrix("m", 3, 4, 2, {{0, 5}, {1, 7}});
  const OwnerPlan plain = plan_owners({{"g", {pm}}}, 2, holders_only());
  pm.per_row_state = true;
  const OwnerPlan normuon = plan_owners({{"g", {pm}}}, 2, holders_only());
  ASSERT_EQ(plain.owner[0][0], 0);
  EXPECT_EQ(normuon.owner[0][0], 0);
  EXPECT_EQ(plain.gather_bytes_per_rank, (std::vector<int64_t>{0, 7 * 4}));
  EXPECT_EQ(normuon.gather_bytes_per_rank, (std::vector<int64_t>{0, (7 + 1) * 4}));
  EXPECT_EQ(normuon.scatter_bytes_per_rank, (std::vector<int64_t>{(7 + 1) * 4, 0}));
  EXPECT_EQ(normuon.cost, plain.cost);  // NorMuon adds no GEMM
}

TEST(OwnerPlanTest, NewtonSchulzFlopsUsesMinAndMaxSide) {
  EXPECT_EQ(newton_schulz_flops(4, 4, 5), 5 * (4 * 4 * 4 * 4 + 2 * 4 * 4 * 4));
  EXPECT_EQ(newton_schulz_flops(2, 8, 5), 720);
  EXPECT_EQ(newton_schulz_flops(8, 2, 5), 720);
  EXPECT_EQ(newton_schulz_flops(8, 2, 1), 144);
  EXPECT_EQ(newton_schulz_flops(1, 7, 3), 3 * (4 * 7 + 2));
}

// W=2, one group: A local on 0, B split 6/10 between 0 and 1, C local on 1.
TEST(OwnerPlanTest, SingleGroupHoldersOnly) {
  PlanGroup g{"block",
              {matrix("A", 4, 4, 2, {{0, 16}}), matrix("B", 2, 8, 2, {{0, 6}, {1, 10}}),
               matrix("C", 8, 2, 2, {{1, 16}})}};
  const OwnerPlan plan = plan_owners({g}, 2, holders_only());
  // Local: r0 = 1920 (A), r1 = 720 (C); B (720) to the less-loaded holder, r1.
  EXPECT_EQ(plan.owner[0], (std::vector<int>{0, 1, 1}));
  EXPECT_EQ(plan.cost[0], (std::vector<int64_t>{1920, 720, 720}));
  EXPECT_EQ(plan.cost_per_rank, (std::vector<int64_t>{1920, 1440}));
  EXPECT_EQ(plan.group_cost_per_rank[0], (std::vector<int64_t>{1920, 1440}));
  EXPECT_DOUBLE_EQ(plan.group_balance[0], 1920.0 / 1680.0);
  // B: rank 0's 6 elements go to rank 1 and come back.
  EXPECT_EQ(plan.gather_bytes_per_rank, (std::vector<int64_t>{24, 0}));
  EXPECT_EQ(plan.scatter_bytes_per_rank, (std::vector<int64_t>{0, 24}));
  EXPECT_EQ(plan.group_full_bytes_per_rank[0], (std::vector<int64_t>{64, 128}));
  EXPECT_EQ(plan.total_cost(), 3360);
  EXPECT_EQ(plan.largest_matrix_cost(), 1920);
  EXPECT_EQ(detail::critical_path_budget0(plan), 1920);
  EXPECT_EQ(detail::critical_path_unlimited(plan), 1920);
}

// W=3, two groups: loads carry across groups and ties go to the lowest rank.
TEST(OwnerPlanTest, AcrossGroupsHoldersOnly) {
  PlanGroup g0{"g0",
               {matrix("M0", 8, 8, 3, {{0, 20}, {1, 44}}),   // 15360
                matrix("M1", 4, 4, 3, {{1, 5}, {2, 11}})}};  // 1920
  PlanGroup g1{"g1",
               {matrix("M2", 8, 8, 3, {{0, 10}, {1, 30}, {2, 24}}),  // 15360
                matrix("M3", 4, 4, 3, {{2, 16}})}};                  // 1920, local
  const OwnerPlan plan = plan_owners({g0, g1}, 3, holders_only());
  // Local M3 -> r2 [0,0,1920]; M0 (g0 first on the cost tie) -> r0 (tie 0/0, lowest);
  // M2 -> r1 (least loaded holder); M1 -> r2 (1920 < 15360).
  EXPECT_EQ(plan.owner[0], (std::vector<int>{0, 2}));
  EXPECT_EQ(plan.owner[1], (std::vector<int>{1, 2}));
  EXPECT_EQ(plan.cost_per_rank, (std::vector<int64_t>{15360, 15360, 3840}));
  EXPECT_EQ(plan.group_cost_per_rank[0], (std::vector<int64_t>{15360, 0, 1920}));
  EXPECT_EQ(plan.group_cost_per_rank[1], (std::vector<int64_t>{0, 15360, 1920}));
  // Budget 0: 15360 + 15360 over the ideal 34560 / 3; unlimited: 15360 / 11520.
  EXPECT_EQ(detail::critical_path_budget0(plan), 30720);
  EXPECT_EQ(detail::critical_path_unlimited(plan), 15360);
  EXPECT_DOUBLE_EQ(detail::critical_path_ratio_budget0(plan), 30720.0 / 11520.0);
  EXPECT_DOUBLE_EQ(detail::critical_path_ratio_unlimited(plan), 15360.0 / 11520.0);
  EXPECT_DOUBLE_EQ(plan.group_balance[0], 15360.0 / (17280.0 / 3));
  // Bytes (fp32): M0 owner 0 <- r1's 44; M1 owner 2 <- r1's 5; M2 owner 1 <- r0's 10, r2's 24.
  EXPECT_EQ(plan.gather_bytes_per_rank, (std::vector<int64_t>{40, 196, 96}));
  EXPECT_EQ(plan.scatter_bytes_per_rank, (std::vector<int64_t>{176, 136, 20}));
}

// W=3: two big local matrices load ranks 0 and 1; the small boundary matrix they share goes to
// rank 0 under holders-only, to idle rank 2 under any-rank (which then moves all of it).
TEST(OwnerPlanTest, AnyRankLetsANonHolderOwn) {
  PlanGroup g{"g",
              {matrix("L0", 8, 8, 3, {{0, 64}}), matrix("L1", 8, 8, 3, {{1, 64}}),
               matrix("B", 4, 4, 3, {{0, 10}, {1, 6}})}};
  const OwnerPlan holders = plan_owners({g}, 3, holders_only());
  EXPECT_EQ(holders.owner[0], (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(holders.cost_per_rank, (std::vector<int64_t>{17280, 15360, 0}));
  EXPECT_EQ(holders.gather_bytes_per_rank, (std::vector<int64_t>{0, 24, 0}));
  EXPECT_EQ(holders.scatter_bytes_per_rank, (std::vector<int64_t>{24, 0, 0}));

  const OwnerPlan any = plan_owners({g}, 3, holders_only().owner_policy(OwnerPolicy::kAnyRank));
  EXPECT_EQ(any.owner[0], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(any.cost_per_rank, (std::vector<int64_t>{15360, 15360, 1920}));
  EXPECT_EQ(any.gather_bytes_per_rank, (std::vector<int64_t>{40, 24, 0}));
  EXPECT_EQ(any.scatter_bytes_per_rank, (std::vector<int64_t>{0, 0, 64}));
  EXPECT_LT(detail::critical_path_unlimited(any), detail::critical_path_unlimited(holders));
  EXPECT_GT(any.max_bytes_per_rank(), holders.max_bytes_per_rank());
}

// Any-rank: among equally loaded ranks the one holding more of the matrix wins, then the lowest.
TEST(OwnerPlanTest, AnyRankTiesPreferTheLargerHolder) {
  PlanGroup g{"g",
              {matrix("B0", 4, 4, 3, {{0, 4}, {1, 12}}), matrix("B1", 4, 4, 3, {{1, 8}, {2, 8}}),
               matrix("B2", 2, 2, 3, {{0, 2}, {2, 2}})}};
  const OwnerPlan any = plan_owners({g}, 3, holders_only().owner_policy(OwnerPolicy::kAnyRank));
  // B0 (1920): all idle, r1 holds most -> r1. B1 (1920): r0, r2 idle, r2 holds 8, r0 none -> r2.
  // B2 (240): r0 is the only idle rank -> r0.
  EXPECT_EQ(any.owner[0], (std::vector<int>{1, 2, 0}));
}

TEST(OwnerPlanTest, EmptyMatricesHaveNoOwnerAndWorldSizeOneOwnsAll) {
  PlanGroup g{"g", {matrix("E", 0, 5, 2, {}), matrix("A", 3, 3, 2, {{0, 4}, {1, 5}})}};
  const OwnerPlan plan = plan_owners({g}, 2, holders_only());
  EXPECT_EQ(plan.owner[0][0], -1);
  EXPECT_EQ(plan.cost[0][0], 0);
  EXPECT_EQ(plan.owner[0][1], 0);

  PlanGroup single{"g", {matrix("A", 3, 3, 1, {{0, 9}}), matrix("B", 5, 2, 1, {{0, 10}})}};
  const OwnerPlan one = plan_owners({single}, 1, holders_only());
  EXPECT_EQ(one.owner[0], (std::vector<int>{0, 0}));
  EXPECT_EQ(one.gather_bytes_per_rank[0] + one.scatter_bytes_per_rank[0], 0);
  EXPECT_DOUBLE_EQ(detail::critical_path_ratio_unlimited(one), 1.0);
}

TEST(OwnerPlanTest, RejectsRangesThatDoNotTile) {
  PlanMatrix m = matrix("bad", 2, 2, 2, {{0, 2}, {1, 1}});  // covers 3 of 4 elements
  EXPECT_THROW(
      {
        try {
          plan_owners({PlanGroup{"g", {m}}}, 2, holders_only());
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("'bad'"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
  PlanMatrix wrong_world = matrix("w", 2, 2, 3, {{0, 4}});
  EXPECT_THROW(plan_owners({PlanGroup{"g", {wrong_world}}}, 2, holders_only()), c10::Error);
}

TEST(OwnerPlanTest, PrefetchWindowsFollowTheBudget) {
  // Four groups, W=2; owned full bytes per rank: g0 {64,0}, g1 {0,64}, g2 {64,64}, g3 {256,0}.
  std::vector<PlanGroup> groups = {
      {"g0", {matrix("a", 4, 4, 2, {{0, 16}})}},
      {"g1", {matrix("b", 4, 4, 2, {{1, 16}})}},
      {"g2", {matrix("c", 4, 4, 2, {{0, 16}}), matrix("d", 4, 4, 2, {{1, 16}})}},
      {"g3", {matrix("e", 8, 8, 2, {{0, 64}})}},
  };
  const OwnerPlan plan = plan_owners(groups, 2, holders_only());
  using W = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(detail::prefetch_windows(plan, 0), (W{{0, 1}, {1, 2}, {2, 3}, {3, 4}}));
  EXPECT_EQ(detail::prefetch_windows(plan, 64), (W{{0, 2}, {2, 3}, {3, 4}}));
  EXPECT_EQ(detail::prefetch_windows(plan, 128), (W{{0, 3}, {3, 4}}));
  EXPECT_EQ(detail::prefetch_windows(plan, 300), (W{{0, 3}, {3, 4}}));
  EXPECT_EQ(detail::prefetch_windows(plan, 384), (W{{0, 4}}));
  EXPECT_EQ(detail::prefetch_windows(plan, kUnlimitedPrefetch), (W{{0, 4}}));
  EXPECT_THROW(detail::prefetch_windows(plan, -1), c10::Error);
  // All matrices are local, so the owners are fixed and planning with a budget cuts the same
  // windows.
  for (int64_t budget :
       {int64_t{0}, int64_t{64}, int64_t{128}, int64_t{300}, int64_t{384}, kUnlimitedPrefetch}) {
    EXPECT_EQ(plan_owners(groups, 2, windows().prefetch_budget_bytes(budget)).windows,
              detail::prefetch_windows(plan, budget))
        << budget;
  }
  // a, b, c, d cost 1920 each, e 15360: pairing g0 with g1 saves one 1920 wait.
  EXPECT_EQ(detail::critical_path_budget0(plan), 1920 * 3 + 15360);
  EXPECT_EQ(detail::critical_path(plan, detail::prefetch_windows(plan, 64)), 1920 * 2 + 15360);
}

// W=2: g0 = {X, Y} (384 each), g1 = {Z} (448), all split evenly between the ranks. Carrying
// loads across both groups puts Z on rank 0 first, then X and Y both on rank 1: g0 waits 768.
// Planned one window at a time (budget 0), g0 is balanced on its own: 384 + 448.
TEST(OwnerPlanTest, WindowedPlanBalancesEachWindow) {
  std::vector<PlanGroup> groups = {
      {"g0", {matrix("X", 4, 4, 2, {{0, 8}, {1, 8}}), matrix("Y", 4, 4, 2, {{0, 8}, {1, 8}})}},
      {"g1", {matrix("Z", 4, 5, 2, {{0, 10}, {1, 10}})}}};
  for (auto& g : groups) {
    for (auto& m : g.matrices) m.newton_schulz.steps(1);
  }
  const OwnerPlan carried = plan_owners(groups, 2, windows());
  EXPECT_EQ(carried.cost[0], (std::vector<int64_t>{384, 384}));
  EXPECT_EQ(carried.cost[1], (std::vector<int64_t>{448}));
  EXPECT_EQ(carried.windows, (std::vector<std::pair<size_t, size_t>>{{0, 2}}));
  EXPECT_EQ(carried.owner[0], (std::vector<int>{1, 1}));
  EXPECT_EQ(carried.owner[1], (std::vector<int>{0}));
  EXPECT_EQ(carried.critical_path_planned(), 768);
  EXPECT_EQ(detail::critical_path_budget0(carried), 768 + 448);

  const OwnerPlan windowed = plan_owners(groups, 2, windows().prefetch_budget_bytes(0));
  EXPECT_EQ(windowed.windows, (std::vector<std::pair<size_t, size_t>>{{0, 1}, {1, 2}}));
  EXPECT_EQ(windowed.owner[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(windowed.owner[1], (std::vector<int>{0}));
  EXPECT_EQ(windowed.critical_path_planned(), 384 + 448);
  EXPECT_EQ(windowed.cost_per_rank, (std::vector<int64_t>{832, 384}));

  // A budget that fits both groups on every rank: one window, the carried plan. Owned bytes of
  // the carried plan are 80 (Z) on rank 0 and 128 (X, Y) on rank 1.
  const OwnerPlan both = plan_owners(groups, 2, windows().prefetch_budget_bytes(128));
  EXPECT_EQ(both.windows, carried.windows);
  EXPECT_EQ(both.owner, carried.owner);
  // 127 bytes: g0 alone is balanced (64 each); adding g1 would need 128 on one rank.
  const OwnerPlan tight = plan_owners(groups, 2, windows().prefetch_budget_bytes(127));
  EXPECT_EQ(tight.windows, windowed.windows);
  EXPECT_THROW(plan_owners(groups, 2, holders_only().prefetch_budget_bytes(-1)), c10::Error);
}

TEST(OwnerPlanTest, GroupFromShapesUsesTheFlatLayout) {
  // fp32, 16-byte alignment = 4 elements: a at 0 (15), b at 16 (7), c at 24 (6); padded to 32,
  // shards of 16: a on rank 0 only, c on rank 1 only; b is 1-D and left out.
  const PlanGroup g = plan_group_from_shapes("g", {{"a", {3, 5}}, {"b", {7}}, {"c", {2, 3}}}, 2);
  ASSERT_EQ(g.matrices.size(), 2u);
  EXPECT_EQ(g.matrices[0].name, "a");
  EXPECT_EQ(g.matrices[0].held[0], (std::pair<int64_t, int64_t>{0, 15}));
  EXPECT_EQ(g.matrices[0].held[1].first, g.matrices[0].held[1].second);
  EXPECT_EQ(g.matrices[1].name, "c");
  EXPECT_EQ(g.matrices[1].held[1], (std::pair<int64_t, int64_t>{0, 6}));
  EXPECT_EQ(g.matrices[1].held[0].first, g.matrices[1].held[0].second);
}

// Llama-3-8B decoder layers, one group per layer, bf16 model weights (docs/DESIGN.md §7).
std::vector<PlanGroup> llama3_8b(int world_size) {
  const int64_t h = 4096, kv = 1024, ffn = 14336;
  std::vector<PlanGroup> groups;
  for (int layer = 0; layer < 32; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    groups.push_back(plan_group_from_shapes(p,
                                            {{p + "self_attn.q_proj.weight", {h, h}},
                                             {p + "self_attn.k_proj.weight", {kv, h}},
                                             {p + "self_attn.v_proj.weight", {kv, h}},
                                             {p + "self_attn.o_proj.weight", {h, h}},
                                             {p + "mlp.gate_proj.weight", {ffn, h}},
                                             {p + "mlp.up_proj.weight", {ffn, h}},
                                             {p + "mlp.down_proj.weight", {h, ffn}},
                                             {p + "input_layernorm.weight", {h}},
                                             {p + "post_attention_layernorm.weight", {h}}},
                                            world_size, NewtonSchulzOptions(), at::kBFloat16, 16));
  }
  return groups;
}

TEST(OwnerPlanTest, Llama3_8BCriticalPaths) {
  for (int w : {8, 64}) {
    const auto groups = llama3_8b(w);
    const OwnerPlan holders = plan_owners(groups, w, holders_only());
    const OwnerPlan any =
        plan_owners(groups, w, holders_only().owner_policy(OwnerPolicy::kAnyRank));
    std::cout << "Llama-3-8B W=" << w << " holders-only: " << holders.summary()
              << "Llama-3-8B W=" << w << " any-rank: " << any.summary();
    double previous = 1e9;
    for (int64_t budget_mib : {0, 256, 512, 1024, 2048}) {
      for (OwnerPolicy policy : {OwnerPolicy::kHoldersOnly, OwnerPolicy::kAnyRank}) {
        const OwnerPlan planned = plan_owners(
            groups, w, windows().owner_policy(policy).prefetch_budget_bytes(budget_mib << 20));
        std::cout << "  " << to_string(policy) << " budget " << budget_mib
                  << " MiB: " << planned.windows.size() << " windows, critical path "
                  << planned.critical_path_ratio_planned() << "\n";
        if (policy == OwnerPolicy::kHoldersOnly) {
          // More budget, fewer and larger windows: never a longer critical path here.
          EXPECT_LE(planned.critical_path_ratio_planned(), previous + 1e-9);
          previous = planned.critical_path_ratio_planned();
          if (budget_mib == 0 && w == 8) {
            // Each layer balanced on its own reaches the floor of its largest matrix (2.1x at
            // W=8, the design's number), below the carried plan's 2.26x.
            EXPECT_LT(planned.critical_path_ratio_planned(),
                      detail::critical_path_ratio_budget0(holders));
          }
        }
      }
    }
    // Every element of a 7-matrix layer is held by someone; under holders-only, each rank's
    // traffic is bounded by twice its shard of the matrices.
    const int64_t total = std::accumulate(holders.gather_bytes_per_rank.begin(),
                                          holders.gather_bytes_per_rank.end(), int64_t{0});
    EXPECT_EQ(total, std::accumulate(holders.scatter_bytes_per_rank.begin(),
                                     holders.scatter_bytes_per_rank.end(), int64_t{0}));
    // Unlimited prefetch never loses to one group at a time.
    EXPECT_LE(detail::critical_path_unlimited(holders), detail::critical_path_budget0(holders));
    EXPECT_LE(detail::critical_path_unlimited(any), detail::critical_path_unlimited(holders));
    // The performance model of docs/DESIGN.md §7: one group at a time costs ~2.1x ideal at
    // W=8 and ~17x at W=64; global balancing with unlimited prefetch brings holders-only to
    // ~1.34x at W=8 and any-rank to ~1.00x (W=8) and ~1.06x (W=64).
    if (w == 8) {
      EXPECT_NEAR(detail::critical_path_ratio_budget0(holders), 2.2, 0.15);
      EXPECT_NEAR(detail::critical_path_ratio_unlimited(holders), 1.34, 0.02);
      EXPECT_NEAR(detail::critical_path_ratio_unlimited(any), 1.0, 0.02);
    } else {
      EXPECT_NEAR(detail::critical_path_ratio_budget0(holders), 17.0, 0.5);
      EXPECT_NEAR(detail::critical_path_ratio_unlimited(any), 1.06, 0.02);
    }
  }
}

// W=2, every matrix local: g0 = {A, B} on rank 0, g1 = {D, E} on rank 1, 1920 FLOPs and 64 bytes
// each. A budget of 127 bytes fits one matrix per rank: windows run g0, then g1 (each rank
// idles in one), rounds run A with D, then B with E.
TEST(OwnerPlanTest, RoundsDoNotStallPerWindow) {
  const std::vector<PlanGroup> groups = {
      {"g0", {matrix("A", 4, 4, 2, {{0, 16}}), matrix("B", 4, 4, 2, {{0, 16}})}},
      {"g1", {matrix("D", 4, 4, 2, {{1, 16}}), matrix("E", 4, 4, 2, {{1, 16}})}}};
  const auto options =
      holders_only().owner_schedule(OwnerSchedule::kRounds).prefetch_budget_bytes(127);
  const OwnerPlan rounds = plan_owners(groups, 2, options);
  using Round = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(rounds.schedule, OwnerSchedule::kRounds);
  EXPECT_TRUE(rounds.windows.empty());
  EXPECT_EQ(rounds.rounds, (std::vector<Round>{{{0, 0}, {1, 0}}, {{0, 1}, {1, 1}}}));
  EXPECT_EQ(rounds.round_cost_per_rank,
            (std::vector<std::vector<int64_t>>{{1920, 1920}, {1920, 1920}}));
  EXPECT_EQ(rounds.round_full_bytes_per_rank,
            (std::vector<std::vector<int64_t>>{{64, 64}, {64, 64}}));
  EXPECT_EQ(rounds.max_round_full_bytes(), 64);
  EXPECT_EQ(rounds.refresh_after_round, (std::vector<size_t>{1, 1}));
  EXPECT_EQ(rounds.critical_path_planned(), 3840);
  const OwnerPlan windowed = plan_owners(groups, 2, windows().prefetch_budget_bytes(127));
  EXPECT_EQ(windowed.rounds, (std::vector<Round>{{{0, 0}, {0, 1}}, {{1, 0}, {1, 1}}}));
  EXPECT_EQ(windowed.refresh_after_round, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(windowed.critical_path_planned(), 7680);
  EXPECT_EQ(windowed.critical_path_planned(), detail::critical_path(windowed, windowed.windows));
  // With overlap two rounds are in flight: 254 bytes packs the same rounds, 127 one matrix
  // per round alone (a matrix over half the budget runs alone).
  const OwnerPlan overlapped = plan_owners(
      groups, 2, OwnerPlanOptions(options).overlap_communication(true).prefetch_budget_bytes(254));
  EXPECT_EQ(overlapped.rounds, rounds.rounds);
  EXPECT_EQ(overlapped.overlap_with_next, (std::vector<bool>{true, false}));
  EXPECT_EQ(overlapped.max_held_full_bytes(), 128);
  EXPECT_EQ(rounds.overlap_with_next, (std::vector<bool>{false, false}));  // overlap off
  EXPECT_EQ(rounds.max_held_full_bytes(), 64);
  // 127 bytes with overlap: each matrix (64 bytes) is over half of it, so alone in its round,
  // and two rounds would exceed the budget: they run one after the other.
  const OwnerPlan alone = plan_owners(
      groups, 2, OwnerPlanOptions(options).overlap_communication(true).prefetch_budget_bytes(127));
  EXPECT_EQ(alone.rounds, rounds.rounds);
  EXPECT_EQ(alone.overlap_with_next, (std::vector<bool>{false, false}));
  EXPECT_EQ(alone.max_held_full_bytes(), 64);
  // Everything fits: one round.
  EXPECT_EQ(
      plan_owners(groups, 2, OwnerPlanOptions(options).prefetch_budget_bytes(kUnlimitedPrefetch))
          .rounds,
      (std::vector<Round>{{{0, 0}, {0, 1}, {1, 0}, {1, 1}}}));
  EXPECT_THROW(plan_owners(groups, 2, OwnerPlanOptions(options).max_bytes_ratio(0.5)), c10::Error);
}

// W=2: X and Y (15360 each) lie whole on rank 0, Z (240) is split. Holders-only leaves rank 0
// with 30720 and sends 8 bytes each way; balanced moves X or Y to rank 1 once the byte limit
// allows its 256 bytes (and not under 1.5x of 8 bytes).
TEST(OwnerPlanTest, BalancedMovesLocalMatricesWithinTheByteLimit) {
  const std::vector<PlanGroup> groups = {
      {"g",
       {matrix("X", 8, 8, 2, {{0, 64}}), matrix("Y", 8, 8, 2, {{0, 64}}),
        matrix("Z", 2, 2, 2, {{0, 2}, {1, 2}})}}};
  const auto options = holders_only().owner_policy(OwnerPolicy::kBalanced);
  const OwnerPlan holders = plan_owners(groups, 2, holders_only());
  EXPECT_EQ(holders.owner[0], (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(holders.holders_only_max_bytes, 8);
  const OwnerPlan tight = plan_owners(groups, 2, options);
  EXPECT_EQ(tight.owner, holders.owner);
  EXPECT_EQ(tight.critical_path_planned(), 30720);
  const OwnerPlan loose = plan_owners(groups, 2, OwnerPlanOptions(options).max_bytes_ratio(100));
  std::vector<int64_t> loads = loose.cost_per_rank;
  std::sort(loads.begin(), loads.end());
  EXPECT_EQ(loads, (std::vector<int64_t>{15360, 15600}));
  EXPECT_EQ(loose.critical_path_planned(), 15600);
  EXPECT_EQ(loose.max_bytes_per_rank(), 264);  // a whole 8x8 fp32 matrix plus Z's 2 elements
  EXPECT_EQ(loose.holders_only_max_bytes, 8);
}

// The cost model (docs/DESIGN.md §7) on the same hand case: where bytes are cheap it takes the
// unlimited plan (15600 FLOPs, 264 bytes), where FLOPs are cheap holders-only (30720 FLOPs, 8
// bytes); either way the plan is exactly the one planned with the chosen limit.
TEST(OwnerPlanTest, CostModelPicksTheCheapestByteLimit) {
  const std::vector<PlanGroup> groups = {
      {"g",
       {matrix("X", 8, 8, 2, {{0, 64}}), matrix("Y", 8, 8, 2, {{0, 64}}),
        matrix("Z", 2, 2, 2, {{0, 2}, {1, 2}})}}};
  const auto by_cost =
      holders_only().owner_policy(OwnerPolicy::kBalanced).max_bytes_ratio(kBytesRatioByCost);

  const auto fast_bytes = CostRates().newton_schulz_flops_per_second(1).bytes_per_second(1e9);
  const OwnerPlan balanced = plan_owners(groups, 2, by_cost, fast_bytes);
  EXPECT_EQ(balanced.max_bytes_ratio, std::numeric_limits<double>::infinity());
  EXPECT_EQ(balanced.critical_path_planned(), 15600);
  EXPECT_EQ(balanced.max_bytes_per_rank(), 264);
  EXPECT_DOUBLE_EQ(balanced.estimated_seconds(CostRates(fast_bytes).inter_node_bytes_per_second(1)),
                   15600 + 264e-9);                                // no inter bytes
  EXPECT_DOUBLE_EQ(balanced.estimated_seconds(), 15600 + 264e-9);  // at the rates planned with

  const auto fast_flops = CostRates().newton_schulz_flops_per_second(1e9).bytes_per_second(1);
  const OwnerPlan frugal = plan_owners(groups, 2, by_cost, fast_flops);
  EXPECT_EQ(frugal.max_bytes_ratio, 1.0);  // every limit below 33 gives this plan: the first wins
  EXPECT_EQ(frugal.critical_path_planned(), 30720);
  EXPECT_EQ(frugal.max_bytes_per_rank(), 8);

  for (const auto& [rates, chosen] : {std::pair{fast_bytes, &balanced}, {fast_flops, &frugal}}) {
    const OwnerPlan fixed = plan_owners(
        groups, 2, OwnerPlanOptions(by_cost).max_bytes_ratio(chosen->max_bytes_ratio), rates);
    EXPECT_EQ(fixed.owner, chosen->owner);
    EXPECT_EQ(fixed.rounds, chosen->rounds);
    // No candidate limit is cheaper at these rates.
    for (const double ratio : detail::kCostModelBytesRatios) {
      const OwnerPlan other =
          plan_owners(groups, 2, OwnerPlanOptions(by_cost).max_bytes_ratio(ratio), rates);
      EXPECT_LE(chosen->estimated_seconds(), other.estimated_seconds()) << "ratio " << ratio;
    }
  }
  EXPECT_THROW(plan_owners(groups, 2, by_cost, CostRates().bytes_per_second(0)), c10::Error);
  // The plan keeps the rates it was made at.
  EXPECT_EQ(balanced.rates.newton_schulz_flops_per_second(), 1);
  EXPECT_EQ(balanced.rates.bytes_per_second(), 1e9);
  EXPECT_EQ(frugal.rates.newton_schulz_flops_per_second(), 1e9);
}

// Each setting is spelled once: FsdpMuonConfig holds the planner's settings as one
// OwnerPlanOptions (whose defaults are its defaults) and the rates as one optional CostRates,
// std::nullopt (measure at construction) by default. The defaults documented for the rates.
TEST(OwnerPlanTest, ConfigHoldsThePlannerAndTheRatesOnce) {
  const FsdpMuonConfig config;
  const OwnerPlanOptions defaults;
  EXPECT_EQ(config.planner().owner_policy(), defaults.owner_policy());
  EXPECT_EQ(config.planner().owner_schedule(), defaults.owner_schedule());
  EXPECT_EQ(config.planner().max_bytes_ratio(), kBytesRatioByCost);
  EXPECT_EQ(config.planner().prefetch_budget_bytes(), int64_t{1} << 30);
  EXPECT_TRUE(config.planner().overlap_communication());
  EXPECT_EQ(config.planner().replica_newton_schulz(), ReplicaNewtonSchulz::kByCost);
  EXPECT_FALSE(config.rates().has_value());
  const CostRates rates;
  EXPECT_EQ(rates.newton_schulz_flops_per_second(), 4e14);
  EXPECT_EQ(rates.bytes_per_second(), 1.5e11);
  EXPECT_EQ(rates.inter_node_bytes_per_second(), 2.5e10);
  EXPECT_EQ(rates.exchange_latency_seconds(), 5e-5);
  // Set whole or one setting in place.
  FsdpMuonConfig set = FsdpMuonConfig()
                           .planner(OwnerPlanOptions().owner_schedule(OwnerSchedule::kWindows))
                           .rates(CostRates().bytes_per_second(1e9));
  set.planner().prefetch_budget_bytes(0);
  EXPECT_EQ(set.planner().owner_schedule(), OwnerSchedule::kWindows);
  EXPECT_EQ(set.planner().prefetch_budget_bytes(), 0);
  ASSERT_TRUE(set.rates().has_value());
  EXPECT_EQ(set.rates()->bytes_per_second(), 1e9);
  EXPECT_EQ(set.rates()->newton_schulz_flops_per_second(), 4e14);
}

// GPT-2 124M and a Mixtral-like 8-expert model, one group per layer, bf16 layout.
std::vector<PlanGroup> model_groups(const std::string& which, int world_size) {
  std::vector<PlanGroup> groups;
  if (which == "gpt2") {
    const int64_t d = 768;
    for (int layer = 0; layer < 12; ++layer) {
      const std::string p = "h." + std::to_string(layer) + ".";
      groups.push_back(plan_group_from_shapes(p,
                                              {{p + "ln_1.weight", {d}},
                                               {p + "attn.c_attn.weight", {3 * d, d}},
                                               {p + "attn.c_attn.bias", {3 * d}},
                                               {p + "attn.c_proj.weight", {d, d}},
                                               {p + "ln_2.weight", {d}},
                                               {p + "mlp.c_fc.weight", {4 * d, d}},
                                               {p + "mlp.c_proj.weight", {d, 4 * d}}},
                                              world_size, NewtonSchulzOptions(), at::kBFloat16,
                                              16));
    }
    return groups;
  }
  const int64_t d = 4096, kv = 1024, ffn = 14336;
  for (int layer = 0; layer < 32; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {{p + "q", {d, d}},
                                                                        {p + "k", {kv, d}},
                                                                        {p + "v", {kv, d}},
                                                                        {p + "o", {d, d}},
                                                                        {p + "router", {8, d}}};
    for (int e = 0; e < 8; ++e) {
      const std::string x = p + "experts." + std::to_string(e) + ".";
      shapes.push_back({x + "w1", {ffn, d}});
      shapes.push_back({x + "w3", {ffn, d}});
      shapes.push_back({x + "w2", {d, ffn}});
    }
    shapes.push_back({p + "norm", {d}});
    groups.push_back(
        plan_group_from_shapes(p, shapes, world_size, NewtonSchulzOptions(), at::kBFloat16, 16));
  }
  return groups;
}

// docs/DESIGN.md §7, goal of the default schedule (FsdpMuonConfig(): balanced owners, rounds,
// 1 GiB budget, overlap): Newton–Schulz critical path within 1.10x of the whole-matrix floor in
// the fewest rounds that fit (the cost model may split them further where the pipelined step is
// faster: never slower), the byte limit the cost model's (kBytesRatioByCost: no candidate limit
// predicted cheaper at the default rates), and each rank's owned full matrices of a round within
// half the budget (two rounds in flight) unless one matrix alone exceeds it.
// GPT-2 at W=32 is left out: 48 matrices on 32 ranks cannot beat 1.33x (24 MLP matrices fill
// 24 ranks alone, 12 attention input matrices of 6.3 GFLOP then need pairs), above 1.10x the
// floor of 1.00 that max(mean, largest matrix) gives.
TEST(OwnerPlanTest, DefaultScheduleIsNearTheFloor) {
  const OwnerPlanOptions config = FsdpMuonConfig().planner();
  EXPECT_EQ(config.owner_schedule(), OwnerSchedule::kRounds);
  EXPECT_EQ(config.owner_policy(), OwnerPolicy::kBalanced);
  const int64_t half_budget = config.prefetch_budget_bytes() / 2;
  for (const std::string which : {"llama3-8b", "gpt2", "8-expert"}) {
    for (int w : {8, 16, 32, 64, 128, 256}) {
      if (which == "gpt2" && w == 32) continue;
      const auto groups = which == "llama3-8b" ? llama3_8b(w) : model_groups(which, w);
      const OwnerPlan plan = plan_owners(groups, w, config);
      SCOPED_TRACE(which + " W=" + std::to_string(w));
      OwnerPlan fewest = plan;
      detail::pack_rounds(groups, half_budget, fewest);
      detail::finish_rounds(groups.size(), config.prefetch_budget_bytes(), true, fewest);
      detail::transfer_seconds(groups, fewest);
      EXPECT_LE(fewest.critical_path_ratio_planned(), 1.10 * fewest.floor_ratio());
      EXPECT_LE(plan.pipelined_seconds(), fewest.pipelined_seconds());
      EXPECT_EQ(config.max_bytes_ratio(), kBytesRatioByCost);
      EXPECT_LE(static_cast<double>(plan.max_bytes_per_rank()),
                plan.max_bytes_ratio * static_cast<double>(plan.holders_only_max_bytes));
      for (const double ratio : detail::kCostModelBytesRatios) {
        const OwnerPlan fixed =
            plan_owners(groups, w, OwnerPlanOptions(config).max_bytes_ratio(ratio));
        EXPECT_LE(plan.estimated_seconds(), fixed.estimated_seconds()) << "limit " << ratio;
      }
      for (size_t t = 0; t < plan.rounds.size(); ++t) {
        for (int r = 0; r < w; ++r) {
          int owned = 0;
          for (const auto& [g, i] : plan.rounds[t]) owned += plan.owner[g][i] == r;
          if (owned > 1) {
            EXPECT_LE(plan.round_full_bytes_per_rank[t][r], half_budget);
          }
        }
      }
      // What a rank holds at once: within the budget (no single matrix here exceeds half).
      EXPECT_LE(plan.max_held_full_bytes(), config.prefetch_budget_bytes());
      // The critical path of rounds never beats the longest rank, and is what runs.
      EXPECT_GE(plan.critical_path_planned(), detail::critical_path_unlimited(plan));
      // Windows under the same budget and policy stall per window: never shorter here (without
      // overlap, where both take the fewest exchanges that fit; with it, rounds may be split
      // further to hide the exchange, see RoundsByCostHideTheExchange).
      const OwnerPlanOptions one_in_flight = OwnerPlanOptions(config).overlap_communication(false);
      const OwnerPlan windowed = plan_owners(
          groups, w, OwnerPlanOptions(one_in_flight).owner_schedule(OwnerSchedule::kWindows));
      EXPECT_LE(plan_owners(groups, w, one_in_flight).critical_path_planned(),
                windowed.critical_path_planned());
    }
  }
}

// ---- HSDP: a replicate x shard mesh (docs/DESIGN.md §7) ----

// The planner's options with `mode` on a mesh: the defaults, or holders-only owners.
OwnerPlanOptions on_mesh(ReplicaNewtonSchulz mode, bool holders) {
  OwnerPlanOptions options = OwnerPlanOptions().replica_newton_schulz(mode);
  if (holders) options.owner_policy(OwnerPolicy::kHoldersOnly);
  return options;
}

// The shard plan's groups of GPT-2 and the 8-expert model, with NorMuon on GPT-2's MLP input
// matrices so that row state travels too.
std::vector<PlanGroup> mesh_groups(const std::string& which, int shard_size) {
  std::vector<PlanGroup> groups = model_groups(which, shard_size);
  if (which == "gpt2") {
    for (auto& g : groups) {
      for (auto& m : g.matrices) m.per_row_state = m.name.find("c_fc") != std::string::npos;
    }
  }
  return groups;
}

TEST(OwnerPlanTest, OncePerReplicaIsTheShardPlan) {
  for (const std::string which : {"gpt2", "8-expert"}) {
    for (const auto& [replicas, shard] : {std::pair{2, 4}, {4, 8}, {3, 2}}) {
      SCOPED_TRACE(which + " " + std::to_string(replicas) + "x" + std::to_string(shard));
      const auto groups = mesh_groups(which, shard);
      for (const bool holders : {true, false}) {
        const OwnerPlanOptions options = on_mesh(ReplicaNewtonSchulz::kOncePerReplica, holders);
        const OwnerPlan plan = plan_owners(groups, MeshShape{replicas, shard}, options);
        const OwnerPlan alone = plan_owners(groups, shard, options);
        EXPECT_EQ(plan.world_size, shard);
        EXPECT_EQ(plan.mesh.replicas, replicas);
        EXPECT_EQ(plan.mesh.shard_size, shard);
        EXPECT_EQ(plan.replica_newton_schulz, ReplicaNewtonSchulz::kOncePerReplica);
        EXPECT_EQ(plan.owner, alone.owner);
        EXPECT_EQ(plan.rounds, alone.rounds);
        EXPECT_EQ(plan.round_cost_per_rank, alone.round_cost_per_rank);
        EXPECT_EQ(plan.overlap_with_next, alone.overlap_with_next);
        EXPECT_EQ(plan.gather_bytes_per_rank, alone.gather_bytes_per_rank);
        EXPECT_EQ(plan.scatter_bytes_per_rank, alone.scatter_bytes_per_rank);
        EXPECT_EQ(plan.inter_node_bytes_per_rank, std::vector<int64_t>(shard, 0));
        EXPECT_EQ(plan.max_intra_node_bytes_per_rank(), alone.max_bytes_per_rank());
      }
    }
  }
  // The 1-D entry point is the {1, W} mesh, whatever replica_newton_schulz says.
  const auto groups = model_groups("8-expert", 8);
  for (const auto mode : {ReplicaNewtonSchulz::kOncePerWorld, ReplicaNewtonSchulz::kOncePerReplica,
                          ReplicaNewtonSchulz::kByCost, ReplicaNewtonSchulz::kOncePerWorldRelay}) {
    const OwnerPlanOptions options = OwnerPlanOptions().replica_newton_schulz(mode);
    const OwnerPlan flat = plan_owners(groups, 8, options);
    const OwnerPlan mesh = plan_owners(groups, MeshShape{1, 8}, options);
    EXPECT_EQ(flat.owner, mesh.owner);
    EXPECT_EQ(flat.rounds, mesh.rounds);
    EXPECT_EQ(flat.world_size, 8);
    EXPECT_EQ(flat.mesh.replicas, 1);
    EXPECT_EQ(flat.max_inter_node_bytes_per_rank(), 0);
    // One replica: kByCost's tie goes to kOncePerReplica.
    EXPECT_EQ(flat.replica_newton_schulz,
              mode == ReplicaNewtonSchulz::kByCost ? ReplicaNewtonSchulz::kOncePerReplica : mode);
  }
}

// kOncePerWorld: every matrix owned once in the world, by a holder's shard rank under
// holders-only; bytes against a count over (sender, receiver) pairs of world ranks; the
// Newton–Schulz critical path about 1/replicas of the shard plan's.
TEST(OwnerPlanTest, OncePerWorldOwnsEachMatrixOnceInTheWorld) {
  for (const std::string which : {"gpt2", "8-expert"}) {
    for (const auto& [replicas, shard] : {std::pair{2, 4}, {4, 8}, {3, 2}, {8, 8}}) {
      const auto groups = mesh_groups(which, shard);
      const int world = replicas * shard;
      for (const bool holders : {true, false}) {
        for (const bool unlimited : {true, false}) {
          SCOPED_TRACE(which + " " + std::to_string(replicas) + "x" + std::to_string(shard) +
                       (holders ? " holders-only" : " balanced") +
                       (unlimited ? " unlimited budget" : " default budget"));
          OwnerPlanOptions options = on_mesh(ReplicaNewtonSchulz::kOncePerWorld, holders);
          // Everything in one round: no budget, and no overlap to split it for.
          if (unlimited)
            options.prefetch_budget_bytes(kUnlimitedPrefetch).overlap_communication(false);
          const OwnerPlan plan = plan_owners(groups, MeshShape{replicas, shard}, options);
          const OwnerPlan per_replica = plan_owners(groups, MeshShape{replicas, shard},
                                                    OwnerPlanOptions(options).replica_newton_schulz(
                                                        ReplicaNewtonSchulz::kOncePerReplica));
          EXPECT_EQ(plan.world_size, world);
          EXPECT_EQ(plan.replica_newton_schulz, ReplicaNewtonSchulz::kOncePerWorld);
          ASSERT_EQ(plan.inter_node_bytes_per_rank.size(), static_cast<size_t>(world));

          std::vector<int64_t> gather(world, 0), scatter(world, 0), inter(world, 0);
          std::vector<int64_t> cost(world, 0);
          int64_t all_inter = 0;
          std::map<std::pair<size_t, size_t>, int> in_rounds;
          for (const auto& round : plan.rounds) {
            for (const auto& gi : round) ++in_rounds[gi];
          }
          for (size_t g = 0; g < groups.size(); ++g) {
            const int64_t eb = groups[g].element_bytes > 0 ? groups[g].element_bytes : 4;
            for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
              const PlanMatrix& m = groups[g].matrices[i];
              const int o = plan.owner[g][i];
              ASSERT_GE(o, 0);
              ASSERT_LT(o, world);
              EXPECT_EQ(in_rounds[std::make_pair(g, i)], 1) << m.name;
              if (holders) {
                EXPECT_GT(detail::held_numel(m, o % shard), 0) << m.name;
              }
              cost[o] += plan.cost[g][i];
              all_inter += (replicas - 1) * detail::moved_numel(m) * eb;
              for (int q = 0; q < world; ++q) {  // the receiver of an update slice
                if (q == o) continue;
                const int64_t piece = detail::held_numel(m, q % shard) * eb;
                scatter[o] += piece;
                if (q / shard != o / shard) {
                  inter[o] += piece;
                } else {
                  gather[q] += piece;  // a holder in the owner's replica sends it its piece
                }
              }
            }
          }
          EXPECT_EQ(plan.gather_bytes_per_rank, gather);
          EXPECT_EQ(plan.scatter_bytes_per_rank, scatter);
          EXPECT_EQ(plan.inter_node_bytes_per_rank, inter);
          EXPECT_EQ(plan.cost_per_rank, cost);
          EXPECT_EQ(std::accumulate(inter.begin(), inter.end(), int64_t{0}), all_inter);
          // Spreading each shard rank's matrices over the replicas, largest first to the least
          // loaded: within one matrix of 1/replicas of the shard plan's rank, so within the
          // largest matrix of the shard plan's path over replicas when everything is one round.
          if (unlimited) {
            EXPECT_LE(static_cast<double>(plan.critical_path_planned()),
                      static_cast<double>(per_replica.critical_path_planned()) / replicas +
                          static_cast<double>(plan.largest_matrix_cost()));
          }
          EXPECT_LE(plan.critical_path_planned(), per_replica.critical_path_planned());
        }
      }
    }
  }
}

// kOncePerWorldRelay, counted by hand on a 3x2 mesh (4-byte elements): A (4x4) is held half by
// each shard rank, B (2x4) by shard rank 1 alone. Direct, both are owned in replica 0 (A by world
// rank 0, B by 1: each shard rank's matrices spread by cost alone); the relay puts B in replica
// 1 (world rank 3), where it adds no stage-B bytes to A's holders. Gather: rank 1 sends rank 0
// its half of A (32 B). Stage A: rank 0 sends rank 1 its half of A's update (32 B). Stage B:
// ranks 0 and 1 each send their half of A to the 2 other replicas (2 x 32 B), rank 3 all of B
// (2 x 32 B). Direct: rank 0 sends A's halves to the 5 other ranks (5 x 32 B, 4 of them across
// replicas), rank 1 sends B to ranks 3 and 5 (2 x 32 B).
TEST(OwnerPlanTest, RelayBytesByHand) {
  const std::vector<PlanGroup> groups{
      {"g", {matrix("A", 4, 4, 2, {{0, 8}, {1, 8}}), matrix("B", 2, 4, 2, {{1, 8}})}, 0}};
  OwnerPlanOptions options = on_mesh(ReplicaNewtonSchulz::kOncePerWorldRelay, true);
  options.prefetch_budget_bytes(kUnlimitedPrefetch).overlap_communication(false);
  const OwnerPlan relay = plan_owners(groups, MeshShape{3, 2}, options);
  const OwnerPlan direct = plan_owners(
      groups, MeshShape{3, 2},
      OwnerPlanOptions(options).replica_newton_schulz(ReplicaNewtonSchulz::kOncePerWorld));
  EXPECT_EQ(relay.replica_newton_schulz, ReplicaNewtonSchulz::kOncePerWorldRelay);
  ASSERT_EQ(relay.owner, (std::vector<std::vector<int>>{{0, 3}}));
  ASSERT_EQ(direct.owner, (std::vector<std::vector<int>>{{0, 1}}));
  EXPECT_EQ(relay.gather_bytes_per_rank, (std::vector<int64_t>{0, 32, 0, 0, 0, 0}));
  EXPECT_EQ(relay.scatter_bytes_per_rank, (std::vector<int64_t>{32 + 64, 64, 0, 64, 0, 0}));
  EXPECT_EQ(relay.inter_node_bytes_per_rank, (std::vector<int64_t>{64, 64, 0, 64, 0, 0}));
  EXPECT_EQ(direct.gather_bytes_per_rank, relay.gather_bytes_per_rank);
  EXPECT_EQ(direct.scatter_bytes_per_rank, (std::vector<int64_t>{160, 64, 0, 0, 0, 0}));
  EXPECT_EQ(direct.inter_node_bytes_per_rank, (std::vector<int64_t>{128, 64, 0, 0, 0, 0}));
  // One round: the gather (32 B), then stage A (32 B within) and stage B (64 B across from the
  // busiest rank), one after the other, each with its latency.
  const CostRates& r = relay.rates;
  ASSERT_EQ(relay.rounds.size(), 1u);
  EXPECT_DOUBLE_EQ(relay.round_gather_seconds[0],
                   32 / r.bytes_per_second() + r.exchange_latency_seconds());
  EXPECT_DOUBLE_EQ(relay.round_scatter_seconds[0], 32 / r.bytes_per_second() +
                                                       64 / r.inter_node_bytes_per_second() +
                                                       2 * r.exchange_latency_seconds());
  EXPECT_DOUBLE_EQ(relay.estimated_seconds(),
                   relay.critical_path_planned() / r.newton_schulz_flops_per_second() +
                       32 / r.bytes_per_second() + 64 / r.inter_node_bytes_per_second());
}

// kOncePerWorldRelay on real shapes (NorMuon's rows on GPT-2's MLP inputs): bytes against a
// count where each holder in the owner's replica sends its piece to the replicas - 1 others;
// across the world as many bytes cross replicas as direct.
TEST(OwnerPlanTest, RelayBytesPerRankAgainstACount) {
  for (const std::string which : {"gpt2", "8-expert"}) {
    for (const auto& [replicas, shard] : {std::pair{2, 4}, {4, 8}, {3, 2}}) {
      SCOPED_TRACE(which + " " + std::to_string(replicas) + "x" + std::to_string(shard));
      const auto groups = mesh_groups(which, shard);
      const int world = replicas * shard;
      const OwnerPlanOptions options = on_mesh(ReplicaNewtonSchulz::kOncePerWorldRelay, false);
      const OwnerPlan relay = plan_owners(groups, MeshShape{replicas, shard}, options);
      const OwnerPlan direct = plan_owners(
          groups, MeshShape{replicas, shard},
          OwnerPlanOptions(options).replica_newton_schulz(ReplicaNewtonSchulz::kOncePerWorld));
      std::vector<int64_t> gather(world, 0), scatter(world, 0), inter(world, 0);
      for (size_t g = 0; g < groups.size(); ++g) {
        const int64_t eb = groups[g].element_bytes > 0 ? groups[g].element_bytes : 4;
        for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
          const PlanMatrix& m = groups[g].matrices[i];
          const int o = relay.owner[g][i];
          const int first = o / shard * shard;  // the owner's replica
          for (int h = 0; h < shard; ++h) {
            const int64_t piece = detail::held_numel(m, h) * eb;
            if (first + h != o) {
              gather[first + h] += piece;
              scatter[o] += piece;
            }
            scatter[first + h] += (replicas - 1) * piece;
            inter[first + h] += (replicas - 1) * piece;
          }
        }
      }
      EXPECT_EQ(relay.gather_bytes_per_rank, gather);
      EXPECT_EQ(relay.scatter_bytes_per_rank, scatter);
      EXPECT_EQ(relay.inter_node_bytes_per_rank, inter);
      const auto sum = [](const std::vector<int64_t>& v) {
        return std::accumulate(v.begin(), v.end(), int64_t{0});
      };
      EXPECT_EQ(sum(relay.inter_node_bytes_per_rank), sum(direct.inter_node_bytes_per_rank));
    }
  }
}

// kByCost: the plan of the three with the lowest estimated_seconds(), kOncePerReplica on a tie,
// then kOncePerWorld before the relay. Slow links keep Newton–Schulz in every replica; in
// between, the relay (no owner sends replicas - 1 copies) is the cheapest.
TEST(OwnerPlanTest, ByCostPicksTheFastestOfTheThree) {
  // GPT-2's 48 matrices over 16 replicas of 4: direct, an owner sends 15 copies of a matrix.
  const auto groups = mesh_groups("gpt2", 4);
  const MeshShape mesh{16, 4};
  std::map<ReplicaNewtonSchulz, int> picked;
  for (const double inter : {1e6, 1e9, 2.5e10, 1e11, 1e12, 1e18}) {
    SCOPED_TRACE("inter-node rate " + std::to_string(inter));
    const OwnerPlanOptions options = on_mesh(ReplicaNewtonSchulz::kByCost, false);
    const CostRates rates = CostRates().inter_node_bytes_per_second(inter);
    const auto plan = [&](ReplicaNewtonSchulz mode) {
      return plan_owners(groups, mesh, OwnerPlanOptions(options).replica_newton_schulz(mode),
                         rates);
    };
    const OwnerPlan chosen = plan_owners(groups, mesh, options, rates);
    const OwnerPlan replica = plan(ReplicaNewtonSchulz::kOncePerReplica);
    const OwnerPlan direct = plan(ReplicaNewtonSchulz::kOncePerWorld);
    const OwnerPlan relay = plan(ReplicaNewtonSchulz::kOncePerWorldRelay);
    const OwnerPlan* expected = &replica;
    for (const OwnerPlan* p : {&direct, &relay}) {
      if (p->estimated_seconds() < expected->estimated_seconds()) expected = p;
    }
    EXPECT_EQ(chosen.replica_newton_schulz, expected->replica_newton_schulz);
    EXPECT_EQ(chosen.owner, expected->owner);
    EXPECT_EQ(chosen.rounds, expected->rounds);
    EXPECT_DOUBLE_EQ(chosen.estimated_seconds(), expected->estimated_seconds());
    // The inter-node term is the busiest rank's: direct, an owner's (replicas - 1) copies of
    // what it owns; relayed, a holder's (replicas - 1) copies of its pieces.
    for (const OwnerPlan* p : {&direct, &relay}) {
      EXPECT_DOUBLE_EQ(p->estimated_seconds(),
                       p->critical_path_planned() / rates.newton_schulz_flops_per_second() +
                           p->max_intra_node_bytes_per_rank() / rates.bytes_per_second() +
                           p->max_inter_node_bytes_per_rank() / inter);
    }
    ++picked[chosen.replica_newton_schulz];
  }
  EXPECT_GT(picked[ReplicaNewtonSchulz::kOncePerReplica], 0);
  EXPECT_GT(picked[ReplicaNewtonSchulz::kOncePerWorldRelay], 0);
}

TEST(OwnerPlanTest, MeshErrors) {
  const auto groups = mesh_groups("gpt2", 4);
  try {
    plan_owners(groups, MeshShape{2, 2}, on_mesh(ReplicaNewtonSchulz::kOncePerWorld, false));
    ADD_FAILURE() << "held ranges of 4 shard ranks on a 2x2 mesh were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("held ranges; it needs one per rank (2)"),
              std::string::npos)
        << e.what();
  }
  try {
    plan_owners(groups, MeshShape{0, 4});
    ADD_FAILURE() << "a mesh without replicas was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("at least one replica and one shard rank, got 0x4"),
              std::string::npos)
        << e.what();
  }
  try {
    plan_owners(groups, MeshShape{2, 4}, on_mesh(ReplicaNewtonSchulz::kByCost, false),
                CostRates().inter_node_bytes_per_second(0));
    ADD_FAILURE() << "an inter-node rate of 0 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("0 B/s (inter_node_bytes_per_second)"), std::string::npos)
        << e.what();
  }
  EXPECT_STREQ(to_string(ReplicaNewtonSchulz::kOncePerWorld), "once_per_world");
  EXPECT_STREQ(to_string(ReplicaNewtonSchulz::kOncePerReplica), "once_per_replica");
  EXPECT_STREQ(to_string(ReplicaNewtonSchulz::kByCost), "by_cost");
  EXPECT_STREQ(to_string(ReplicaNewtonSchulz::kOncePerWorldRelay), "once_per_world_relay");
}

// OwnerPlan::pipelined_seconds against the timeline worked by hand (1 FLOP/s, so a round's cost
// is its seconds): gather 0 first; then each round's Newton–Schulz while the link runs the next
// gather and the previous scatter, in the order they start; the last scatter at the end.
TEST(OwnerPlanTest, PipelinedSecondsFollowTheStep) {
  OwnerPlan plan;
  plan.world_size = 2;
  plan.rates.newton_schulz_flops_per_second(1);
  plan.rounds.assign(3, {});
  // Compute-bound: 2 + 3 x 4 + 1 = 15 (no overlap: 3 x (2 + 4 + 1) = 21).
  plan.round_cost_per_rank = {{4, 1}, {0, 4}, {4, 4}};
  plan.round_gather_seconds = {2, 2, 2};
  plan.round_scatter_seconds = {1, 1, 1};
  plan.overlap_with_next = {true, true, false};
  EXPECT_DOUBLE_EQ(plan.pipelined_seconds(), 15);
  plan.overlap_with_next = {false, false, false};
  EXPECT_DOUBLE_EQ(plan.pipelined_seconds(), 21);
  // Link-bound: the link never rests, 6 exchanges of 3 = 18.
  plan.round_cost_per_rank = {{1, 0}, {1, 1}, {0, 1}};
  plan.round_gather_seconds = {3, 3, 3};
  plan.round_scatter_seconds = {3, 3, 3};
  plan.overlap_with_next = {true, true, false};
  EXPECT_DOUBLE_EQ(plan.pipelined_seconds(), 18);
  // Rounds 0 and 1 overlap, 1 and 2 do not: round 1 is applied (its scatter done, at 12) before
  // round 2 is gathered (15), whose scatter ends at 19.
  plan.overlap_with_next = {true, false, false};
  EXPECT_DOUBLE_EQ(plan.pipelined_seconds(), 19);
}

// docs/DESIGN.md §3: with overlap the cost model chooses how many rounds a step has. GPT-2's 4
// layers at W=2 fit one round of the 1 GiB budget; at CPU-like rates (1 TFLOP/s, 0.25 GB/s, 1 ms
// per exchange) hiding the exchange behind Newton–Schulz pays, so the step is split, and the
// count kept is the one of those asked for (1, 2, 4, ...) with the lowest pipelined_seconds()
// (a larger count only where 1% lower).
// At a prohibitive latency, or without overlap, it stays one round.
TEST(OwnerPlanTest, RoundsByCostHideTheExchange) {
  std::vector<PlanGroup> groups = model_groups("gpt2", 2);
  groups.resize(4);
  const OwnerPlanOptions options = FsdpMuonConfig().planner();
  const CostRates cpu = CostRates()
                            .newton_schulz_flops_per_second(1e12)
                            .bytes_per_second(2.5e8)
                            .exchange_latency_seconds(1e-3);
  const OwnerPlan plan = plan_owners(groups, 2, options, cpu);
  const OwnerPlan one =
      plan_owners(groups, 2, OwnerPlanOptions(options).overlap_communication(false), cpu);
  ASSERT_EQ(one.rounds.size(), 1u);
  EXPECT_GT(plan.rounds.size(), 1u);
  EXPECT_EQ(plan.owner, one.owner);  // the rounds change, the owners do not
  for (size_t t = 0; t + 1 < plan.rounds.size(); ++t) EXPECT_TRUE(plan.overlap_with_next[t]);
  for (size_t ask = 1; ask <= 16; ask *= 2) {
    OwnerPlan other = plan;
    detail::pack_rounds(groups, options.prefetch_budget_bytes() / 2, other, ask);
    detail::finish_rounds(groups.size(), options.prefetch_budget_bytes(), true, other);
    detail::transfer_seconds(groups, other);
    // No count asked for is 1% faster (the margin a larger count must win by).
    EXPECT_LE(0.99 * plan.pipelined_seconds(), other.pipelined_seconds()) << ask << " rounds asked";
    if (ask == 1) {
      EXPECT_EQ(other.rounds.size(), 1u);
      // Splitting hides a real part of the exchange.
      EXPECT_LT(plan.pipelined_seconds(), 0.9 * other.pipelined_seconds());
    }
  }
  // Every round's gather: the busiest rank's bytes at 0.25 GB/s plus the latency.
  for (size_t t = 0; t < plan.rounds.size(); ++t) {
    int64_t most = 0;
    for (int r = 0; r < 2; ++r) {
      int64_t sent = 0;
      for (const auto& [g, i] : plan.rounds[t]) {
        const PlanMatrix& m = groups[g].matrices[i];
        if (plan.owner[g][i] != r) sent += detail::held_numel(m, r) * 4;
      }
      most = std::max(most, sent);
    }
    // An exchange where nothing moves is skipped (local matrices only): no latency either.
    EXPECT_DOUBLE_EQ(plan.round_gather_seconds[t], most > 0 ? most / 2.5e8 + 1e-3 : 0.0);
  }
  const OwnerPlan slow =
      plan_owners(groups, 2, options, CostRates(cpu).exchange_latency_seconds(1e3));
  EXPECT_EQ(slow.rounds.size(), 1u);
  EXPECT_THROW(plan_owners(groups, 2, options, CostRates(cpu).exchange_latency_seconds(-1)),
               c10::Error);
}

}  // namespace
}  // namespace fsdp_muon
