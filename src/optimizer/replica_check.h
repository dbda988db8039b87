#pragma once
// FsdpMuonConfig::check_replicas_every (docs/DESIGN.md §3, "Replica check"): on a mesh of several
// replicas every replica must hold the same main-weight shards. Every N steps each rank hashes
// its shards; the hashes ride in the step's agreement all-reduce, and only when a replica
// differs do the per-parameter hashes travel, to name the replica and the parameter.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/fsdp/parameter_group.h>

namespace fsdp_muon::detail {

// [group][parameter] a 64-bit hash of this rank's shard of each parameter's main weights: the
// sum, wrapping mod 2^64, of each element's bit pattern times an odd weight of its position.
// Integer sums are exact in any order, so replicas holding the same bits get the same hash on any
// device or thread count, and a change of any one element always changes it. One host copy.
std::vector<std::vector<uint64_t>> shard_hashes(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups, Communicator& comm);

// The two agreement entries of a group, from its parameters' hashes: [0] mix of the group's hash
// on every rank, [1] the same on replica 0 only. Summed over the world, the replicas agree on the
// group exactly when [0] == replicas * [1] (barring a 40-bit collision).
std::pair<int64_t, int64_t> replica_entries(const std::vector<uint64_t>& parameter_hashes,
                                            int replica);

// Only once the sums said that some group differs: gathers every rank's per-parameter hashes
// (two all-gathers over the world) and throws on every rank the same error, naming the first
// replica, shard rank and parameter whose shard differs from replica 0's.
[[noreturn]] void throw_replica_divergence(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups, const DeviceMesh& mesh,
    const std::vector<std::vector<uint64_t>>& hashes, int64_t step_call);

}  // namespace fsdp_muon::detail
