#pragma once
// The owner planner's settings (docs/DESIGN.md §3, §7): who may own a matrix, when ranks meet,
// who orthogonalizes on an HSDP mesh, and the cost model's rates. FsdpMuonConfig carries them;
// plan_owners (planning/owner_plan.h, the engine tier) reads them.

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
  // FsdpMuonConfig::max_bytes_ratio times the busiest rank's bytes under holders-only: the
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
  // Whichever of the two the cost model predicts faster (OwnerPlan::estimated_seconds), decided
  // at planning; kOncePerReplica on a tie.
  kByCost,
};

FSDP_MUON_API const char* to_string(ReplicaNewtonSchulz mode);

// A prefetch budget that gathers every group before orthogonalizing any.
constexpr int64_t kUnlimitedPrefetch = std::numeric_limits<int64_t>::max();

// FsdpMuonConfig::max_bytes_ratio: let the cost model choose the byte limit (docs/DESIGN.md §7).
constexpr double kBytesRatioByCost = 0.0;

// What plan_owners() plans with: FsdpMuonConfig's planner settings, under the same names, plus
// element_bytes. Their defaults are set here, once (FsdpMuonConfig's fields start from them);
// their meaning is documented on FsdpMuonConfig. FsdpMuonConfig::owner_plan_options() holds a
// config's, which is what FsdpMuon plans with when nothing is calibrated.
struct FSDP_MUON_API OwnerPlanOptions {
  TORCH_ARG(OwnerPolicy, owner_policy) = OwnerPolicy::kBalanced;
  TORCH_ARG(OwnerSchedule, owner_schedule) = OwnerSchedule::kRounds;
  TORCH_ARG(double, max_bytes_ratio) = kBytesRatioByCost;
  TORCH_ARG(double, newton_schulz_flops_per_second) = 4e14;
  TORCH_ARG(double, bytes_per_second) = 1.5e11;
  TORCH_ARG(int64_t, prefetch_budget_bytes) = int64_t{1} << 30;
  TORCH_ARG(bool, overlap_communication) = true;
  TORCH_ARG(ReplicaNewtonSchulz, replica_newton_schulz) = ReplicaNewtonSchulz::kByCost;
  // bytes_per_second is the rate within a replica (the shard group, one node); this one the rate
  // between replicas (across nodes).
  TORCH_ARG(double, inter_node_bytes_per_second) = 2.5e10;
  TORCH_ARG(double, exchange_latency_seconds) = 5e-5;
  // Bytes of one element moved and held, for a PlanGroup whose element_bytes is 0 (FsdpMuon
  // sets every group's: its main dtype's). The planner's own setting.
  TORCH_ARG(int64_t, element_bytes) = 4;
};

}  // namespace fsdp_muon
