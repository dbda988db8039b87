#include <fsdp_muon/optimizer/owner_plan.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <tuple>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "fsdp/flat_layout.h"

namespace fsdp_muon {
namespace {

int64_t held_numel(const PlanMatrix& m, int rank) {
  return m.held[rank].second - m.held[rank].first;
}

void validate_matrix(const PlanMatrix& m, size_t g, size_t i, int world_size) {
  TORCH_CHECK(m.rows >= 0 && m.cols >= 0, "fsdp_muon::plan_owners: matrix '", m.name, "' (group ",
              g, ", index ", i, ") has negative shape [", m.rows, ", ", m.cols, "]");
  TORCH_CHECK(m.ns_steps >= 1, "fsdp_muon::plan_owners: matrix '", m.name, "' has ns_steps ",
              m.ns_steps, "; it needs at least 1");
  TORCH_CHECK(static_cast<int>(m.held.size()) == world_size, "fsdp_muon::plan_owners: matrix '",
              m.name, "' has ", m.held.size(), " held ranges; it needs one per rank (", world_size,
              ")");
  int64_t covered = 0;
  for (int r = 0; r < world_size; ++r) {
    const auto [first, second] = m.held[r];
    TORCH_CHECK(first <= second && first >= 0 && second <= m.rows * m.cols,
                "fsdp_muon::plan_owners: matrix '", m.name, "' has an invalid held range [", first,
                ", ", second, ") on rank ", r);
    if (first < second) {
      TORCH_CHECK(first == covered, "fsdp_muon::plan_owners: the held ranges of matrix '", m.name,
                  "' do not tile it in rank order (rank ", r, " starts at ", first, ", expected ",
                  covered, ")");
      covered = second;
    }
  }
  TORCH_CHECK(covered == m.rows * m.cols, "fsdp_muon::plan_owners: the held ranges of matrix '",
              m.name, "' cover ", covered, " of its ", m.rows * m.cols, " elements");
}

double ratio(double value, double ideal) { return ideal > 0 ? value / ideal : 1.0; }

int64_t group_element_bytes(const PlanGroup& group, const OwnerPlan& plan) {
  return group.element_bytes > 0 ? group.element_bytes : plan.element_bytes;
}

// Owners for the matrices of groups [first, last), balanced among themselves (fresh loads):
// ranks meet at every window, so only the load inside a window is on the critical path. Local
// matrices go to their only holder first; the others, by descending cost (ties: group, then
// index), to the least-loaded eligible rank.
void assign_window(const std::vector<PlanGroup>& groups, size_t first, size_t last,
                   OwnerPlan& plan) {
  const int world_size = plan.world_size;
  std::vector<int64_t> load(world_size, 0);
  struct Candidate {
    int64_t cost;
    size_t group;
    size_t index;
  };
  std::vector<Candidate> boundary;
  for (size_t g = first; g < last; ++g) {
    const auto& matrices = groups[g].matrices;
    for (size_t i = 0; i < matrices.size(); ++i) {
      const PlanMatrix& m = matrices[i];
      plan.owner[g][i] = -1;
      if (m.rows * m.cols == 0) continue;  // nothing to orthogonalize, nobody owns it
      int holders = 0;
      int only = -1;
      for (int r = 0; r < world_size; ++r) {
        if (held_numel(m, r) > 0) {
          ++holders;
          only = r;
        }
      }
      if (holders == 1) {
        plan.owner[g][i] = only;
        load[only] += plan.cost[g][i];
      } else {
        boundary.push_back({plan.cost[g][i], g, i});
      }
    }
  }
  std::stable_sort(boundary.begin(), boundary.end(), [](const Candidate& a, const Candidate& b) {
    return std::make_tuple(-a.cost, a.group, a.index) < std::make_tuple(-b.cost, b.group, b.index);
  });
  for (const Candidate& c : boundary) {
    const PlanMatrix& m = groups[c.group].matrices[c.index];
    int best = -1;
    for (int r = 0; r < world_size; ++r) {
      const int64_t held = held_numel(m, r);
      if (plan.policy == OwnerPolicy::kHoldersOnly && held == 0) continue;
      if (best < 0 || load[r] < load[best]) {
        best = r;
      } else if (plan.policy == OwnerPolicy::kAnyRank && load[r] == load[best] &&
                 held > held_numel(m, best)) {
        // Equal load: the rank already holding more of the matrix moves fewer bytes.
        best = r;
      }
    }
    plan.owner[c.group][c.index] = best;
    load[best] += c.cost;
  }
}

// Largest per-rank sum of owned full-matrix bytes over groups [first, last).
int64_t window_peak_bytes(const std::vector<PlanGroup>& groups, size_t first, size_t last,
                          const OwnerPlan& plan) {
  std::vector<int64_t> bytes(plan.world_size, 0);
  for (size_t g = first; g < last; ++g) {
    const int64_t element_bytes = group_element_bytes(groups[g], plan);
    for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
      const PlanMatrix& m = groups[g].matrices[i];
      if (plan.owner[g][i] >= 0) bytes[plan.owner[g][i]] += m.rows * m.cols * element_bytes;
    }
  }
  return *std::max_element(bytes.begin(), bytes.end());
}

// Per-rank and per-group totals and bytes of a plan whose owners are set.
void finish_plan(const std::vector<PlanGroup>& groups, OwnerPlan& plan) {
  const int world_size = plan.world_size;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& matrices = groups[g].matrices;
    const int64_t element_bytes = group_element_bytes(groups[g], plan);
    for (size_t i = 0; i < matrices.size(); ++i) {
      const int o = plan.owner[g][i];
      if (o < 0) continue;
      const PlanMatrix& m = matrices[i];
      plan.cost_per_rank[o] += plan.cost[g][i];
      plan.group_cost_per_rank[g][o] += plan.cost[g][i];
      plan.group_full_bytes_per_rank[g][o] += m.rows * m.cols * element_bytes;
      for (int r = 0; r < world_size; ++r) {
        if (r == o) continue;
        const int64_t bytes = held_numel(m, r) * element_bytes;
        plan.gather_bytes_per_rank[r] += bytes;   // r sends its piece to the owner
        plan.scatter_bytes_per_rank[o] += bytes;  // and the owner sends r its update slice
      }
    }
    const auto& per_rank = plan.group_cost_per_rank[g];
    const int64_t total = std::accumulate(per_rank.begin(), per_rank.end(), int64_t{0});
    const int64_t largest = *std::max_element(per_rank.begin(), per_rank.end());
    plan.group_balance.push_back(
        ratio(static_cast<double>(largest), static_cast<double>(total) / world_size));
  }
}

}  // namespace

