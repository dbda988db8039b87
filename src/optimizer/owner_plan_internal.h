#pragma once
// The steps plan_owners() composes (docs/DESIGN.md §3), shared by its translation units:
// owner assignment (owner_assignment.cpp), round packing (round_packing.cpp) and the metrics of
// a finished plan (owner_plan_metrics.cpp). Pure functions of the plan and the groups.

#include <cstddef>
#include <cstdint>
#include <vector>

#include <fsdp_muon/optimizer/owner_plan.h>

namespace fsdp_muon::detail {

inline int64_t held_numel(const PlanMatrix& m, int rank) {
  return m.held[rank].second - m.held[rank].first;
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
// Gather + scatter bytes each rank sends under `plan.owner` (every matrix active).
std::vector<int64_t> bytes_per_rank(const std::vector<PlanGroup>& groups, const OwnerPlan& plan);
// kBalanced: moves and swaps from the busiest rank while every rank's bytes stay in `max_bytes`.
void rebalance(const std::vector<PlanGroup>& groups, double max_bytes, OwnerPlan& plan);
// kBalanced's second start: every matrix to the least-loaded rank within `max_bytes`.
void assign_within_bytes(const std::vector<PlanGroup>& groups, double max_bytes, OwnerPlan& plan);

// ---- round packing (round_packing.cpp) ----

// kRounds: the fewest rounds within `round_budget` bytes per rank, packed longest first.
void pack_rounds(const std::vector<PlanGroup>& groups, int64_t round_budget, OwnerPlan& plan);
// kWindows: one round per window of `plan.windows`, its groups' matrices.
void rounds_from_windows(const std::vector<PlanGroup>& groups, OwnerPlan& plan);
// Which round completes each group, and which rounds overlap the next.
void finish_rounds(size_t num_groups, int64_t budget, bool overlap, OwnerPlan& plan);

}  // namespace fsdp_muon::detail
