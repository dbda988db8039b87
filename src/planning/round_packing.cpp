// Round packing (docs/DESIGN.md §3): cutting a plan whose owners are set into the rounds or
// windows the step exchanges one after another, within the prefetch budget.
#include <algorithm>
#include <numeric>
#include <tuple>

#include <c10/util/Exception.h>

#include "common/check.h"
#include "planning/owner_plan_internal.h"

namespace fsdp_muon {
namespace detail {

// kRounds (docs/DESIGN.md §3): R rounds, R the fewest for which every rank's owned matrices
// fit `round_budget` bytes per round (an empty round takes anything). Ranks go busiest first,
// each one's matrices by descending cost (ties: group, index): the busiest rank's go to its
// cheapest round (longest-processing-time first), which sets the length of each round; every
// other rank's go where they lengthen the round least.
void pack_rounds(const std::vector<PlanGroup>& groups, int64_t round_budget, OwnerPlan& plan,
                 size_t min_rounds) {
  const int world_size = plan.world_size;
  struct Item {
    int64_t cost;
    int64_t bytes;
    size_t group;
    size_t index;
  };
  std::vector<std::vector<Item>> items(world_size);
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t eb = group_element_bytes(groups[g], plan);
    for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
      const int o = plan.owner[g][i];
      if (o < 0) continue;
      const PlanMatrix& m = groups[g].matrices[i];
      items[o].push_back({plan.cost[g][i], m.rows * m.cols * eb, g, i});
    }
  }
  // A lower bound on R: each rank's bytes over the budget, and one round per matrix that fills
  // it alone.
  size_t rounds = 1;
  for (auto& mine : items) {
    std::stable_sort(mine.begin(), mine.end(), [](const Item& a, const Item& b) {
      return std::make_tuple(-a.cost, a.group, a.index) <
             std::make_tuple(-b.cost, b.group, b.index);
    });
    int64_t bytes = 0;
    size_t alone = 0;
    for (const Item& it : mine) {
      if (it.bytes > round_budget) {
        ++alone;
      } else {
        bytes += it.bytes;
      }
    }
    const size_t shared =
        round_budget == 0 ? (bytes > 0 ? mine.size() - alone : 0)
                          // ceil(bytes / budget) without bytes + budget, which
                          // overflows for an unlimited budget (INT64_MAX; UBSan found it)
                          : static_cast<size_t>(bytes == 0 ? 0 : (bytes - 1) / round_budget + 1);
    rounds = std::max(rounds, alone + shared);
  }
  rounds = std::max(rounds, min_rounds);
  struct Bin {
    int64_t cost = 0;
    int64_t bytes = 0;
    std::vector<const Item*> items;
  };
  // One rank first: its rounds set each round's length (the profile); every other rank puts
  // each matrix where it raises the profile least, then where the most room is left under it,
  // so that the ranks' expensive rounds coincide. Returns the critical path, -1 if some rank's
  // matrices do not fit `count` rounds.
  std::vector<int64_t> load(world_size, 0);
  std::vector<int64_t> held(world_size, 0);
  for (int r = 0; r < world_size; ++r) {
    for (const Item& it : items[r]) {
      load[r] += it.cost;
      held[r] += it.bytes;
    }
  }
  const auto pack = [&](size_t count, const std::vector<int>& order,
                        std::vector<std::vector<Bin>>& bins) -> int64_t {
    bins.assign(world_size, std::vector<Bin>(count));
    std::vector<int64_t> profile(count, 0);
    for (int r : order) {
      for (const Item& it : items[r]) {
        Bin* where = nullptr;
        int64_t where_over = 0;
        int64_t where_room = 0;
        for (size_t t = 0; t < count; ++t) {
          Bin& bin = bins[r][t];
          if (!bin.items.empty() && bin.bytes > round_budget - it.bytes) continue;
          const int64_t over = std::max<int64_t>(bin.cost + it.cost - profile[t], 0);
          const int64_t room = profile[t] - bin.cost;
          if (where == nullptr || over < where_over || (over == where_over && room > where_room)) {
            where = &bin;
            where_over = over;
            where_room = room;
          }
        }
        if (where == nullptr) return -1;
        where->cost += it.cost;
        where->bytes += it.bytes;
        where->items.push_back(&it);
      }
      for (size_t t = 0; t < count; ++t) profile[t] = std::max(profile[t], bins[r][t].cost);
    }
    return std::accumulate(profile.begin(), profile.end(), int64_t{0});
  };
  // Two orders (busiest first; most bytes first) and a few round counts from the fewest that
  // fit: the shortest critical path wins, fewer rounds on a tie. Deterministic on every rank.
  std::vector<std::vector<int>> orders(2, std::vector<int>(world_size));
  for (auto& order : orders) std::iota(order.begin(), order.end(), 0);
  std::stable_sort(orders[0].begin(), orders[0].end(),
                   [&](int a, int b) { return load[a] > load[b]; });
  std::stable_sort(orders[1].begin(), orders[1].end(),
                   [&](int a, int b) { return held[a] > held[b]; });
  std::vector<std::vector<Bin>> bins, trial;
  int64_t best = -1;
  size_t fewest = 0;
  for (;; ++rounds) {
    for (const auto& order : orders) {
      const int64_t path = pack(rounds, order, trial);
      if (path >= 0 && (best < 0 || path < best)) {
        best = path;
        bins = trial;
      }
    }
    if (best >= 0 && fewest == 0) fewest = rounds;
    if (fewest > 0 && rounds >= fewest + 3) break;
  }
  rounds = bins.front().size();
  plan.rounds.clear();
  plan.round_cost_per_rank.clear();
  plan.round_full_bytes_per_rank.clear();
  for (size_t t = 0; t < rounds; ++t) {
    std::vector<std::pair<size_t, size_t>> round;
    std::vector<int64_t> cost(world_size, 0);
    std::vector<int64_t> bytes(world_size, 0);
    for (int r = 0; r < world_size; ++r) {
      for (const Item* it : bins[r][t].items) round.emplace_back(it->group, it->index);
      cost[r] = bins[r][t].cost;
      bytes[r] = bins[r][t].bytes;
    }
    if (round.empty()) continue;
    std::sort(round.begin(), round.end());
    plan.rounds.push_back(std::move(round));
    plan.round_cost_per_rank.push_back(std::move(cost));
    plan.round_full_bytes_per_rank.push_back(std::move(bytes));
  }
}