const char* to_string(OwnerPolicy policy) {
  switch (policy) {
    case OwnerPolicy::kHoldersOnly:
      return "holders_only";
    case OwnerPolicy::kAnyRank:
      return "any_rank";
  }
  return "unknown";
}

int64_t newton_schulz_flops(int64_t rows, int64_t cols, int64_t steps) {
  const int64_t m = std::min(rows, cols);
  const int64_t n = std::max(rows, cols);
  return steps * (4 * m * m * n + 2 * m * m * m);
}

OwnerPlan plan_owners(const std::vector<PlanGroup>& groups, int world_size,
                      const OwnerPlanOptions& options) {
  TORCH_CHECK(world_size >= 1, "fsdp_muon::plan_owners: world size must be at least 1, got ",
              world_size);
  TORCH_CHECK(options.element_bytes() >= 1, "fsdp_muon::plan_owners: element_bytes must be >= 1");
  const size_t num_groups = groups.size();
  OwnerPlan plan;
  plan.world_size = world_size;
  plan.policy = options.policy();
  plan.element_bytes = options.element_bytes();
  plan.owner.resize(num_groups);
  plan.cost.resize(num_groups);
  plan.group_cost_per_rank.assign(num_groups, std::vector<int64_t>(world_size, 0));
  plan.cost_per_rank.assign(world_size, 0);
  plan.group_full_bytes_per_rank.assign(num_groups, std::vector<int64_t>(world_size, 0));
  plan.gather_bytes_per_rank.assign(world_size, 0);
  plan.scatter_bytes_per_rank.assign(world_size, 0);

  for (size_t g = 0; g < num_groups; ++g) {
    TORCH_CHECK(groups[g].element_bytes >= 0, "fsdp_muon::plan_owners: group '", groups[g].name,
                "' has negative element_bytes");
    const auto& matrices = groups[g].matrices;
    plan.owner[g].assign(matrices.size(), -1);
    plan.cost[g].assign(matrices.size(), 0);
    for (size_t i = 0; i < matrices.size(); ++i) {
      const PlanMatrix& m = matrices[i];
      validate_matrix(m, g, i, world_size);
      plan.cost[g][i] = newton_schulz_flops(m.rows, m.cols, m.ns_steps);
    }
  }

  const int64_t budget = options.prefetch_budget_bytes();
  TORCH_CHECK(budget >= 0, "fsdp_muon::plan_owners: the prefetch budget must be >= 0 bytes, got ",
              budget, " (use kUnlimitedPrefetch for no limit)");
  // The plan of docs/DESIGN.md §3: loads carried across all groups, then cut into windows by the
  // budget.
  OwnerPlan carried = plan;
  assign_window(groups, 0, num_groups, carried);
  finish_plan(groups, carried);
  if (budget == kUnlimitedPrefetch) {
    carried.windows = {{0, num_groups}};
    return carried;
  }
  carried.windows = prefetch_windows(carried, budget);

  // Window by window: grow a window one group at a time, re-planning it, while every rank's
  // owned full matrices in it fit the budget (a group that alone exceeds it runs alone).
  OwnerPlan windowed = plan;
  size_t first = 0;
  while (first < num_groups) {
    assign_window(groups, first, first + 1, windowed);
    size_t last = first + 1;
    while (last < num_groups) {
      OwnerPlan trial = windowed;
      assign_window(groups, first, last + 1, trial);
      if (window_peak_bytes(groups, first, last + 1, trial) > budget) break;
      windowed = std::move(trial);
      ++last;
    }
    windowed.windows.emplace_back(first, last);
    first = last;
  }
  finish_plan(groups, windowed);
  // Both are greedy; neither wins everywhere (LPT under holder constraints is no optimum), so
  // keep the shorter critical path, the carried plan on a tie. Every rank picks the same one.
  return windowed.critical_path_planned() < carried.critical_path_planned() ? windowed : carried;
}

