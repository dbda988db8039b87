// Owner assignment (docs/DESIGN.md §3): who orthogonalizes each matrix, and the per-rank totals
// of a plan whose owners are set.
#include <algorithm>
#include <numeric>
#include <optional>
#include <tuple>

#include "planning/owner_plan_internal.h"

namespace fsdp_muon::detail {
namespace {

// A matrix waiting for an owner: its cost and where it is.
struct Candidate {
  int64_t cost;
  size_t group;
  size_t index;
};

// The order owners are chosen in: descending cost, ties by group, then index.
void sort_by_descending_cost(std::vector<Candidate>& candidates) {
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return std::make_tuple(-a.cost, a.group, a.index) <
                            std::make_tuple(-b.cost, b.group, b.index);
                   });
}

}  // namespace

// Owners for the matrices of groups [first, last), balanced among themselves (fresh loads):
// ranks meet at every window, so only the load inside a window is on the critical path. Local
// matrices go to their only holder first; the others, by descending cost (ties: group, then
// index), to the least-loaded eligible rank.
void assign_window(const std::vector<PlanGroup>& groups, size_t first, size_t last,
                   OwnerPlan& plan) {
  const int world_size = plan.world_size;
  std::vector<int64_t> load(world_size, 0);
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
  sort_by_descending_cost(boundary);
  for (const Candidate& c : boundary) {
    const PlanMatrix& m = groups[c.group].matrices[c.index];
    int best = -1;
    for (int r = 0; r < world_size; ++r) {
      const int64_t held = held_numel(m, r);
      if (plan.policy != OwnerPolicy::kAnyRank && held == 0) continue;
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

void finish_world_plan(const std::vector<PlanGroup>& groups, OwnerPlan& plan) {
  const bool relay = plan.replica_newton_schulz == ReplicaNewtonSchulz::kOncePerWorldRelay;
  const int replicas = plan.mesh.replicas;
  const int shard_size = plan.mesh.shard_size;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& matrices = groups[g].matrices;
    const int64_t element_bytes = group_element_bytes(groups[g], plan);
    for (size_t i = 0; i < matrices.size(); ++i) {
      const int o = plan.owner[g][i];
      if (o < 0) continue;
      const PlanMatrix& m = matrices[i];
      const int replica = o / shard_size;
      const int shard_rank = o % shard_size;
      plan.cost_per_rank[o] += plan.cost[g][i];
      plan.group_cost_per_rank[g][o] += plan.cost[g][i];
      plan.group_full_bytes_per_rank[g][o] += m.rows * m.cols * element_bytes;
      for (int h = 0; h < shard_size; ++h) {
        const int64_t bytes = held_numel(m, h) * element_bytes;
        // The holders in the owner's replica send it their pieces.
        if (h != shard_rank) plan.gather_bytes_per_rank[replica * shard_size + h] += bytes;
        if (relay) {
          // Stage A: the owner sends each holder in its replica its slice; stage B: each of
          // them (the owner too) sends its piece to its shard rank in the replicas - 1 others
          // (an all-gather-v over the replicate group counts (size - 1) x what it sends).
          if (h != shard_rank) plan.scatter_bytes_per_rank[o] += bytes;
          plan.scatter_bytes_per_rank[replica * shard_size + h] += (replicas - 1) * bytes;
          plan.inter_node_bytes_per_rank[replica * shard_size + h] += (replicas - 1) * bytes;
          continue;
        }
        // Direct: every holder in every replica gets its update slice from the owner.
        plan.scatter_bytes_per_rank[o] += (h == shard_rank ? replicas - 1 : replicas) * bytes;
        plan.inter_node_bytes_per_rank[o] += (replicas - 1) * bytes;
      }
    }
    const auto& per_rank = plan.group_cost_per_rank[g];
    const int64_t total = std::accumulate(per_rank.begin(), per_rank.end(), int64_t{0});
    const int64_t largest = *std::max_element(per_rank.begin(), per_rank.end());
    plan.group_balance.push_back(
        ratio(static_cast<double>(largest), static_cast<double>(total) / plan.world_size));
  }
}

// Gather + scatter bytes each rank sends under `plan.owner` (every matrix active).
std::vector<int64_t> bytes_per_rank(const std::vector<PlanGroup>& groups, const OwnerPlan& plan) {
  std::vector<int64_t> bytes(plan.world_size, 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t element_bytes = group_element_bytes(groups[g], plan);
    for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
      const int o = plan.owner[g][i];
      if (o < 0) continue;
      const PlanMatrix& m = groups[g].matrices[i];
      for (int r = 0; r < plan.world_size; ++r) {
        if (r == o) continue;
        bytes[r] += held_numel(m, r) * element_bytes;
        bytes[o] += held_numel(m, r) * element_bytes;
      }
    }
  }
  return bytes;
}

// kBalanced (docs/DESIGN.md §3): from holders-only owners over all groups, the busiest rank
// gives a matrix to a less loaded one (any rank), or swaps one for a cheaper one of it when no
// single move helps: the change that lowers the pair's larger load the most, fewer added bytes
// on a tie, while every rank's bytes stay within `max_bytes`. Moving matrix m from owner o to s
// changes only o's and s's bytes: o now sends its piece instead of everyone else's, s everyone
// else's instead of its piece.
void rebalance(const std::vector<PlanGroup>& groups, double max_bytes, OwnerPlan& plan) {
  const int world_size = plan.world_size;
  std::vector<int64_t> load(world_size, 0);
  std::vector<int64_t> bytes = bytes_per_rank(groups, plan);
  struct Owned {
    int64_t cost;
    size_t group;
    size_t index;
  };
  std::vector<std::vector<Owned>> owned(world_size);
  int64_t largest = 0;
  int64_t total = 0;
  size_t count = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
      const int o = plan.owner[g][i];
      if (o < 0) continue;
      load[o] += plan.cost[g][i];
      owned[o].push_back({plan.cost[g][i], g, i});
      largest = std::max(largest, plan.cost[g][i]);
      total += plan.cost[g][i];
      ++count;
    }
  }
  // Bytes change of (from, to) when a matrix's owner goes from `from` to `to`.
  const auto delta = [&](const Owned& m, int from, int to) {
    const PlanMatrix& pm = groups[m.group].matrices[m.index];
    const int64_t eb = group_element_bytes(groups[m.group], plan);
    const int64_t numel = moved_numel(pm);
    return std::make_pair((2 * held_numel(pm, from) - numel) * eb,
                          (numel - 2 * held_numel(pm, to)) * eb);
  };
  const auto fits = [&](int r, int64_t dr, int s, int64_t ds) {
    return static_cast<double>(bytes[r] + dr) <= max_bytes &&
           static_cast<double>(bytes[s] + ds) <= max_bytes;
  };
  const auto by_cost = [](const Owned& a, const Owned& b) {
    return std::make_tuple(a.cost, a.group, a.index) < std::make_tuple(b.cost, b.group, b.index);
  };
  for (auto& mine : owned) std::sort(mine.begin(), mine.end(), by_cost);
  // No whole-matrix plan beats max(mean, largest matrix); stop a hair above it.
  const double target =
      std::max(static_cast<double>(total) / world_size, static_cast<double>(largest)) * 1.001;
  std::vector<int> by_load(world_size);
  for (size_t changes = 0; changes < 4 * count + 64; ++changes) {
    std::iota(by_load.begin(), by_load.end(), 0);
    std::stable_sort(by_load.begin(), by_load.end(),
                     [&](int a, int b) { return load[a] < load[b]; });
    const int r = by_load.back();
    if (static_cast<double>(load[r]) <= target) break;
    // The best change: (peak, added bytes, a in owned[r], b in owned[s] or none, s).
    struct Change {
      int64_t peak;
      int64_t added;
      size_t a;
      size_t b;  // owned[s].size(): a plain move
      int s;
      int64_t dr, ds;
    };
    std::optional<Change> best;
    const auto consider = [&](const Change& c) {
      if (c.peak >= load[r] || !fits(r, c.dr, c.s, c.ds)) return;
      if (!best || c.peak < best->peak || (c.peak == best->peak && c.added < best->added)) {
        best = c;
      }
    };
    for (int s : by_load) {
      if (load[s] >= load[r]) break;
      for (size_t a = 0; a < owned[r].size(); ++a) {
        const int64_t c = owned[r][a].cost;
        const auto [dr, ds] = delta(owned[r][a], r, s);
        consider({std::max(load[r] - c, load[s] + c), dr + ds, a, owned[s].size(), s, dr, ds});
      }
      if (best) break;
    }
    for (int s : by_load) {
      if (best || load[s] >= load[r]) break;
      // Swap a (r -> s) for a cheaper b (s -> r): the best b is near a - (load[r] - load[s]) / 2.
      const int64_t gap = load[r] - load[s];
      for (size_t a = 0; a < owned[r].size(); ++a) {
        const Owned& ma = owned[r][a];
        const auto want = std::lower_bound(owned[s].begin(), owned[s].end(),
                                           Owned{ma.cost - gap / 2, 0, 0}, by_cost);
        const size_t centre = static_cast<size_t>(want - owned[s].begin());
        for (size_t b = centre > 4 ? centre - 4 : 0; b < std::min(owned[s].size(), centre + 4);
             ++b) {
          const Owned& mb = owned[s][b];
          if (mb.cost >= ma.cost) break;
          const auto [dr1, ds1] = delta(ma, r, s);
          const auto [ds2, dr2] = delta(mb, s, r);
          const int64_t moved = ma.cost - mb.cost;
          consider({std::max(load[r] - moved, load[s] + moved), dr1 + dr2 + ds1 + ds2, a, b, s,
                    dr1 + dr2, ds1 + ds2});
        }
      }
    }
    if (!best) break;
    const int s = best->s;
    const Owned ma = owned[r][best->a];
    plan.owner[ma.group][ma.index] = s;
    load[r] -= ma.cost;
    load[s] += ma.cost;
    owned[r].erase(owned[r].begin() + static_cast<std::ptrdiff_t>(best->a));
    if (best->b < owned[s].size()) {
      const Owned mb = owned[s][best->b];
      plan.owner[mb.group][mb.index] = r;
      load[s] -= mb.cost;
      load[r] += mb.cost;
      owned[s].erase(owned[s].begin() + static_cast<std::ptrdiff_t>(best->b));
      owned[r].insert(std::upper_bound(owned[r].begin(), owned[r].end(), mb, by_cost), mb);
    }
    owned[s].insert(std::upper_bound(owned[s].begin(), owned[s].end(), ma, by_cost), ma);
    bytes[r] += best->dr;
    bytes[s] += best->ds;
  }
}

