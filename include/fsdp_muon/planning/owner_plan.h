#pragma once
// Owner planning for FsdpMuon (docs/DESIGN.md §3, §7; the engine tier: not in the umbrella): which
// rank orthogonalizes each 2-D parameter, what that costs each rank in Newton–Schulz FLOPs, and how
// many bytes it moves. Pure logic: benchmarks and tests plan real model shapes at any world size
// without processes.

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/newton_schulz/newton_schulz.h>
#include <fsdp_muon/planning/plan_options.h>

namespace fsdp_muon {

// The shape of a replicate x shard mesh as the planner sees it: world rank = replica *
// shard_size + shard rank (include/fsdp_muon/comm/device_mesh.h). {1, W} is the 1-D mesh.
struct FSDP_MUON_API MeshShape {
  int replicas = 1;
  int shard_size = 1;
  int world_size() const { return replicas * shard_size; }
};

// Newton–Schulz FLOPs of a rows x cols matrix under standard quintic-style iterations:
// steps * (4*m*m*n + 2*m*m*m), m = min side, n = max side (docs/DESIGN.md §7). The planner
// counts what runs instead (plan_matrix_flops); this is its value for default options.
FSDP_MUON_API int64_t newton_schulz_flops(int64_t rows, int64_t cols, int64_t steps);

// One matrix as the planner sees it: a 2-D parameter, or one block of a parameter its
// MatrixLayout divides (FsdpMuon clips the parameter's held ranges to the block).
struct FSDP_MUON_API PlanMatrix {
  std::string name;  // for reports and errors only
  int64_t rows = 0;
  int64_t cols = 0;
  // The Newton–Schulz options that run on it (MuonOptions::newton_schulz()): steps,
  // schedule, method (kAuto resolved per shape), restarts and preconditioning decide its cost.
  NewtonSchulzOptions newton_schulz;
  // One entry per (shard) rank: elements [first, second) of the flattened matrix that the rank
  // holds; first == second when it holds none. The ranges tile [0, rows*cols) in rank order. On
  // a mesh, shard rank s holds the same range in every replica.
  std::vector<std::pair<int64_t, int64_t>> held;
  // The matrix's update rule keeps per-row state (NorMuon's): it travels with the matrix, one
  // element per row whose first element a non-owner holds (docs/DESIGN.md §3), and the bytes
  // count it.
  bool per_row_state = false;
};

// The cost the planner gives a matrix (docs/DESIGN.md §7): the GEMM FLOPs of its Newton–Schulz,
// newton_schulz_flops(rows, cols, m.newton_schulz) — Gram's where the method is or resolves
// to kGram for this shape (resolve_ns_method, the decision newton_schulz() itself makes), AOL's
// product reused as the first step's — rounded to an integer. NorMuon adds no GEMM.
FSDP_MUON_API int64_t plan_matrix_flops(const PlanMatrix& m);

// The 2-D parameters of one FsdpParameterGroup that the optimizer updates, in group order.
struct FSDP_MUON_API PlanGroup {
  std::string name;
  std::vector<PlanMatrix> matrices;
  // Bytes of one element of this group's matrices as moved and held; 0: the plan's default
  // (OwnerPlanOptions::element_bytes).
  int64_t element_bytes = 0;
};

struct FSDP_MUON_API OwnerPlan {
  // The ranks the plan is over: mesh.shard_size under kOncePerReplica (every replica runs the
  // same plan over its shard ranks), mesh.world_size() under kOncePerWorld(Relay). Every per-rank
  // vector below has world_size entries and every owner is a rank of that range.
  int world_size = 1;
  MeshShape mesh;
  // Resolved: never kByCost. With one replica the two plans are the same.
  ReplicaNewtonSchulz replica_newton_schulz = ReplicaNewtonSchulz::kOncePerReplica;
  // The cost model's rates the plan was made with (plan_owners' `rates`).
  CostRates rates;
  OwnerPolicy policy = OwnerPolicy::kHoldersOnly;
  OwnerSchedule schedule = OwnerSchedule::kWindows;
  int64_t element_bytes = 4;