// kWindows: one round per window, its groups' matrices.
void rounds_from_windows(const std::vector<PlanGroup>& groups, OwnerPlan& plan) {
  plan.rounds.clear();
  plan.round_cost_per_rank.clear();
  plan.round_full_bytes_per_rank.clear();
  for (const auto& [first, last] : plan.windows) {
    std::vector<std::pair<size_t, size_t>> round;
    std::vector<int64_t> cost(plan.world_size, 0);
    std::vector<int64_t> bytes(plan.world_size, 0);
    for (size_t g = first; g < last; ++g) {
      for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
        if (plan.owner[g][i] < 0) continue;
        round.emplace_back(g, i);
      }
      for (int r = 0; r < plan.world_size; ++r) {
        cost[r] += plan.group_cost_per_rank[g][r];
        bytes[r] += plan.group_full_bytes_per_rank[g][r];
      }
    }
    plan.rounds.push_back(std::move(round));
    plan.round_cost_per_rank.push_back(std::move(cost));
    plan.round_full_bytes_per_rank.push_back(std::move(bytes));
  }
}

// Which round completes each group, and which rounds overlap the next (with overlap, when every
// rank's owned full matrices of both fit the budget); at least one round when there are groups.
void finish_rounds(size_t num_groups, int64_t budget, bool overlap, OwnerPlan& plan) {
  if (plan.rounds.empty() && num_groups > 0) {
    plan.rounds.emplace_back();
    plan.round_cost_per_rank.emplace_back(plan.world_size, 0);
    plan.round_full_bytes_per_rank.emplace_back(plan.world_size, 0);
  }
  const size_t last = plan.rounds.empty() ? 0 : plan.rounds.size() - 1;
  plan.refresh_after_round.assign(num_groups, last);
  std::vector<bool> seen(num_groups, false);
  for (size_t t = 0; t < plan.rounds.size(); ++t) {
    for (const auto& [g, i] : plan.rounds[t]) {
      plan.refresh_after_round[g] = seen[g] ? std::max(plan.refresh_after_round[g], t) : t;
      seen[g] = true;
    }
  }
  if (plan.schedule == OwnerSchedule::kWindows) {
    for (size_t w = 0; w < plan.windows.size(); ++w) {
      for (size_t g = plan.windows[w].first; g < plan.windows[w].second; ++g) {
        plan.refresh_after_round[g] = w;
      }
    }
  }
  plan.overlap_with_next.assign(plan.rounds.size(), false);
  for (size_t t = 0; overlap && t + 1 < plan.rounds.size(); ++t) {
    bool fits = true;
    for (int r = 0; r < plan.world_size; ++r) {
      const int64_t pair =
          plan.round_full_bytes_per_rank[t][r] + plan.round_full_bytes_per_rank[t + 1][r];
      if (budget != kUnlimitedPrefetch && pair > budget) fits = false;
    }
    plan.overlap_with_next[t] = fits;
  }
}

