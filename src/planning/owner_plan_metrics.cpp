// What a finished plan costs: critical paths, bytes and the summary the benchmarks print.
#include <algorithm>
#include <numeric>
#include <sstream>

#include <c10/util/Exception.h>

#include "common/check.h"
#include "planning/owner_plan_internal.h"

namespace fsdp_muon {

using detail::ratio;

double OwnerPlan::estimated_seconds(const CostRates& at) const {
  return static_cast<double>(critical_path_planned()) / at.newton_schulz_flops_per_second() +
         static_cast<double>(max_intra_node_bytes_per_rank()) / at.bytes_per_second() +
         static_cast<double>(max_inter_node_bytes_per_rank()) / at.inter_node_bytes_per_second();
}

double OwnerPlan::estimated_seconds() const { return estimated_seconds(rates); }

double OwnerPlan::pipelined_seconds() const {
  const size_t count = rounds.size();
  const auto at = [](const std::vector<double>& v, size_t t) { return t < v.size() ? v[t] : 0.0; };
  const auto ns = [&](size_t t) {
    const auto& per_rank = round_cost_per_rank[t];
    const int64_t most = per_rank.empty() ? 0 : *std::max_element(per_rank.begin(), per_rank.end());
    return static_cast<double>(most) / rates.newton_schulz_flops_per_second();
  };
  const bool pipelined =
      std::any_of(overlap_with_next.begin(), overlap_with_next.end(), [](bool b) { return b; });
  if (!pipelined) {
    double total = 0;
    for (size_t t = 0; t < count; ++t) {
      total += at(round_gather_seconds, t) + ns(t) + at(round_scatter_seconds, t);
    }
    return total;
  }
  // FsdpMuon::Impl::run_pipelined step by step: `now` is the compute stream, `link` the time the
  // link is free; a collective starts when it is issued and the link is free.
  double now = 0, link = 0;
  std::vector<double> gathered(count, 0), scattered(count, 0);
  const auto issue = [&](double seconds) {
    link = std::max(link, now) + seconds;
    return link;
  };
  if (count > 0) gathered[0] = issue(at(round_gather_seconds, 0));
  for (size_t t = 0; t < count; ++t) {
    const bool has_next = t + 1 < count;
    now = std::max(now, gathered[t]);
    if (has_next && overlap_with_next[t]) gathered[t + 1] = issue(at(round_gather_seconds, t + 1));
    now += ns(t);
    scattered[t] = issue(at(round_scatter_seconds, t));
    if (t > 0 && overlap_with_next[t - 1]) now = std::max(now, scattered[t - 1]);
    if (has_next && !overlap_with_next[t]) {
      now = std::max(now, scattered[t]);
      gathered[t + 1] = issue(at(round_gather_seconds, t + 1));
    }
  }
  if (count > 0) now = std::max(now, scattered[count - 1]);
  return now;
}

// A plan built by hand (the benchmarks' baselines) may leave inter_node_bytes_per_rank empty:
// no inter-node bytes.
static int64_t inter_bytes(const OwnerPlan& plan, int rank) {
  return static_cast<size_t>(rank) < plan.inter_node_bytes_per_rank.size()
             ? plan.inter_node_bytes_per_rank[rank]
             : 0;
}

int64_t OwnerPlan::max_intra_node_bytes_per_rank() const {
  int64_t most = 0;
  for (int r = 0; r < world_size; ++r) {
    most = std::max(most,
                    gather_bytes_per_rank[r] + scatter_bytes_per_rank[r] - inter_bytes(*this, r));
  }
  return most;
}

int64_t OwnerPlan::max_inter_node_bytes_per_rank() const {
  int64_t most = 0;
  for (int r = 0; r < world_size; ++r) most = std::max(most, inter_bytes(*this, r));
  return most;
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

int64_t OwnerPlan::critical_path_planned() const {
  int64_t path = 0;
  for (const auto& per_rank : round_cost_per_rank) {
    path += per_rank.empty() ? 0 : *std::max_element(per_rank.begin(), per_rank.end());
  }
  return path;
}

int64_t OwnerPlan::max_held_full_bytes() const {
  int64_t most = 0;
  for (size_t t = 0; t < round_full_bytes_per_rank.size(); ++t) {
    for (int r = 0; r < world_size; ++r) {
      const bool pair = t < overlap_with_next.size() && overlap_with_next[t];
      most = std::max(
          most, round_full_bytes_per_rank[t][r] + (pair ? round_full_bytes_per_rank[t + 1][r] : 0));
    }
  }
  return most;
}

int64_t OwnerPlan::max_round_full_bytes() const {
  int64_t most = 0;
  for (const auto& per_rank : round_full_bytes_per_rank) {
    for (int64_t b : per_rank) most = std::max(most, b);
  }
  return most;
}

double OwnerPlan::critical_path_ratio_planned() const {
  return ratio(static_cast<double>(critical_path_planned()), ideal_cost());
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
  out << "owner plan: policy " << to_string(policy) << ", schedule " << to_string(schedule)
      << ", world size " << world_size << ", " << owner.size() << " groups, total "
      << static_cast<double>(total_cost()) << " NS FLOPs\n"
      << "  mesh " << mesh.replicas << "x" << mesh.shard_size << " (replicas x shard size), "
      << to_string(replica_newton_schulz) << "; busiest rank's bytes within a replica "
      << max_intra_node_bytes_per_rank() << ", across replicas " << max_inter_node_bytes_per_rank()
      << "\n";
  if (rates.newton_schulz_flops_per_second() > 0 && rates.bytes_per_second() > 0 &&
      rates.inter_node_bytes_per_second() > 0) {
    out << "  estimated " << estimated_seconds() * 1e3 << " ms at "
        << rates.newton_schulz_flops_per_second() / 1e12 << " TFLOP/s, "
        << rates.bytes_per_second() / 1e9 << " GB/s within and "
        << rates.inter_node_bytes_per_second() / 1e9 << " GB/s across replicas; pipelined "
        << pipelined_seconds() * 1e3 << " ms\n";
  }
  out << "  critical path / ideal: planned (" << rounds.size() << " exchanges) "
      << critical_path_ratio_planned() << ", one group at a time "
      << detail::critical_path_ratio_budget0(*this) << ", all at once "
      << detail::critical_path_ratio_unlimited(*this) << ", floor " << floor_ratio() << "\n"
      << "  gather + scatter bytes per rank:";
  for (int r = 0; r < world_size; ++r) {
    out << " " << gather_bytes_per_rank[r] + scatter_bytes_per_rank[r];
  }
  out << "\n  cost per rank:";
  for (int r = 0; r < world_size; ++r) out << " " << static_cast<double>(cost_per_rank[r]);
  out << "\n";
  return out.str();
}

namespace detail {

int64_t critical_path(const OwnerPlan& plan,
                      const std::vector<std::pair<size_t, size_t>>& windows) {
  FSDP_MUON_API_SCOPE("critical_path");
  int64_t path = 0;
  for (const auto& [first, last] : windows) {
    FSDP_MUON_CHECK(first <= last && last <= plan.group_cost_per_rank.size(), "window [", first,
                    ", ", last, ") outside the ", plan.group_cost_per_rank.size(), " groups");
    int64_t slowest = 0;
    for (int r = 0; r < plan.world_size; ++r) {
      int64_t load = 0;
      for (size_t g = first; g < last; ++g) load += plan.group_cost_per_rank[g][r];
      slowest = std::max(slowest, load);
    }
    path += slowest;
  }
  return path;
}

int64_t critical_path_budget0(const OwnerPlan& plan) {
  return critical_path(plan, prefetch_windows(plan, 0));
}

int64_t critical_path_unlimited(const OwnerPlan& plan) {
  return critical_path(plan, {{0, plan.group_cost_per_rank.size()}});
}

double critical_path_ratio(const OwnerPlan& plan,
                           const std::vector<std::pair<size_t, size_t>>& windows) {
  return ratio(static_cast<double>(critical_path(plan, windows)), plan.ideal_cost());
}

double critical_path_ratio_budget0(const OwnerPlan& plan) {
  return ratio(static_cast<double>(critical_path_budget0(plan)), plan.ideal_cost());
}

double critical_path_ratio_unlimited(const OwnerPlan& plan) {
  return ratio(static_cast<double>(critical_path_unlimited(plan)), plan.ideal_cost());
}

}  // namespace detail
}  // namespace fsdp_muon
