#include <fsdp_muon/optimizer/owner_plan.h>

#include <algorithm>
#include <numeric>
#include <optional>
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
    const int64_t numel = pm.rows * pm.cols;
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
  struct Candidate {
    int64_t cost;
    size_t group;
    size_t index;
  };
  std::vector<Candidate> all;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
      plan.owner[g][i] = -1;
      const PlanMatrix& m = groups[g].matrices[i];
      if (m.rows * m.cols > 0) all.push_back({plan.cost[g][i], g, i});
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
    return std::make_tuple(-a.cost, a.group, a.index) < std::make_tuple(-b.cost, b.group, b.index);
  });
  std::vector<int> holders;
  for (const Candidate& c : all) {
    const PlanMatrix& m = groups[c.group].matrices[c.index];
    const int64_t eb = group_element_bytes(groups[c.group], plan);
    const int64_t numel = m.rows * m.cols;
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

// kRounds (docs/DESIGN.md §3): R rounds, R the fewest for which every rank's owned matrices
// fit `round_budget` bytes per round (an empty round takes anything). Ranks go busiest first,
// each one's matrices by descending cost (ties: group, index): the busiest rank's go to its
// cheapest round (longest-processing-time first), which sets the length of each round; every
// other rank's go where they lengthen the round least.
void pack_rounds(const std::vector<PlanGroup>& groups, int64_t round_budget, OwnerPlan& plan) {
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
    const size_t shared = round_budget == 0
                              ? (bytes > 0 ? mine.size() - alone : 0)
                              : static_cast<size_t>((bytes + round_budget - 1) / round_budget);
    rounds = std::max(rounds, alone + shared);
  }
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

}  // namespace

const char* to_string(OwnerSchedule schedule) {
  switch (schedule) {
    case OwnerSchedule::kWindows:
      return "windows";
    case OwnerSchedule::kRounds:
      return "rounds";
  }
  return "unknown";
}

const char* to_string(OwnerPolicy policy) {
  switch (policy) {
    case OwnerPolicy::kHoldersOnly:
      return "holders_only";
    case OwnerPolicy::kAnyRank:
      return "any_rank";
    case OwnerPolicy::kBalanced:
      return "balanced";
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
  TORCH_CHECK(options.max_bytes_ratio() >= 1.0 || options.max_bytes_ratio() == kBytesRatioByCost,
              "fsdp_muon::plan_owners: max_bytes_ratio must be >= 1 (1: holders-only bytes, "
              "infinity: no limit) or kBytesRatioByCost, got ",
              options.max_bytes_ratio());
  TORCH_CHECK(options.newton_schulz_flops_per_second() > 0 && options.bytes_per_second() > 0,
              "fsdp_muon::plan_owners: the cost model's rates must be positive, got ",
              options.newton_schulz_flops_per_second(), " FLOP/s and ", options.bytes_per_second(),
              " B/s");
  if (options.policy() == OwnerPolicy::kBalanced &&
      options.max_bytes_ratio() == kBytesRatioByCost) {
    // docs/DESIGN.md §7: one plan per candidate limit, the cheapest wins, the smaller limit on
    // a tie. Every rank computes the same plans, so every rank picks the same one.
    std::optional<OwnerPlan> best;
    double best_seconds = 0;
    for (const double ratio : kCostModelBytesRatios) {
      OwnerPlan candidate =
          plan_owners(groups, world_size, OwnerPlanOptions(options).max_bytes_ratio(ratio));
      const double seconds = candidate.estimated_seconds(options.newton_schulz_flops_per_second(),
                                                         options.bytes_per_second());
      if (!best || seconds < best_seconds) {
        best = std::move(candidate);
        best_seconds = seconds;
      }
    }
    return *best;
  }
  // Two exchanges in flight share the budget (docs/DESIGN.md §3).
  const int64_t exchange_budget =
      options.overlap() && budget != kUnlimitedPrefetch ? budget / 2 : budget;
  plan.schedule = options.schedule();
  if (plan.policy == OwnerPolicy::kBalanced) plan.max_bytes_ratio = options.max_bytes_ratio();
  {
    OwnerPlan holders = plan;
    holders.policy = OwnerPolicy::kHoldersOnly;
    assign_window(groups, 0, num_groups, holders);
    const std::vector<int64_t> bytes = bytes_per_rank(groups, holders);
    plan.holders_only_max_bytes = bytes.empty() ? 0 : *std::max_element(bytes.begin(), bytes.end());
  }
  // The plan of docs/DESIGN.md §3: loads carried across all groups (kBalanced: then moved within
  // the byte limit), then cut into rounds or windows by the budget.
  OwnerPlan carried = plan;
  assign_window(groups, 0, num_groups, carried);
  std::vector<OwnerPlan> starts;
  if (plan.policy == OwnerPolicy::kBalanced) {
    // Two starts, each improved by moves and swaps: holders-only (few bytes) and every matrix
    // placed within the byte limit (better balance where whole local matrices must move). The
    // shorter critical path of the schedule wins, the first on a tie.
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
  } else {
    finish_plan(groups, carried);
    starts.push_back(carried);
  }
  if (plan.schedule == OwnerSchedule::kRounds) {
    size_t best = 0;
    for (size_t k = 0; k < starts.size(); ++k) {
      pack_rounds(groups, exchange_budget, starts[k]);
      finish_rounds(num_groups, budget, options.overlap(), starts[k]);
      if (starts[k].critical_path_planned() < starts[best].critical_path_planned()) best = k;
    }
    return starts[best];
  }
  for (OwnerPlan& start : starts) {
    start.windows = prefetch_windows(start, exchange_budget);
    rounds_from_windows(groups, start);
    finish_rounds(num_groups, budget, options.overlap(), start);
  }
  carried = starts.front();
  for (const OwnerPlan& start : starts) {
    if (start.critical_path_planned() < carried.critical_path_planned()) carried = start;
  }
  if (exchange_budget == kUnlimitedPrefetch || plan.policy == OwnerPolicy::kBalanced) {
    return carried;
  }

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
      if (window_peak_bytes(groups, first, last + 1, trial) > exchange_budget) break;
      windowed = std::move(trial);
      ++last;
    }
    windowed.windows.emplace_back(first, last);
    first = last;
  }
  finish_plan(groups, windowed);
  rounds_from_windows(groups, windowed);
  finish_rounds(num_groups, budget, options.overlap(), windowed);
  // Both are greedy; neither wins everywhere (LPT under holder constraints is no optimum), so
  // keep the shorter critical path, the carried plan on a tie. Every rank picks the same one.
  return windowed.critical_path_planned() < carried.critical_path_planned() ? windowed : carried;
}

double OwnerPlan::estimated_seconds(double flops_per_second, double bytes_per_second) const {
  return static_cast<double>(critical_path_planned()) / flops_per_second +
         static_cast<double>(max_bytes_per_rank()) / bytes_per_second;
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
  out << "owner plan: policy " << to_string(policy) << ", schedule " << to_string(schedule)
      << ", world size " << world_size << ", " << owner.size() << " groups, total "
      << static_cast<double>(total_cost()) << " NS FLOPs\n"
      << "  critical path / ideal: planned (" << rounds.size() << " exchanges) "
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