int64_t OwnerPlan::total_cost() const {
  return std::accumulate(cost_per_rank.begin(), cost_per_rank.end(), int64_t{0});
}

int64_t OwnerPlan::largest_matrix_cost() const {
  int64_t largest = 0;
  for (const auto& costs : cost) {
    for (int64_t c : costs) largest = std::max(largest, c);
  }
  return largest;
}

double OwnerPlan::ideal_cost() const { return static_cast<double>(total_cost()) / world_size; }

int64_t OwnerPlan::critical_path(const std::vector<std::pair<size_t, size_t>>& windows) const {
  int64_t path = 0;
  for (const auto& [first, last] : windows) {
    TORCH_CHECK(first <= last && last <= group_cost_per_rank.size(),
                "fsdp_muon::OwnerPlan::critical_path_ratio: window [", first, ", ", last,
                ") outside the ", group_cost_per_rank.size(), " groups");
    int64_t slowest = 0;
    for (int r = 0; r < world_size; ++r) {
      int64_t load = 0;
      for (size_t g = first; g < last; ++g) load += group_cost_per_rank[g][r];
      slowest = std::max(slowest, load);
    }
    path += slowest;
  }
  return path;
}

int64_t OwnerPlan::critical_path_planned() const { return critical_path(windows); }

double OwnerPlan::critical_path_ratio_planned() const {
  return ratio(static_cast<double>(critical_path_planned()), ideal_cost());
}

int64_t OwnerPlan::critical_path_budget0() const {
  return critical_path(prefetch_windows(*this, 0));
}

int64_t OwnerPlan::critical_path_unlimited() const {
  return critical_path({{0, group_cost_per_rank.size()}});
}