void transfer_seconds(const std::vector<PlanGroup>& groups, OwnerPlan& plan) {
  const bool world = plan.mesh.replicas > 1 && plan.world_size == plan.mesh.world_size();
  const int shard_size = world ? plan.mesh.shard_size : plan.world_size;
  const int replicas = world ? plan.mesh.replicas : 1;
  const bool relay = world && plan.replica_newton_schulz == ReplicaNewtonSchulz::kOncePerWorldRelay;
  const size_t rounds = plan.rounds.size();
  plan.round_gather_seconds.assign(rounds, 0.0);
  plan.round_scatter_seconds.assign(rounds, 0.0);
  std::vector<int64_t> gather(plan.world_size), scatter(plan.world_size), inter(plan.world_size);
  for (size_t t = 0; t < rounds; ++t) {
    std::fill(gather.begin(), gather.end(), 0);
    std::fill(scatter.begin(), scatter.end(), 0);
    std::fill(inter.begin(), inter.end(), 0);
    for (const auto& [g, i] : plan.rounds[t]) {
      const int o = plan.owner[g][i];
      if (o < 0) continue;
      const PlanMatrix& m = groups[g].matrices[i];
      const int64_t eb = group_element_bytes(groups[g], plan);
      const int replica = o / shard_size;
      for (int h = 0; h < shard_size; ++h) {
        const int64_t bytes = held_numel(m, h) * eb;
        // The relay's stage B: each holder in the owner's replica sends its piece to the
        // replicas - 1 others.
        if (relay) inter[replica * shard_size + h] += (replicas - 1) * bytes;
        if (h == o % shard_size) continue;
        gather[replica * shard_size + h] += bytes;
        scatter[o] += bytes;
      }
      // Direct (kOncePerWorld): every other replica gets all of it from the owner.
      if (!relay) inter[o] += (replicas - 1) * moved_numel(m) * eb;
    }
    double g_seconds = 0, s_seconds = 0, a_seconds = 0, b_seconds = 0;
    bool g_moves = false, s_moves = false, a_moves = false, b_moves = false;
    for (int r = 0; r < plan.world_size; ++r) {
      const double intra_seconds = static_cast<double>(scatter[r]) / plan.rates.bytes_per_second();
      const double inter_seconds =
          static_cast<double>(inter[r]) / plan.rates.inter_node_bytes_per_second();
      g_seconds =
          std::max(g_seconds, static_cast<double>(gather[r]) / plan.rates.bytes_per_second());
      s_seconds = std::max(s_seconds, intra_seconds + inter_seconds);
      a_seconds = std::max(a_seconds, intra_seconds);
      b_seconds = std::max(b_seconds, inter_seconds);
      g_moves = g_moves || gather[r] > 0;
      s_moves = s_moves || scatter[r] + inter[r] > 0;
      a_moves = a_moves || scatter[r] > 0;
      b_moves = b_moves || inter[r] > 0;
    }
    // FsdpMuon skips an exchange where nothing moves.
    const double latency = plan.rates.exchange_latency_seconds();
    plan.round_gather_seconds[t] = g_moves ? g_seconds + latency : 0.0;
    // The relay's two stages run one after the other, each as slow as its busiest rank.
    plan.round_scatter_seconds[t] =
        relay ? (a_moves ? a_seconds + latency : 0.0) + (b_moves ? b_seconds + latency : 0.0)
              : (s_moves ? s_seconds + latency : 0.0);
  }
}

std::vector<std::pair<size_t, size_t>> prefetch_windows(const OwnerPlan& plan,
                                                        int64_t budget_bytes) {
  FSDP_MUON_API_SCOPE("prefetch_windows");
  FSDP_MUON_CHECK(budget_bytes >= 0, "the prefetch budget must be >= 0 bytes, got ", budget_bytes,
                  " (use kUnlimitedPrefetch for no limit)");
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

}  // namespace detail
}  // namespace fsdp_muon