// kBalanced's second start (docs/DESIGN.md §3): every matrix, local ones included, by
// descending cost (ties: group, index), to the least-loaded rank (ties: the one holding most of
// it, then the lowest) whose assignment keeps every rank's bytes within `max_bytes`; the holder
// of most of it when none does.
void assign_within_bytes(const std::vector<PlanGroup>& groups, double max_bytes, OwnerPlan& plan) {
  const int world_size = plan.world_size;
  std::vector<int64_t> load(world_size, 0);
  std::vector<int64_t> bytes(world_size, 0);
  std::vector<Candidate> all;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
      plan.owner[g][i] = -1;
      const PlanMatrix& m = groups[g].matrices[i];
      if (m.rows * m.cols > 0) all.push_back({plan.cost[g][i], g, i});
    }
  }
  sort_by_descending_cost(all);
  std::vector<int> holders;
  for (const Candidate& c : all) {
    const PlanMatrix& m = groups[c.group].matrices[c.index];
    const int64_t eb = group_element_bytes(groups[c.group], plan);
    const int64_t numel = moved_numel(m);
    holders.clear();
    int most = -1;
    for (int r = 0; r < world_size; ++r) {
      if (held_numel(m, r) == 0) continue;
      holders.push_back(r);
      if (most < 0 || held_numel(m, r) > held_numel(m, most)) most = r;
    }
    int best = -1;
    for (int r = 0; r < world_size; ++r) {
      bool fits = static_cast<double>(bytes[r] + (numel - held_numel(m, r)) * eb) <= max_bytes;
      for (int h : holders) {
        if (h != r && static_cast<double>(bytes[h] + held_numel(m, h) * eb) > max_bytes) {
          fits = false;
        }
      }
      if (!fits) continue;
      if (best < 0 || load[r] < load[best] ||
          (load[r] == load[best] && held_numel(m, r) > held_numel(m, best))) {
        best = r;
      }
    }
    if (best < 0) best = most;
    plan.owner[c.group][c.index] = best;
    load[best] += c.cost;
    for (int h : holders) {
      if (h != best) {
        bytes[h] += held_numel(m, h) * eb;
        bytes[best] += held_numel(m, h) * eb;
      }
    }
  }
}

}  // namespace fsdp_muon::detail