double OwnerPlan::critical_path_ratio(const std::vector<std::pair<size_t, size_t>>& windows) const {
  return ratio(static_cast<double>(critical_path(windows)), ideal_cost());
}

double OwnerPlan::critical_path_ratio_budget0() const {
  return ratio(static_cast<double>(critical_path_budget0()), ideal_cost());
}

double OwnerPlan::critical_path_ratio_unlimited() const {
  return ratio(static_cast<double>(critical_path_unlimited()), ideal_cost());
}

double OwnerPlan::floor_ratio() const {
  const double ideal = ideal_cost();
  return ratio(std::max(ideal, static_cast<double>(largest_matrix_cost())), ideal);
}

int64_t OwnerPlan::max_bytes_per_rank() const {
  int64_t most = 0;
  for (int r = 0; r < world_size; ++r) {
    most = std::max(most, gather_bytes_per_rank[r] + scatter_bytes_per_rank[r]);
  }
  return most;
}

std::string OwnerPlan::summary() const {
  std::ostringstream out;
  out << "owner plan: policy " << to_string(policy) << ", world size " << world_size << ", "
      << owner.size() << " groups, total " << static_cast<double>(total_cost()) << " NS FLOPs\n"
      << "  critical path / ideal: planned windows (" << windows.size() << ") "
      << critical_path_ratio_planned() << ", one group at a time " << critical_path_ratio_budget0()
      << ", all at once " << critical_path_ratio_unlimited() << ", floor " << floor_ratio() << "\n"
      << "  gather + scatter bytes per rank:";
  for (int r = 0; r < world_size; ++r) {
    out << " " << gather_bytes_per_rank[r] + scatter_bytes_per_rank[r];
  }
  out << "\n  cost per rank:";
  for (int r = 0; r < world_size; ++r) out << " " << static_cast<double>(cost_per_rank[r]);
  out << "\n";
  return out.str();
}

std::vector<std::pair<size_t, size_t>> prefetch_windows(const OwnerPlan& plan,
                                                        int64_t budget_bytes) {
  TORCH_CHECK(budget_bytes >= 0,
              "fsdp_muon::prefetch_windows: the prefetch budget must be >= 0 bytes, got ",
              budget_bytes, " (use kUnlimitedPrefetch for no limit)");
  const size_t num_groups = plan.group_full_bytes_per_rank.size();
  std::vector<std::pair<size_t, size_t>> windows;
  size_t first = 0;
  while (first < num_groups) {
    std::vector<int64_t> held(plan.world_size, 0);
    size_t last = first;
    while (last < num_groups) {
      bool fits = true;
      for (int r = 0; r < plan.world_size; ++r) {
        // Saturating: an unlimited budget must not overflow into a negative comparison.
        const int64_t add = plan.group_full_bytes_per_rank[last][r];
        if (held[r] > budget_bytes - add) fits = false;
      }
      if (!fits && last > first) break;
      for (int r = 0; r < plan.world_size; ++r) held[r] += plan.group_full_bytes_per_rank[last][r];
      ++last;
      if (!fits) break;  // a single group over budget still runs, alone
    }
    windows.emplace_back(first, last);
    first = last;
  }
  return windows;
}

PlanGroup plan_group_from_shapes(
    const std::string& name,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& named_shapes, int world_size,
    int64_t ns_steps, c10::ScalarType compute_dtype, int64_t alignment_bytes) {
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(compute_dtype));
  const int64_t alignment = std::max<int64_t>(1, alignment_bytes / element_size);
  const fsdp::FlatLayout layout = fsdp::compute_flat_layout(named_shapes, alignment, world_size);
  PlanGroup group;
  group.name = name;
  for (size_t i = 0; i < layout.slots.size(); ++i) {
    const ParameterSlot& slot = layout.slots[i];
    if (slot.shape.size() != 2) continue;
    PlanMatrix m;
    m.name = slot.name;
    m.rows = slot.shape[0];
    m.cols = slot.shape[1];
    m.ns_steps = ns_steps;
    for (int r = 0; r < world_size; ++r) m.held.push_back(layout.held_range(i, r));
    group.matrices.push_back(std::move(m));
  }
  return group;
}

}  // namespace fsdp_muon
