#include "whole_step.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <utility>

#include "fsdp/flat_layout.h"

namespace fsdp_muon_bench {

using fsdp_muon::MeshShape;
using fsdp_muon::ShardingStrategy;

double Traffic::seconds(const fsdp_muon::CostRates& rates, double step_seconds) const {
  return intra / rates.bytes_per_second() + inter / rates.inter_node_bytes_per_second() +
         latency_steps * step_seconds;
}

ModelElements model_elements(const ModelShapes& model, int shard_size) {
  // FsdpParameterGroupOptions' default alignment: 16 bytes of the compute dtype.
  const auto alignment = static_cast<int64_t>(16 / kComputeBytes);
  ModelElements e;
  e.groups = static_cast<int64_t>(model.groups.size());
  for (const auto& [name, shapes] : model.groups) {
    e.flat += fsdp_muon::fsdp::compute_flat_layout(shapes, alignment, shard_size).padded_numel;
    for (const auto& [parameter, shape] : shapes) {
      int64_t numel = 1;
      for (const int64_t d : shape) numel *= d;
      (shape.size() == 2 ? e.matrices : e.others) += numel;
    }
  }
  return e;
}

int weight_gathers(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kOptimGradsParams ? 2 : 1;
}

// Per rank per step (src/fsdp/group_storage.cpp, sharding_state_machine.cpp), S = shard size,
// R = replicas, G groups, each with its own collectives; ranks s, S+s, 2S+s, ..., one per node,
// form shard rank s's replica group:
//  - weights: an all-gather over the shard group of the main shard cast to the compute dtype
//    (refresh_model_weights after the step under ZeRO-1/2; under ZeRO-3 start_gather in forward
//    and, the weights freed after forward, again in backward):
//      (S-1)/S x flat x 2 B per gather, within the node; S-1 steps per group;
//  - gradients, once (ZeRO-1: reduce_scatter_grads; ZeRO-2/3: as backward finishes the group):
//    a reduce-scatter (mean) of the full gradient in reduce_dtype over the shard group,
//      (S-1)/S x flat x 2 B, within the node; S-1 steps per group;
//    then an all-reduce (sum) of the reduced shard, flat/S elements still in reduce_dtype (it
//    runs before the copy into the fp32 gradient shard), over the R replicas; each shard rank's
//    ring runs on its own NIC:
//      2(R-1)/R x flat/S x 2 B, across nodes; 2(R-1) steps per group.
Traffic hsdp_fsdp_traffic(const ModelElements& elements, MeshShape mesh,
                          ShardingStrategy strategy) {
  const double S = mesh.shard_size, R = mesh.replicas, G = elements.groups;
  const double n = static_cast<double>(elements.flat);
  const Traffic gather{(S - 1) / S * n * kComputeBytes, 0, G * (S - 1)};
  const Traffic reduce_scatter{(S - 1) / S * n * kReduceBytes, 0, G * (S - 1)};
  const Traffic replica_all_reduce{0, 2 * (R - 1) / R * n / S * kReduceBytes, G * 2 * (R - 1)};
  return gather * weight_gathers(strategy) + reduce_scatter + replica_all_reduce;
}

// The same gathers and reduce-scatter over all W = R x S ranks, no all-reduce. A ring over W
// has each rank send (W-1)/W x flat per collective, in W-1 steps. NCCL splits a collective over
// channels, one ring each, and with a NIC per GPU gives each channel its own NIC: each ring
// leaves each node once, at a different rank per channel, so 1/S of a rank's sends (its
// channel's) go across nodes and (S-1)/S over NVLink (on one node, R = 1, all of them):
//   per collective (W-1)/W x flat x 2 B, of it 1/S across nodes and (S-1)/S within;
//   W-1 steps per group.
Traffic flat_fsdp_traffic_ring(const ModelElements& elements, MeshShape mesh,
                               ShardingStrategy strategy) {
  const double W = mesh.world_size(), S = mesh.shard_size, G = elements.groups;
  const double sent = (W - 1) / W * static_cast<double>(elements.flat);
  const double across = mesh.replicas > 1 ? 1 / S : 0;
  const Traffic per_byte{sent * (1 - across), sent * across, 0};
  const Traffic steps{0, 0, G * (W - 1)};
  const double collectives = weight_gathers(strategy) + 1;
  return per_byte * (weight_gathers(strategy) * kComputeBytes + kReduceBytes) + steps * collectives;
}

// The bound where every rank sends its 1/W of the buffer (all-gather) or its partial sum of
// another rank's 1/W (reduce-scatter) to each of the W-1 others directly, as the planner models
// the optimizer's exchange; W-S of them are on other nodes:
//   per collective (W-S)/W x flat x 2 B across nodes and (S-1)/W x flat x 2 B within;
//   W-1 steps per group (a message to each other rank), as the ring's, so that it bounds it.
Traffic flat_fsdp_traffic_direct(const ModelElements& elements, MeshShape mesh,
                                 ShardingStrategy strategy) {
  const double W = mesh.world_size(), S = mesh.shard_size, G = elements.groups;
  const double n = static_cast<double>(elements.flat);
  const Traffic per_byte{(S - 1) / W * n, (W - S) / W * n, 0};
  const Traffic steps{0, 0, G * (W - 1)};
  const double collectives = weight_gathers(strategy) + 1;
  return per_byte * (weight_gathers(strategy) * kComputeBytes + kReduceBytes) + steps * collectives;
}

// DMuon's partition (dmuon/_core/partition.py): LPT over all W = R x S ranks by the owner's
// optimizer cost; here plan_matrix_flops, each matrix whole to the least-loaded rank (ties: the
// lowest), most expensive first. World rank r is shard column r % S of replica r / S.
DedicatedOwners dedicated_owners(const std::vector<fsdp_muon::PlanGroup>& groups, MeshShape mesh) {
  std::vector<std::pair<int64_t, int64_t>> matrices;  // (cost, elements)
  for (const auto& g : groups) {
    for (const auto& m : g.matrices) {
      matrices.emplace_back(fsdp_muon::plan_matrix_flops(m), m.rows * m.cols);
    }
  }
  std::stable_sort(matrices.begin(), matrices.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  using Load = std::pair<int64_t, int>;  // (cost so far, rank)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> least;
  for (int r = 0; r < mesh.world_size(); ++r) least.push({0, r});
  std::vector<int64_t> column_numel(mesh.shard_size, 0);
  DedicatedOwners owners;
  for (const auto& [cost, numel] : matrices) {
    auto [load, rank] = least.top();
    least.pop();
    load += cost;
    owners.critical_path = std::max(owners.critical_path, load);
    column_numel[rank % mesh.shard_size] += numel;
    least.push({load, rank});
  }
  owners.busiest_column_numel = *std::max_element(column_numel.begin(), column_numel.end());
  return owners;
}

// Per rank per step, from DMuon's design (docs/reference/communication-cost.md, Theorem 3;
// docs/guides/hsdp.md), P_M the matrix elements and B the elements owned in a shard column (the
// busiest's), each matrix owned by rank (s, r):
//  - forward: in every replica, shard rank s broadcasts the matrix (compute dtype) to its node
//    (one layer's owners' broadcasts coalesced); in a ring broadcast every rank but the last
//    forwards it:
//      (S-1)/S x P_M x 2 B per rank on average, within the node; S-1 steps per group;
//    ZeRO-3 (DMuon-Z3) frees it after forward and broadcasts it again in backward;
//  - backward: each gradient reduced (avg) to shard rank s in every node, then across column s's
//    replicas to the owner (a ring reduce: each rank but the root sends it once):
//      (S-1)/S x P_M x 2 B within, (R-1)/R x B x 2 B across; S-1 + R-1 steps per group;
//  - the step: no exchange (the owner holds the whole gradient and the momentum), Newton–Schulz
//    once per world; then the owner broadcasts its updated master copy (_owned_data, fp32) to
//    column s of the other replicas:
//      (R-1)/R x B x 4 B across; R-1 steps per group;
//  - the other parameters: FSDP2's HSDP, hsdp_fsdp_traffic's bytes on their elements (padding
//    left out); its steps run on FSDP2's streams beside DMuon's, as many, so not added.
Traffic dmuon_traffic(const ModelElements& elements, const DedicatedOwners& owners, MeshShape mesh,
                      ShardingStrategy strategy) {
  const double S = mesh.shard_size, R = mesh.replicas, G = elements.groups;
  const double matrices = static_cast<double>(elements.matrices);
  const double column = static_cast<double>(owners.busiest_column_numel);
  const Traffic broadcast{(S - 1) / S * matrices * kComputeBytes, 0, G * (S - 1)};
  const Traffic reduce{(S - 1) / S * matrices * kReduceBytes, (R - 1) / R * column * kReduceBytes,
                       G * (S - 1 + R - 1)};
  const Traffic publish{0, (R - 1) / R * column * kMasterBytes, G * (R - 1)};
  ModelElements others = elements;
  others.flat = elements.others;
  Traffic other_parameters = hsdp_fsdp_traffic(others, mesh, strategy);
  other_parameters.latency_steps = 0;
  return broadcast * weight_gathers(strategy) + reduce + publish + other_parameters;
}

}  // namespace fsdp_muon_bench
