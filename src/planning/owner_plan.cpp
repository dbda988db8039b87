// plan_owners(): the plan of docs/DESIGN.md §3 assembled from owner assignment
// (owner_assignment.cpp) and round packing (round_packing.cpp), and the cost-model search of
// docs/DESIGN.md §7 over byte limits.
#include <fsdp_muon/planning/owner_plan.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "common/check.h"
#include "common/enum_names.h"
#include "fsdp/flat_layout.h"
#include "planning/owner_plan_internal.h"

namespace fsdp_muon {
namespace {

using detail::assign_window;
using detail::assign_within_bytes;
using detail::bytes_per_rank;
using detail::finish_plan;
using detail::finish_rounds;
using detail::pack_rounds;
using detail::prefetch_windows;
using detail::rebalance;
using detail::rounds_from_windows;
using detail::window_peak_bytes;

void validate_matrix(const PlanMatrix& m, size_t g, size_t i, int world_size) {
  FSDP_MUON_CHECK(m.rows >= 0 && m.cols >= 0, "matrix '", m.name, "' (group ", g, ", index ", i,
                  ") has negative shape [", m.rows, ", ", m.cols, "]");
  FSDP_MUON_CHECK(m.newton_schulz.steps() >= 1, "matrix '", m.name, "' has ",
                  m.newton_schulz.steps(), " Newton-Schulz steps; it needs at least 1");
  FSDP_MUON_CHECK(static_cast<int>(m.held.size()) == world_size, "matrix '", m.name, "' has ",
                  m.held.size(), " held ranges; it needs one per rank (", world_size, ")");
  int64_t covered = 0;
  for (int r = 0; r < world_size; ++r) {
    const auto [first, second] = m.held[r];
    FSDP_MUON_CHECK(first <= second && first >= 0 && second <= m.rows * m.cols, "matrix '", m.name,
                    "' has an invalid held range [", first, ", ", second, ") on rank ", r);
    if (first < second) {
      FSDP_MUON_CHECK(first == covered, "the held ranges of matrix '", m.name,
                      "' do not tile it in rank order (rank ", r, " starts at ", first,
                      ", expected ", covered, ")");
      covered = second;
    }
  }
  FSDP_MUON_CHECK(covered == m.rows * m.cols, "the held ranges of matrix '", m.name, "' cover ",
                  covered, " of its ", m.rows * m.cols, " elements");
}

// The plan before any owner is chosen: every matrix validated and costed, totals at zero.
OwnerPlan unassigned_plan(const std::vector<PlanGroup>& groups, int world_size,
                          const OwnerPlanOptions& options, const CostRates& rates) {
  const size_t num_groups = groups.size();
  OwnerPlan plan;
  plan.world_size = world_size;
  plan.policy = options.owner_policy();
  plan.element_bytes = options.element_bytes();
  plan.owner.resize(num_groups);
  plan.cost.resize(num_groups);
  plan.group_cost_per_rank.assign(num_groups, std::vector<int64_t>(world_size, 0));
  plan.cost_per_rank.assign(world_size, 0);
  plan.group_full_bytes_per_rank.assign(num_groups, std::vector<int64_t>(world_size, 0));
  plan.gather_bytes_per_rank.assign(world_size, 0);
  plan.scatter_bytes_per_rank.assign(world_size, 0);
  plan.inter_node_bytes_per_rank.assign(world_size, 0);
  plan.mesh = MeshShape{1, world_size};
  plan.rates = rates;

  for (size_t g = 0; g < num_groups; ++g) {
    FSDP_MUON_CHECK(groups[g].element_bytes >= 0, "group '", groups[g].name,
                    "' has negative element_bytes");
    const auto& matrices = groups[g].matrices;
    plan.owner[g].assign(matrices.size(), -1);
    plan.cost[g].assign(matrices.size(), 0);
    for (size_t i = 0; i < matrices.size(); ++i) {
      const PlanMatrix& m = matrices[i];
      validate_matrix(m, g, i, world_size);
      plan.cost[g][i] = plan_matrix_flops(m);
    }
  }
  return plan;
}

void check_options(const OwnerPlanOptions& options, const CostRates& rates) {
  const int64_t budget = options.prefetch_budget_bytes();
  FSDP_MUON_CHECK(budget >= 0, "the prefetch budget must be >= 0 bytes, got ", budget,
                  " (use kUnlimitedPrefetch for no limit)");
  FSDP_MUON_CHECK(
      options.max_bytes_ratio() >= 1.0 || options.max_bytes_ratio() == kBytesRatioByCost,
      "max_bytes_ratio must be >= 1 (1: holders-only bytes, "
      "infinity: no limit) or kBytesRatioByCost, got ",
      options.max_bytes_ratio());
  FSDP_MUON_CHECK(rates.newton_schulz_flops_per_second() > 0 && rates.bytes_per_second() > 0 &&
                      rates.inter_node_bytes_per_second() > 0,
                  "the cost model's rates must be positive, got ",
                  rates.newton_schulz_flops_per_second(),
                  " FLOP/s (CostRates::newton_schulz_flops_per_second), ", rates.bytes_per_second(),
                  " B/s (bytes_per_second) and ", rates.inter_node_bytes_per_second(),
                  " B/s (inter_node_bytes_per_second)");
  FSDP_MUON_CHECK(rates.exchange_latency_seconds() >= 0,
                  "CostRates::exchange_latency_seconds must be >= 0, got ",
                  rates.exchange_latency_seconds());
}

// kRounds (docs/DESIGN.md §3): each rank's owned matrices of `plan` packed into rounds within
// `exchange_budget`. Without overlap, the fewest rounds that fit (a few more where that
// shortens the critical path); with it, the count among those asked for (1, 2, 4, ... 64, at
// most the most matrices a rank owns) whose pipelined_seconds() is lowest, a larger count only
// where at least 1% lower.
OwnerPlan rounds_by_cost(const std::vector<PlanGroup>& groups, const OwnerPlan& plan,
                         int64_t exchange_budget, const OwnerPlanOptions& options) {
  size_t most_owned = 0;
  {
    std::vector<size_t> owned(plan.world_size, 0);
    for (const auto& owners : plan.owner) {
      for (int o : owners) {
        if (o >= 0) most_owned = std::max(most_owned, ++owned[o]);
      }
    }
  }
  std::optional<OwnerPlan> best;
  double best_seconds = 0;
  for (size_t ask = 1;; ask *= 2) {
    OwnerPlan candidate = plan;
    pack_rounds(groups, exchange_budget, candidate, ask);
    finish_rounds(groups.size(), options.prefetch_budget_bytes(), options.overlap_communication(),
                  candidate);
    detail::transfer_seconds(groups, candidate);
    const double seconds = candidate.pipelined_seconds();
    // More rounds only where they are predicted at least 1% faster: a split that hides nothing
    // (sums equal but for rounding) must not win, and each round costs more than the model's
    // latency (its own layout, buffers and apply).
    if (!best || seconds < 0.99 * best_seconds) {
      best = std::move(candidate);
      best_seconds = seconds;
    }
    if (!options.overlap_communication() || ask >= 64 || ask >= most_owned) break;
  }
  return *best;
}

OwnerPlan plan_one_dimensional(const std::vector<PlanGroup>& groups, int world_size,
                               const OwnerPlanOptions& options, const CostRates& rates);

// docs/DESIGN.md §7: one plan per candidate limit, the cheapest wins, the smaller limit on a
// tie. Every rank computes the same plans, so every rank picks the same one.
OwnerPlan cheapest_by_cost_model(const std::vector<PlanGroup>& groups, int world_size,
                                 const OwnerPlanOptions& options, const CostRates& rates) {
  std::optional<OwnerPlan> best;
  double best_seconds = 0;
  for (const double ratio : detail::kCostModelBytesRatios) {
    OwnerPlan candidate = plan_one_dimensional(
        groups, world_size, OwnerPlanOptions(options).max_bytes_ratio(ratio), rates);
    const double seconds = candidate.estimated_seconds();
    if (!best || seconds < best_seconds) {
      best = std::move(candidate);
      best_seconds = seconds;
    }
  }
  return *best;
}

// The owner plans a schedule is cut from, each finished (docs/DESIGN.md §3): loads carried
// across all groups; under kBalanced two starts, each improved by moves and swaps: holders-only
// (few bytes) and every matrix placed within the byte limit (better balance where whole local
// matrices must move).
std::vector<OwnerPlan> owner_starts(const std::vector<PlanGroup>& groups, const OwnerPlan& plan,
                                    const OwnerPlanOptions& options) {
  OwnerPlan carried = plan;
  assign_window(groups, 0, groups.size(), carried);
  std::vector<OwnerPlan> starts;
  if (plan.policy != OwnerPolicy::kBalanced) {
    finish_plan(groups, carried);
    starts.push_back(carried);
    return starts;
  }
  const double max_bytes =
      options.max_bytes_ratio() * static_cast<double>(plan.holders_only_max_bytes);
  starts.push_back(carried);
  starts.push_back(plan);
  assign_within_bytes(groups, max_bytes, starts.back());
  for (OwnerPlan& start : starts) {
    rebalance(groups, max_bytes, start);
    finish_plan(groups, start);
  }
  // The second start may have had to exceed the limit (a matrix no rank could take within it).
  if (static_cast<double>(starts.back().max_bytes_per_rank()) > max_bytes) starts.pop_back();
  return starts;
}

// The shortest critical path of the schedule wins, the first on a tie.
const OwnerPlan& shortest(const std::vector<OwnerPlan>& plans) {
  size_t best = 0;
  for (size_t k = 0; k < plans.size(); ++k) {
    if (plans[k].critical_path_planned() < plans[best].critical_path_planned()) best = k;
  }
  return plans[best];
}

// kWindows: each start cut into windows by the budget; with a finite budget and no byte limit
// to keep, also the plan re-assigned window by window, growing a window one group at a time
// while every rank's owned full matrices in it fit the budget (a group that alone exceeds it
// runs alone).
OwnerPlan plan_in_windows(const std::vector<PlanGroup>& groups, const OwnerPlan& plan,
                          std::vector<OwnerPlan> starts, int64_t exchange_budget,
                          const OwnerPlanOptions& options) {
  const size_t num_groups = groups.size();
  const int64_t budget = options.prefetch_budget_bytes();
  for (OwnerPlan& start : starts) {
    start.windows = prefetch_windows(start, exchange_budget);
    rounds_from_windows(groups, start);
    finish_rounds(num_groups, budget, options.overlap_communication(), start);
  }
  const OwnerPlan& carried = shortest(starts);
  if (exchange_budget == kUnlimitedPrefetch || plan.policy == OwnerPolicy::kBalanced) {
    return carried;
  }
  OwnerPlan windowed = plan;
  size_t first = 0;
  while (first < num_groups) {
    assign_window(groups, first, first + 1, windowed);
    size_t last = first + 1;
    while (last < num_groups) {
      OwnerPlan trial = windowed;
      assign_window(groups, first, last + 1, trial);
      if (window_peak_bytes(groups, first, last + 1, trial) > exchange_budget) break;
      windowed = std::move(trial);
      ++last;
    }
    windowed.windows.emplace_back(first, last);
    first = last;
  }
  finish_plan(groups, windowed);
  rounds_from_windows(groups, windowed);
  finish_rounds(num_groups, budget, options.overlap_communication(), windowed);
  // Both are greedy; neither wins everywhere (LPT under holder constraints is no optimum), so
  // keep the shorter critical path, the carried plan on a tie. Every rank picks the same one.
  return windowed.critical_path_planned() < carried.critical_path_planned() ? windowed : carried;
}

// The plan over `world_size` ranks of one replica (the 1-D plan of docs/DESIGN.md §3).
OwnerPlan plan_shard_ranks(const std::vector<PlanGroup>& groups, int world_size,
                           const OwnerPlanOptions& options, const CostRates& rates) {
  OwnerPlan plan = unassigned_plan(groups, world_size, options, rates);
  check_options(options, rates);
  if (options.owner_policy() == OwnerPolicy::kBalanced &&
      options.max_bytes_ratio() == kBytesRatioByCost) {
    return cheapest_by_cost_model(groups, world_size, options, rates);
  }
  // Two exchanges in flight share the budget (docs/DESIGN.md §3).
  const int64_t budget = options.prefetch_budget_bytes();
  const int64_t exchange_budget =
      options.overlap_communication() && budget != kUnlimitedPrefetch ? budget / 2 : budget;
  plan.schedule = options.owner_schedule();
  if (plan.policy == OwnerPolicy::kBalanced) plan.max_bytes_ratio = options.max_bytes_ratio();
  {
    OwnerPlan holders = plan;
    holders.policy = OwnerPolicy::kHoldersOnly;
    assign_window(groups, 0, groups.size(), holders);
    const std::vector<int64_t> bytes = bytes_per_rank(groups, holders);
    plan.holders_only_max_bytes = bytes.empty() ? 0 : *std::max_element(bytes.begin(), bytes.end());
  }
  std::vector<OwnerPlan> starts = owner_starts(groups, plan, options);
  if (plan.schedule == OwnerSchedule::kWindows) {
    return plan_in_windows(groups, plan, std::move(starts), exchange_budget, options);
  }
  for (OwnerPlan& start : starts) start = rounds_by_cost(groups, start, exchange_budget, options);
  if (!options.overlap_communication()) return shortest(starts);
  // With overlap the rounds were chosen by the timeline; so is the start (the first on a tie).
  size_t best = 0;
  for (size_t k = 1; k < starts.size(); ++k) {
    if (starts[k].pipelined_seconds() < starts[best].pipelined_seconds()) best = k;
  }
  return starts[best];
}

OwnerPlan plan_one_dimensional(const std::vector<PlanGroup>& groups, int world_size,
                               const OwnerPlanOptions& options, const CostRates& rates) {
  OwnerPlan plan = plan_shard_ranks(groups, world_size, options, rates);
  detail::transfer_seconds(groups, plan);
  return plan;
}

// A matrix the shard plan gave to a shard rank, to be spread over the replicas.
struct Owned {
  int64_t cost;
  size_t group;
  size_t index;
};

// kOncePerWorldRelay's spread of one window (owned[s]: shard rank s's matrices): the relay's
// stage B has rank (r, h) send replicas - 1 copies of its pieces of every matrix owned in
// replica r, so a replica's matrices are its shard ranks' inter-node bytes. All matrices, by
// descending cost (ties: group, index), each to the replica (keeping its shard rank) that raises
// the busiest Newton–Schulz seconds plus the busiest stage-B seconds least at `rates` (ties: the
// lower sum of the two there, then the lowest replica).
void spread_for_relay(const std::vector<PlanGroup>& groups, MeshShape mesh, const CostRates& rates,
                      const std::vector<std::vector<Owned>>& owned, OwnerPlan& plan) {
  const int shard_size = mesh.shard_size;
  std::vector<std::pair<int, Owned>> all;  // (shard rank, matrix)
  for (int s = 0; s < shard_size; ++s) {
    for (const Owned& o : owned[s]) all.emplace_back(s, o);
  }
  std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return std::make_tuple(-a.second.cost, a.second.group, a.second.index) <
           std::make_tuple(-b.second.cost, b.second.group, b.second.index);
  });
  const double ns_rate = rates.newton_schulz_flops_per_second();
  const double inter_rate =
      rates.inter_node_bytes_per_second() / static_cast<double>(mesh.replicas - 1);
  std::vector<int64_t> ns(mesh.world_size(), 0);     // [world rank] FLOPs
  std::vector<int64_t> bytes(mesh.world_size(), 0);  // [world rank] pieces relayed, bytes
  double ns_max = 0, bytes_max = 0;                  // seconds
  std::vector<int64_t> piece(shard_size);
  for (const auto& [s, o] : all) {
    const PlanMatrix& m = groups[o.group].matrices[o.index];
    const int64_t eb = detail::group_element_bytes(groups[o.group], plan);
    for (int h = 0; h < shard_size; ++h) piece[h] = detail::held_numel(m, h) * eb;
    int best = 0;
    double best_raise = 0, best_sum = 0;
    for (int r = 0; r < mesh.replicas; ++r) {
      const double ns_new = static_cast<double>(ns[r * shard_size + s] + o.cost) / ns_rate;
      int64_t most = 0;
      for (int h = 0; h < shard_size; ++h) {
        most = std::max(most, bytes[r * shard_size + h] + piece[h]);
      }
      const double bytes_new = static_cast<double>(most) / inter_rate;
      const double raise = std::max(ns_max, ns_new) + std::max(bytes_max, bytes_new);
      const double sum = ns_new + bytes_new;
      if (r == 0 || raise < best_raise || (raise == best_raise && sum < best_sum)) {
        best = r;
        best_raise = raise;
        best_sum = sum;
      }
    }
    const int w = best * shard_size + s;
    ns[w] += o.cost;
    ns_max = std::max(ns_max, static_cast<double>(ns[w]) / ns_rate);
    for (int h = 0; h < shard_size; ++h) {
      bytes[best * shard_size + h] += piece[h];
      bytes_max =
          std::max(bytes_max, static_cast<double>(bytes[best * shard_size + h]) / inter_rate);
    }
    plan.owner[o.group][o.index] = w;
  }
}

