#pragma once
// The owner planner's settings (docs/DESIGN.md §3, §7): who may own a matrix, when ranks meet,
// who orthogonalizes on an HSDP mesh (OwnerPlanOptions), and the cost model's rates
// (CostRates). FsdpMuonConfig carries them (planner(), rates()); plan_owners
// (planning/owner_plan.h, the engine tier) takes both.

#include <cstdint>
#include <limits>

#include <torch/arg.h>

#include <fsdp_muon/config.h>

namespace fsdp_muon {

enum class OwnerPolicy {
  // A matrix is owned by a rank that holds part of it: traffic is minimal,
  // each element held by a non-owner travels to its owner once and back once.
  kHoldersOnly,
  // Boundary matrices may be owned by any rank, even one that holds none of it (it then
  // receives the whole matrix): better balance for more bytes. Fully local matrices still stay
  // with their only holder, so they never move.
  kAnyRank,
  // Holders-only over the whole model, then matrices (local ones included) move from the
  // busiest rank to the least loaded while every rank's gather + scatter bytes stay within
  // OwnerPlanOptions::max_bytes_ratio times the busiest rank's bytes under holders-only: the
  // Newton–Schulz balance of any-rank for a bounded number of extra bytes (docs/DESIGN.md §3).
  kBalanced,
};

FSDP_MUON_API const char* to_string(OwnerPolicy policy);

// When ranks meet to exchange matrices (docs/DESIGN.md §3).
enum class OwnerSchedule {
  // Consecutive FSDP groups are gathered and orthogonalized together while every rank's owned
  // full matrices fit the budget; each window is balanced on its own and ranks meet at every
  // window, so the imbalance of each window adds up.
  kWindows,
  // Owners are chosen over the whole model; each rank's owned matrices are packed into rounds
  // of about equal cost that fit the budget (largest rounds first on every rank). A round is one
  // exchange (gather, orthogonalize, scatter) whatever groups its matrices come from.
  kRounds,
};

FSDP_MUON_API const char* to_string(OwnerSchedule schedule);

// Who orthogonalizes a matrix on a replicate x shard mesh (HSDP: parameters sharded within a
// replica, replicated across replicas; docs/DESIGN.md §7).
enum class ReplicaNewtonSchulz {
  // Owners are planned over all ranks of the world: each matrix is orthogonalized by one rank,
  // which gathers it from the holders in its own replica and scatters the update to the holders
  // in every replica (inter-node bytes in the step, no repeated Newton–Schulz).
  kOncePerWorld,
  // Each replica plans over its shard ranks and orthogonalizes every matrix itself, as Dion and
  // torchtitan do: no inter-node bytes in the step, Newton–Schulz repeated in every replica.
  kOncePerReplica,
  // Whichever of kOncePerWorld, kOncePerWorldRelay and kOncePerReplica the cost model predicts
  // faster (OwnerPlan::estimated_seconds), decided at planning; kOncePerReplica on a tie.
  kByCost,
  // kOncePerWorld's owners, with the update relayed: the owner scatters it to the holders in its
  // own replica only, then each shard rank's replicate group (the ranks with its shard rank)
  // all-gathers the pieces its members hold of the matrices owned in their replicas. Every
  // replica receives each update once; no owner sends replicas - 1 copies (docs/DESIGN.md §3).
  // Appended: the values are stored and agreed.
  kOncePerWorldRelay,
};

FSDP_MUON_API const char* to_string(ReplicaNewtonSchulz mode);

// A prefetch budget that gathers every group before orthogonalizing any.
constexpr int64_t kUnlimitedPrefetch = std::numeric_limits<int64_t>::max();

// OwnerPlanOptions::max_bytes_ratio: let the cost model choose the byte limit (docs/DESIGN.md §7).
constexpr double kBytesRatioByCost = 0.0;

// The cost model's rates (docs/DESIGN.md §7): a plan's step costs its orthogonalize critical path
// in FLOPs at newton_schulz_flops_per_second plus its busiest rank's bytes at the send rates
// (OwnerPlan::estimated_seconds), and each exchange a fixed latency. The defaults are estimates,
// not measurements: an H200 NVLink node (bf16 Newton–Schulz at ~40% of peak, ~150 GB/s of
// all-to-all per rank) and 400 Gb/s InfiniBand per GPU between nodes. FsdpMuon measures them at
// construction unless FsdpMuonConfig::rates gives them.
struct FSDP_MUON_API CostRates {
  // One rank's Newton–Schulz rate, FLOP/s (> 0).
  TORCH_ARG(double, newton_schulz_flops_per_second) = 4e14;
  // One rank's send rate within a replica (the shard group, one node), bytes/s (> 0).
  TORCH_ARG(double, bytes_per_second) = 1.5e11;
  // One rank's send rate between replicas (across nodes) on a replicate x shard mesh, bytes/s
  // (> 0; ~25 GB/s achieved under all-to-all).
  TORCH_ARG(double, inter_node_bytes_per_second) = 2.5e10;
  // The fixed cost of one collective exchange (a gather or a scatter), seconds (>= 0; an NCCL
  // all-to-all within a node): with it overlap_communication decides how many rounds a step has
  // (OwnerPlan::pipelined_seconds).
  TORCH_ARG(double, exchange_latency_seconds) = 5e-5;
};

// What plan_owners() plans (FsdpMuonConfig::planner); the prices it plans at are CostRates, its
// own argument.
struct FSDP_MUON_API OwnerPlanOptions {
  // Who may orthogonalize a matrix (see OwnerPolicy). The default, kBalanced, was chosen from
  // the planned critical paths in bench/RESULTS.md: holders-only leaves ranks that hold
  // expensive matrices whole overloaded in every layer.
  TORCH_ARG(OwnerPolicy, owner_policy) = OwnerPolicy::kBalanced;
  // When ranks meet (see OwnerSchedule): kRounds, the default, chosen from bench/RESULTS.md,
  // packs every rank's owned matrices into rounds of about equal cost over the whole model.
  TORCH_ARG(OwnerSchedule, owner_schedule) = OwnerSchedule::kRounds;
  // kBalanced: the bytes a rank may send per step (gather + scatter), as a multiple of the
  // busiest rank's under holders-only (OwnerPlan::holders_only_max_bytes); >= 1, infinity for
  // no limit, or kBytesRatioByCost, the default: the planner keeps, among a fixed list of
  // limits from 1 to unlimited, the limit whose plan costs least at the CostRates it plans with
  // (under FsdpMuon: measured, so trading bytes for balance is priced on this machine's links,
  // not guessed; OwnerPlan::max_bytes_ratio says which limit it took).
  TORCH_ARG(double, max_bytes_ratio) = kBytesRatioByCost;
  // Bytes of full matrices one rank may hold at once. kRounds: each rank's owned matrices of a
  // round fit it; kWindows: consecutive FSDP groups are gathered together (a window) while
  // every rank's owned full matrices in them fit. With overlap_communication two exchanges are
  // in flight, each packed to half of it. 0 is one matrix (rounds) or one group (windows) at a
  // time, kUnlimitedPrefetch everything at once. A matrix or group larger than the budget
  // still runs, alone. The result bits never depend on it.
  // The default, 1 GiB, was chosen from the planned critical paths in bench/RESULTS.md.
  TORCH_ARG(int64_t, prefetch_budget_bytes) = int64_t{1} << 30;
  // Start the gather of the next round (or window) before orthogonalizing the current one, and
  // let the current one's scatter run while the next is orthogonalized (docs/DESIGN.md §3);
  // each round is then packed to half of prefetch_budget_bytes, so that what a rank holds at
  // once stays within it, and under kRounds the cost model splits the step into more rounds
  // where that hides more of the exchange (OwnerPlan::pipelined_seconds). The result bits are
  // the same either way.
  TORCH_ARG(bool, overlap_communication) = true;
  // On a mesh with several replicas: who orthogonalizes each matrix (see ReplicaNewtonSchulz).
  // kByCost, the default, picks whichever of kOncePerWorld, kOncePerWorldRelay and
  // kOncePerReplica the cost model predicts faster. The result bits are the same under all.
  TORCH_ARG(ReplicaNewtonSchulz, replica_newton_schulz) = ReplicaNewtonSchulz::kByCost;
  // Bytes of one element moved and held, for a PlanGroup whose element_bytes is 0. FsdpMuon sets
  // every group's (its main dtype's), so there it changes nothing.
  TORCH_ARG(int64_t, element_bytes) = 4;
};

}  // namespace fsdp_muon