  // kWindows: the windows [first, last) over the groups the plan was balanced for, in order.
  // kRounds: empty.
  std::vector<std::pair<size_t, size_t>> windows;
  // [round]: the matrices (group, index in group) one exchange gathers, orthogonalizes and
  // scatters together, in group, then index, order. kWindows: one round per window, its groups'
  // matrices. Every rank runs the rounds in this order; there is at least one when there are
  // groups.
  std::vector<std::vector<std::pair<size_t, size_t>>> rounds;
  // [round][rank]: Newton–Schulz FLOPs / full-matrix bytes of the rank's owned matrices in it.
  std::vector<std::vector<int64_t>> round_cost_per_rank;
  std::vector<std::vector<int64_t>> round_full_bytes_per_rank;
  // [round]: the busiest rank's time to send its part of the round's gather / scatter at the
  // rates planned with (within and across replicas), plus rates.exchange_latency_seconds().
  std::vector<double> round_gather_seconds;
  std::vector<double> round_scatter_seconds;
  // [group]: the round after which all of the group's matrices are updated (its model weights
  // can be refreshed); the last round for a group without matrices.
  std::vector<size_t> refresh_after_round;
  // [round]: with overlap_communication, whether round t+1 is gathered while round t is
  // orthogonalized (and round t's scatter runs while round t+1 is): when every rank's owned full
  // matrices of both rounds fit the budget. Otherwise round t is applied before round t+1
  // starts, so a rank never holds more than the budget unless one round alone does.
  std::vector<bool> overlap_with_next;
  // The busiest rank's gather + scatter bytes under holders-only owners over all groups: the
  // reference of OwnerPlanOptions::max_bytes_ratio and of the benchmarks' byte ratios.
  int64_t holders_only_max_bytes = 0;
  // kBalanced: the max_bytes_ratio the plan was made under (the cost model's choice under
  // kBytesRatioByCost); 0 for the other policies.
  double max_bytes_ratio = 0;
  // [group][matrix]: the owning rank (-1 for an empty matrix, which nobody needs to own).
  std::vector<std::vector<int>> owner;
  // [group][matrix]: Newton–Schulz FLOPs.
  std::vector<std::vector<int64_t>> cost;
  // [group][rank]: FLOPs each rank spends on its owned matrices of that group.
  std::vector<std::vector<int64_t>> group_cost_per_rank;
  // [rank]: FLOPs over all groups.
  std::vector<int64_t> cost_per_rank;
  // [group]: max over ranks / mean over ranks of that group's cost (1 = perfect; 1 for a group
  // without cost).
  std::vector<double> group_balance;
  // [group][rank]: bytes of the full matrices the rank owns in that group (what it holds
  // transiently while the group is in flight).
  std::vector<std::vector<int64_t>> group_full_bytes_per_rank;
  // [rank]: bytes each rank sends in all gathers / all scatters of one step (every matrix
  // active). Each element held by a non-owner travels to its owner once and back once, so
  // under holders-only this is the traffic minimum of docs/DESIGN.md §7. kOncePerWorld: an
  // owner gathers from the holders in its replica and scatters to the holders in every replica.
  // kOncePerWorldRelay: the scatter goes to the holders in the owner's replica (stage A), and
  // each of them (the owner too) sends its piece to the replicas - 1 others (stage B, an
  // all-gather-v over its replicate group).
  std::vector<int64_t> gather_bytes_per_rank;
  std::vector<int64_t> scatter_bytes_per_rank;
  // [rank]: the part of the above sent to other replicas (kOncePerWorld: (replicas - 1) x a
  // matrix's size, from its owner; kOncePerWorldRelay: (replicas - 1) x each holder's piece,
  // from the holders in the owner's replica; all zero otherwise).
  std::vector<int64_t> inter_node_bytes_per_rank;
  int64_t total_cost() const;
  int64_t largest_matrix_cost() const;
  double ideal_cost() const;  // total_cost() / world_size
  // Of the schedule that runs: sum over rounds of the largest per-rank cost in the round (for
  // kWindows the same as critical_path(windows)).
  int64_t critical_path_planned() const;
  // The above over ideal_cost() (1 when there is no cost at all).
  double critical_path_ratio_planned() const;
  // max(ideal, largest matrix) / ideal: no whole-matrix ownership beats it.
  double floor_ratio() const;
  int64_t max_bytes_per_rank() const;  // max over ranks of gather + scatter bytes
  // Max over ranks of the gather + scatter bytes sent within / across replicas.
  int64_t max_intra_node_bytes_per_rank() const;
  int64_t max_inter_node_bytes_per_rank() const;
  // Largest full-matrix bytes one rank owns in one round.
  int64_t max_round_full_bytes() const;
  // Largest full-matrix bytes one rank holds at once: one round, or two that overlap.
  int64_t max_held_full_bytes() const;
  // The cost model (docs/DESIGN.md §7) of OwnerPlanOptions::max_bytes_ratio(kBytesRatioByCost)
  // and ReplicaNewtonSchulz::kByCost: critical_path_planned() / newton_schulz_flops_per_second +
  // max_intra_node_bytes_per_rank() / bytes_per_second + max_inter_node_bytes_per_rank() /
  // inter_node_bytes_per_second, i.e. with no overlap of the terms (an upper bound;
  // overlap_communication hides part of the byte terms). The latency does not enter.
  double estimated_seconds(const CostRates& at) const;
  // The above at the rates the plan was made with.
  double estimated_seconds() const;
  // The step's timeline as FsdpMuon runs it (docs/DESIGN.md §3): one compute stream (assemble,
  // Newton–Schulz at the plan's rate, apply) and one link that runs the collectives in the order
  // they start (gather 0, then per round gather t+1 where it overlaps, scatter t), each taking
  // round_gather_seconds / round_scatter_seconds. Without overlap it is the sum over rounds of
  // gather + Newton–Schulz + scatter. What OwnerPlanOptions::overlap_communication chooses the
  // number of rounds by.
  double pipelined_seconds() const;
  // A few lines for logs and benchmarks.
  std::string summary() const;
};

// Plans owners and the schedule over a fixed, ordered set of groups (docs/DESIGN.md §3).
//
// kRounds: owners over all groups at once (holders-only and any-rank as below, one window;
// kBalanced then moves matrices within the byte limit), then each rank's owned matrices, by
// descending cost, go to the cheapest of R rounds where their full bytes fit the budget (half
// of it with overlap; a matrix larger than that alone in a round), R the fewest rounds that
// fit every rank; each rank's rounds are then sorted by descending cost, so that the
// expensive rounds of all ranks coincide. With overlap_communication, R is at least the
// fewest that fit and at most 64, the count (of 1, 2, 4, ... 64 rounds asked for) whose
// pipelined_seconds() is lowest (more rounds only where at least 1% lower): more rounds hide
// more of the exchange behind Newton–Schulz, each costs rates.exchange_latency_seconds() twice.
//
// `options` says what to plan, `rates` the prices the cost model plans at (every choice by cost
// above and below; the plan keeps them as OwnerPlan::rates). FsdpMuon passes its config's
// planner() and the rates it measured or was given.
//
// kWindows: window by window (one window, all groups, under the default unlimited budget).
// Holders-only: a matrix held by one rank goes to it; every other matrix of the window, all its
// groups sorted together by descending cost (ties by group, then index), goes to the least-loaded
// of its holders (ties: lowest rank), loads carried across the window's groups. Any-rank: the same,
// but boundary matrices may go to any rank (ties: the rank holding most of the matrix, then the
// lowest rank).
//
// With a finite budget, a window grows group by group (re-planned each time) while every rank's
// owned full-matrix bytes in it fit the budget.
FSDP_MUON_API OwnerPlan plan_owners(const std::vector<PlanGroup>& groups, int world_size,
                                    const OwnerPlanOptions& options = {},
                                    const CostRates& rates = {});

// The plan on a replicate x shard mesh (docs/DESIGN.md §7). Every matrix's `held` has
// mesh.shard_size entries (the same in every replica). options.replica_newton_schulz():
// kOncePerReplica: exactly plan_owners(groups, mesh.shard_size, options), owners are shard
// ranks; kOncePerWorld: the shard plan, then each shard rank's matrices spread over the replicas
// (by descending cost, to the least-loaded replica; ties: the lowest), owners are world ranks,
// and the rounds are cut over all of them; kOncePerWorldRelay: the same owners and rounds, the
// relay's bytes and seconds; kByCost: the one of the three with the lowest estimated_seconds(),
// kOncePerReplica on a tie (then kOncePerWorld). plan_owners(groups, W, options, rates) is
// plan_owners(groups, {1, W}, options, rates).
FSDP_MUON_API OwnerPlan plan_owners(const std::vector<PlanGroup>& groups, MeshShape mesh,
                                    const OwnerPlanOptions& options = {},
                                    const CostRates& rates = {});

// The PlanGroup an FsdpParameterGroup would have, from parameter shapes alone (docs/DESIGN.md §2
// flat layout, the same function the groups use): entries that are not 2-D are left out. The
// alignment is in bytes of the compute dtype, as in FsdpParameterGroupOptions.
FSDP_MUON_API PlanGroup plan_group_from_shapes(
    const std::string& name,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& named_shapes, int world_size,
    const NewtonSchulzOptions& newton_schulz = NewtonSchulzOptions(),
    c10::ScalarType compute_dtype = at::kFloat, int64_t alignment_bytes = 16);

}  // namespace fsdp_muon