// kOncePerWorld on `mesh` (replicas > 1; docs/DESIGN.md §7): the shard plan's owners, each shard
// rank's matrices spread over the replicas, by descending cost (ties: group, index) to the
// least-loaded replica (ties: the lowest), loads fresh at every window of the shard plan (ranks
// meet at each); then the rounds are cut over all world ranks as the shard plan's schedule
// says. A matrix's inter-node bytes are (replicas - 1) x its size whoever owns it; who sends them
// depends on the spread (direct: the owner; relay: the holders in the owner's replica, so the
// relay spreads by Newton–Schulz and relayed bytes together: spread_for_relay).
//
// `mode` is kOncePerWorld (the owner scatters to every replica) or kOncePerWorldRelay (to its own
// replica, and each holder there on to its shard rank in the others): the same owners and rounds,
// the bytes and the scatter's seconds of the mode.
OwnerPlan plan_once_per_world(const std::vector<PlanGroup>& groups, MeshShape mesh,
                              const OwnerPlanOptions& options, const CostRates& rates,
                              ReplicaNewtonSchulz mode) {
  if (options.owner_policy() == OwnerPolicy::kBalanced &&
      options.max_bytes_ratio() == kBytesRatioByCost) {
    // The byte limit of the shard plan, chosen by the two-level cost of the world plan.
    std::optional<OwnerPlan> best;
    double best_seconds = 0;
    for (const double ratio : detail::kCostModelBytesRatios) {
      OwnerPlan candidate = plan_once_per_world(
          groups, mesh, OwnerPlanOptions(options).max_bytes_ratio(ratio), rates, mode);
      const double seconds = candidate.estimated_seconds();
      if (!best || seconds < best_seconds) {
        best = std::move(candidate);
        best_seconds = seconds;
      }
    }
    return *best;
  }
  const OwnerPlan shard = plan_one_dimensional(groups, mesh.shard_size, options, rates);
  const int world_size = mesh.world_size();
  const size_t num_groups = groups.size();
  OwnerPlan plan;
  plan.world_size = world_size;
  plan.mesh = mesh;
  plan.replica_newton_schulz = mode;
  plan.rates = shard.rates;
  plan.policy = shard.policy;
  plan.schedule = shard.schedule;
  plan.element_bytes = shard.element_bytes;
  plan.holders_only_max_bytes = shard.holders_only_max_bytes;
  plan.max_bytes_ratio = shard.max_bytes_ratio;
  plan.cost = shard.cost;
  plan.owner = shard.owner;
  plan.group_cost_per_rank.assign(num_groups, std::vector<int64_t>(world_size, 0));
  plan.cost_per_rank.assign(world_size, 0);
  plan.group_full_bytes_per_rank.assign(num_groups, std::vector<int64_t>(world_size, 0));
  plan.gather_bytes_per_rank.assign(world_size, 0);
  plan.scatter_bytes_per_rank.assign(world_size, 0);
  plan.inter_node_bytes_per_rank.assign(world_size, 0);
  const std::vector<std::pair<size_t, size_t>> spread_windows =
      shard.schedule == OwnerSchedule::kWindows
          ? shard.windows
          : std::vector<std::pair<size_t, size_t>>{{0, num_groups}};
  for (const auto& [first, last] : spread_windows) {
    std::vector<std::vector<Owned>> owned(mesh.shard_size);
    for (size_t g = first; g < last; ++g) {
      for (size_t i = 0; i < shard.owner[g].size(); ++i) {
        if (shard.owner[g][i] >= 0) owned[shard.owner[g][i]].push_back({shard.cost[g][i], g, i});
      }
    }
    if (mode == ReplicaNewtonSchulz::kOncePerWorldRelay) {
      spread_for_relay(groups, mesh, rates, owned, plan);
      continue;
    }
    for (int s = 0; s < mesh.shard_size; ++s) {
      std::stable_sort(owned[s].begin(), owned[s].end(), [](const Owned& a, const Owned& b) {
        return std::make_tuple(-a.cost, a.group, a.index) <
               std::make_tuple(-b.cost, b.group, b.index);
      });
      std::vector<int64_t> load(mesh.replicas, 0);
      for (const Owned& o : owned[s]) {
        const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
        load[r] += o.cost;
        plan.owner[o.group][o.index] = r * mesh.shard_size + s;
      }
    }
  }
  detail::finish_world_plan(groups, plan);
  const int64_t budget = options.prefetch_budget_bytes();
  const int64_t exchange_budget =
      options.overlap_communication() && budget != kUnlimitedPrefetch ? budget / 2 : budget;
  if (plan.schedule == OwnerSchedule::kRounds) {
    return rounds_by_cost(groups, plan, exchange_budget, options);
  }
  plan.windows = shard.windows;
  rounds_from_windows(groups, plan);
  finish_rounds(num_groups, budget, options.overlap_communication(), plan);
  detail::transfer_seconds(groups, plan);
  return plan;
}

