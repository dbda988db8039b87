#pragma once
// The whole training step's communication per rank on a replicate x shard mesh, for the
// plan-only table (fsdp_muon_bench --plan-only --hsdp, bench/RESULTS.md §10.7): the FSDP
// collectives of each sharding strategy as src/fsdp/ runs them, and DMuon's dedicated-owner
// scheme (github.com/X-Square-Robot/dmuon) from its published design. The optimizer step's
// exchange and Newton–Schulz come from the planner (plan_hsdp.cpp). Byte counts, no processes.
//
// Collectives are NCCL rings: a ring all-gather or reduce-scatter of a buffer over n ranks has
// each rank send (n-1)/n of it, a ring all-reduce 2(n-1)/n. One micro-batch per step.

#include <cstdint>
#include <vector>

#include <fsdp_muon/fsdp/group_options.h>
#include <fsdp_muon/planning/owner_plan.h>

#include "model_shapes.h"

namespace fsdp_muon_bench {

// Element sizes (bytes) the table assumes: FsdpParameterGroupOptions with
// compute_dtype(kBFloat16) and every other option at its default.
constexpr double kComputeBytes = 2;  // model weights: their all-gathers, DMuon's broadcasts
constexpr double kReduceBytes = 2;   // reduce_dtype (default: the compute dtype): the gradient
                                     // reduce-scatter, the replica all-reduce, DMuon's reduces
constexpr double kMasterBytes = 4;   // main_dtype (default fp32); DMuon's master_dtype (fp32),
                                     // which its post-step broadcast across replicas sends

// What one rank sends in one step: bytes within its node (NVLink) and across nodes (its NIC),
// and the steps of its collectives that run one after another, each paying a fixed latency
// however few bytes it moves (a ring over n ranks takes n-1 steps per pass).
struct Traffic {
  double intra = 0;
  double inter = 0;
  double latency_steps = 0;
  Traffic operator+(const Traffic& o) const {
    return {intra + o.intra, inter + o.inter, latency_steps + o.latency_steps};
  }
  Traffic operator*(double k) const { return {intra * k, inter * k, latency_steps * k}; }
  // The bytes at the cost model's rates with the two links one after the other, as
  // OwnerPlan::estimated_seconds prices the optimizer's exchange, plus step_seconds per step.
  double seconds(const fsdp_muon::CostRates& rates, double step_seconds) const;
};

// What the FSDP collectives of `model` move.
struct ModelElements {
  int64_t groups = 0;    // FSDP groups (one per layer): each runs its own collectives
  int64_t flat = 0;      // sum over groups of the padded flat buffer laid out over shard_size
  int64_t matrices = 0;  // elements of the 2-D parameters (what Muon updates)
  int64_t others = 0;    // of the other parameters (norms, biases)
};
ModelElements model_elements(const ModelShapes& model, int shard_size);

// All-gathers of the model weights per step: ZeRO-3 (kOptimGradsParams) gathers in forward and
// again in backward, ZeRO-1/2 once, when the step refreshes them.
int weight_gathers(fsdp_muon::ShardingStrategy strategy);

// HSDP: FsdpParameterGroup on a DeviceMesh, `flat` elements laid out over the shard size.
Traffic hsdp_fsdp_traffic(const ModelElements& elements, fsdp_muon::MeshShape mesh,
                          fsdp_muon::ShardingStrategy strategy);

// The 1-D mesh over all W ranks of `mesh` (nodes of mesh.shard_size ranks), `elements` laid out
// over W. Ring: NCCL's rings, one per NIC. Direct: a bound, each rank's piece sent to every
// other rank point to point (the planner's model of the optimizer exchange).
Traffic flat_fsdp_traffic_ring(const ModelElements& elements, fsdp_muon::MeshShape mesh,
                               fsdp_muon::ShardingStrategy strategy);
Traffic flat_fsdp_traffic_direct(const ModelElements& elements, fsdp_muon::MeshShape mesh,
                                 fsdp_muon::ShardingStrategy strategy);

// DMuon's owners: every matrix whole, with its momentum, on one world rank.
struct DedicatedOwners {
  int64_t critical_path = 0;         // Newton–Schulz FLOPs of the busiest rank
  int64_t busiest_column_numel = 0;  // matrix elements owned in the busiest shard column
};
DedicatedOwners dedicated_owners(const std::vector<fsdp_muon::PlanGroup>& groups,
                                 fsdp_muon::MeshShape mesh);

// DMuon on `mesh` (its native HSDP): ZeRO-1/2 as DMuon-Z2 (reshard_after_forward=False),
// ZeRO-3 as DMuon-Z3. No optimizer exchange.
Traffic dmuon_traffic(const ModelElements& elements, const DedicatedOwners& owners,
                      fsdp_muon::MeshShape mesh, fsdp_muon::ShardingStrategy strategy);

}  // namespace fsdp_muon_bench
