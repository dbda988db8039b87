#pragma once
// The steps plan_owners() composes (docs/DESIGN.md §3), shared by its translation units:
// owner assignment (owner_assignment.cpp), round packing (round_packing.cpp) and the metrics of
// a finished plan (owner_plan_metrics.cpp). Pure functions of the plan and the groups.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include <fsdp_muon/planning/owner_plan.h>

#include "muon/row_state.h"

namespace fsdp_muon::detail {

// The byte limits max_bytes_ratio(kBytesRatioByCost) chooses among, smallest first (the last: no
// limit); docs/DESIGN.md §7.
constexpr double kCostModelBytesRatios[] = {
    1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, std::numeric_limits<double>::infinity()};

// What `rank` sends of `m` to its owner (and receives back): its elements and, with NorMuon,
// the per-row state of the rows that start in them (docs/DESIGN.md §3).
inline int64_t held_numel(const PlanMatrix& m, int rank) {
  const int64_t rows = m.per_row_state ? rows_starting_in(m.held[rank], m.cols).second -
                                             rows_starting_in(m.held[rank], m.cols).first
                                       : 0;
  return m.held[rank].second - m.held[rank].first + rows;
}

// What an owner holding none of `m` receives: all of held_numel over the ranks.
inline int64_t moved_numel(const PlanMatrix& m) {
  return m.rows * m.cols + (m.per_row_state ? m.rows : 0);
}

inline double ratio(double value, double ideal) { return ideal > 0 ? value / ideal : 1.0; }

inline int64_t group_element_bytes(const PlanGroup& group, const OwnerPlan& plan) {
  return group.element_bytes > 0 ? group.element_bytes : plan.element_bytes;
}

// ---- owner assignment (owner_assignment.cpp) ----

// Owners for the matrices of groups [first, last), balanced among themselves (fresh loads).
void assign_window(const std::vector<PlanGroup>& groups, size_t first, size_t last,
                   OwnerPlan& plan);
// Largest per-rank sum of owned full-matrix bytes over groups [first, last).
int64_t window_peak_bytes(const std::vector<PlanGroup>& groups, size_t first, size_t last,
                          const OwnerPlan& plan);
// Per-rank and per-group totals and bytes of a plan whose owners are set.
void finish_plan(const std::vector<PlanGroup>& groups, OwnerPlan& plan);
// kOncePerWorld and kOncePerWorldRelay (plan.replica_newton_schulz; docs/DESIGN.md §7): the
// totals of a plan over plan.mesh whose owners are world ranks; an owner gathers from the holders
// in its replica and scatters to those in every replica (direct), or to those in its replica,
// each of which sends its piece on to its shard rank in the other replicas (relay).
void finish_world_plan(const std::vector<PlanGroup>& groups, OwnerPlan& plan);
// Gather + scatter bytes each rank sends under `plan.owner` (every matrix active).
std::vector<int64_t> bytes_per_rank(const std::vector<PlanGroup>& groups, const OwnerPlan& plan);
// kBalanced: moves and swaps from the busiest rank while every rank's bytes stay in `max_bytes`.
void rebalance(const std::vector<PlanGroup>& groups, double max_bytes, OwnerPlan& plan);
// kBalanced's second start: every matrix to the least-loaded rank within `max_bytes`.
void assign_within_bytes(const std::vector<PlanGroup>& groups, double max_bytes, OwnerPlan& plan);

// ---- round packing (round_packing.cpp) ----

// kRounds: the fewest rounds within `round_budget` bytes per rank, and at least `min_rounds`,
// packed longest first (empty rounds are dropped, so a plan may have fewer).
void pack_rounds(const std::vector<PlanGroup>& groups, int64_t round_budget, OwnerPlan& plan,
                 size_t min_rounds = 1);
// OwnerPlan::round_gather_seconds / round_scatter_seconds of a plan whose rounds are set
// (kOncePerWorld's exchange where the plan is over a mesh's world; the relay's scatter is its two
// stages, one after the other).
void transfer_seconds(const std::vector<PlanGroup>& groups, OwnerPlan& plan);
// kWindows: one round per window of `plan.windows`, its groups' matrices.
void rounds_from_windows(const std::vector<PlanGroup>& groups, OwnerPlan& plan);
// Which round completes each group, and which rounds overlap the next.
void finish_rounds(size_t num_groups, int64_t budget, bool overlap, OwnerPlan& plan);

// ---- what-if analytics of a plan (owner_plan_metrics.cpp, round_packing.cpp), for the
// benchmarks and tests ----

// The windows a budget would cut with these owners: a window grows while the largest per-rank
// sum of owned full-matrix bytes in it stays within budget_bytes, and always holds at least one
// group. Budget 0 gives one group per window; kUnlimitedPrefetch one window.
std::vector<std::pair<size_t, size_t>> prefetch_windows(const OwnerPlan& plan,
                                                        int64_t budget_bytes);
// Critical path of the orthogonalize phase if the groups ran in windows [first, last): sum over
// windows of the largest per-rank cost inside the window.
int64_t critical_path(const OwnerPlan& plan, const std::vector<std::pair<size_t, size_t>>& windows);
int64_t critical_path_budget0(const OwnerPlan& plan);    // one group per window
int64_t critical_path_unlimited(const OwnerPlan& plan);  // one window: the largest rank total
// The above over OwnerPlan::ideal_cost() (1 when there is no cost at all).
double critical_path_ratio(const OwnerPlan& plan,
                           const std::vector<std::pair<size_t, size_t>>& windows);
double critical_path_ratio_budget0(const OwnerPlan& plan);
double critical_path_ratio_unlimited(const OwnerPlan& plan);

}  // namespace fsdp_muon::detail