constexpr detail::EnumName<ReplicaNewtonSchulz> kReplicaNames[] = {
    {ReplicaNewtonSchulz::kOncePerWorld, "once_per_world"},
    {ReplicaNewtonSchulz::kOncePerReplica, "once_per_replica"},
    {ReplicaNewtonSchulz::kByCost, "by_cost"},
    {ReplicaNewtonSchulz::kOncePerWorldRelay, "once_per_world_relay"},
};
static_assert(detail::rows_in_enumerator_order(kReplicaNames));

constexpr detail::EnumName<OwnerSchedule> kScheduleNames[] = {
    {OwnerSchedule::kWindows, "windows"},
    {OwnerSchedule::kRounds, "rounds"},
};
static_assert(detail::rows_in_enumerator_order(kScheduleNames));

constexpr detail::EnumName<OwnerPolicy> kPolicyNames[] = {
    {OwnerPolicy::kHoldersOnly, "holders_only"},
    {OwnerPolicy::kAnyRank, "any_rank"},
    {OwnerPolicy::kBalanced, "balanced"},
};
static_assert(detail::rows_in_enumerator_order(kPolicyNames));

}  // namespace

const char* to_string(OwnerSchedule schedule) { return detail::name_of(kScheduleNames, schedule); }

const char* to_string(OwnerPolicy policy) { return detail::name_of(kPolicyNames, policy); }

