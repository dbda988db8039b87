#pragma once
// A replicate x shard device mesh for HSDP (docs/DESIGN.md §5, Meshes): parameters are sharded
// within a shard group (a node's fast links) and replicated across the groups (the slower
// network between nodes).

#include <memory>
#include <optional>
#include <string>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/config.h>

namespace fsdp_muon {

// Ranks are replica-major: world rank = replica() * shard_size() + shard->rank(), so a shard
// group is a contiguous block of world ranks (one node when shard_size() is the launcher's local
// world size). Two meshes are the same mesh when their world and shard communicators are the
// same objects.
struct FSDP_MUON_API DeviceMesh {
  std::shared_ptr<Communicator> world;      // every rank
  std::shared_ptr<Communicator> shard;      // the shard_size() ranks of this rank's replica
  std::shared_ptr<Communicator> replicate;  // the replicas() ranks with this rank's shard rank

  int replicas() const { return replicate->size(); }
  int shard_size() const { return shard->size(); }
  // Which replica this rank is in.
  int replica() const { return replicate->rank(); }
  int world_rank(int replica, int shard_rank) const { return replica * shard_size() + shard_rank; }
  // One replica: shard is world, and nothing is replicated (plain FSDP).
  bool one_dimensional() const { return replicas() == 1; }
  // "<replicas>x<shard_size>", for messages and reports.
  std::string shape() const;
  bool same_as(const DeviceMesh& other) const {
    return world == other.world && shard == other.shard;
  }
};

// Collective over `world`: splits it into world->size() / shard_size replicas of shard_size
// ranks each. shard_size must divide the world size and be the same on every rank; otherwise
// every rank throws, naming both. shard_size == world->size() is the 1-D mesh of
// one_dimensional_mesh(world), with no split and nothing sent.
FSDP_MUON_API DeviceMesh make_device_mesh(std::shared_ptr<Communicator> world, int shard_size);

// The 1-D mesh of `comm`: world and shard are `comm`, replicate a communicator of one rank. Not
// a collective; what a group built from a communicator uses.
FSDP_MUON_API DeviceMesh one_dimensional_mesh(std::shared_ptr<Communicator> comm);

// init_from_env(options), then make_device_mesh() with `shard_size`, by default the number of
// ranks the launcher started on this node (LOCAL_WORLD_SIZE under torchrun,
// OMPI_COMM_WORLD_LOCAL_SIZE under mpirun, SLURM_NTASKS_PER_NODE under srun, MPI_LOCALNRANKS
// under PMI); a single process is a mesh of one. A launcher that gives no local size needs
// shard_size, and says so.
FSDP_MUON_API DeviceMesh init_mesh_from_env(std::optional<int> shard_size = std::nullopt,
                                            const InitOptions& options = {});

}  // namespace fsdp_muon