const char* to_string(ReplicaNewtonSchulz mode) { return detail::name_of(kReplicaNames, mode); }

int64_t newton_schulz_flops(int64_t rows, int64_t cols, int64_t steps) {
  const int64_t m = std::min(rows, cols);
  const int64_t n = std::max(rows, cols);
  return steps * (4 * m * m * n + 2 * m * m * m);
}

int64_t plan_matrix_flops(const PlanMatrix& m) {
  return static_cast<int64_t>(std::llround(newton_schulz_flops(m.rows, m.cols, m.newton_schulz)));
}

OwnerPlan plan_owners(const std::vector<PlanGroup>& groups, int world_size,
                      const OwnerPlanOptions& options, const CostRates& rates) {
  FSDP_MUON_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size);
  return plan_owners(groups, MeshShape{1, world_size}, options, rates);
}

OwnerPlan plan_owners(const std::vector<PlanGroup>& groups, MeshShape mesh,
                      const OwnerPlanOptions& options, const CostRates& rates) {
  FSDP_MUON_CHECK(mesh.replicas >= 1 && mesh.shard_size >= 1,
                  "the mesh needs at least one replica and one shard rank, got ", mesh.replicas,
                  "x", mesh.shard_size, " (replicas x shard size)");
  FSDP_MUON_CHECK(options.element_bytes() >= 1, "element_bytes must be >= 1");
  const ReplicaNewtonSchulz mode = options.replica_newton_schulz();
  const auto once_per_replica = [&] {
    OwnerPlan plan = plan_one_dimensional(groups, mesh.shard_size, options, rates);
    plan.mesh = mesh;
    plan.replica_newton_schulz = ReplicaNewtonSchulz::kOncePerReplica;
    return plan;
  };
  const bool world_mode =
      mode == ReplicaNewtonSchulz::kOncePerWorld || mode == ReplicaNewtonSchulz::kOncePerWorldRelay;
  if (mesh.replicas == 1) {
    // One replica: all are the same plan over all ranks.
    OwnerPlan plan = once_per_replica();
    if (world_mode) plan.replica_newton_schulz = mode;
    return plan;
  }
  if (mode == ReplicaNewtonSchulz::kOncePerReplica) return once_per_replica();
  if (world_mode) return plan_once_per_world(groups, mesh, options, rates, mode);
  FSDP_MUON_CHECK(mode == ReplicaNewtonSchulz::kByCost, "unknown replica_newton_schulz value ",
                  static_cast<int>(mode));
  OwnerPlan replica = once_per_replica();
  OwnerPlan direct =
      plan_once_per_world(groups, mesh, options, rates, ReplicaNewtonSchulz::kOncePerWorld);
  OwnerPlan relay =
      plan_once_per_world(groups, mesh, options, rates, ReplicaNewtonSchulz::kOncePerWorldRelay);
  // Every rank computes all three from the same numbers, so every rank picks the same one:
  // the cheapest, kOncePerReplica on a tie, then direct before the relay.
  OwnerPlan& world = relay.estimated_seconds() < direct.estimated_seconds() ? relay : direct;
  return world.estimated_seconds() < replica.estimated_seconds() ? std::move(world)
                                                                 : std::move(replica);
}

PlanGroup plan_group_from_shapes(
    const std::string& name,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& named_shapes, int world_size,
    const NewtonSchulzOptions& newton_schulz, c10::ScalarType compute_dtype,
    int64_t alignment_bytes) {
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
    m.newton_schulz = newton_schulz;
    for (int r = 0; r < world_size; ++r) m.held.push_back(layout.held_range(i, r));
    group.matrices.push_back(std::move(m));
  }
  return group;
}

}  // namespace fsdp_muon
