#include <fsdp_muon/comm/device_mesh.h>

#include <utility>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "comm/launch_environment.h"
#include "comm/single_rank_communicator.h"
#include "common/check.h"

namespace fsdp_muon {
namespace {

// Every rank's shard_size, so that a rank passing another value fails everywhere, naming it.
std::vector<int64_t> shard_sizes_of_every_rank(Communicator& world, int shard_size) {
  at::Tensor mine = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  mine.data_ptr<int64_t>()[0] = shard_size;
  mine = world.to_device(mine);
  const at::Tensor all = at::empty({world.size()}, mine.options());
  world.all_gather(mine, all);
  const at::Tensor host = world.to_host(all).contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + world.size());
}

}  // namespace

std::string DeviceMesh::shape() const {
  return std::to_string(replicas()) + "x" + std::to_string(shard_size());
}

DeviceMesh one_dimensional_mesh(std::shared_ptr<Communicator> comm) {
  FSDP_MUON_API_SCOPE("one_dimensional_mesh");
  FSDP_MUON_CHECK(comm, "the communicator is null");
  auto one = detail::make_single_rank_communicator(comm->device(), comm->backend_name());
  return DeviceMesh{comm, comm, std::move(one)};
}

DeviceMesh make_device_mesh(std::shared_ptr<Communicator> world, int shard_size) {
  FSDP_MUON_API_SCOPE("make_device_mesh");
  FSDP_MUON_CHECK(world, "the world communicator is null");
  const int size = world->size();
  if (size > 1) {
    const std::vector<int64_t> sizes = shard_sizes_of_every_rank(*world, shard_size);
    for (int r = 0; r < size; ++r) {
      FSDP_MUON_CHECK(sizes[r] == sizes[0], "rank ", r, " passed shard_size=", sizes[r],
                      " but rank 0 passed ", sizes[0],
                      "; every rank must pass the same shard size");
    }
  }
  FSDP_MUON_CHECK(shard_size >= 1 && shard_size <= size && size % shard_size == 0,
                  "shard_size=", shard_size, " does not divide the world size ", size,
                  "; pass a divisor of it (the ranks per node, e.g. ", size, " for one replica)");
  if (shard_size == size) return one_dimensional_mesh(std::move(world));
  const int rank = world->rank();
  // Replica-major: the shard groups are contiguous blocks of ranks.
  auto shard = world->split(/*color=*/rank / shard_size, /*key=*/rank % shard_size);
  auto replicate = world->split(/*color=*/rank % shard_size, /*key=*/rank / shard_size);
  return DeviceMesh{std::move(world), std::move(shard), std::move(replicate)};
}

DeviceMesh init_mesh_from_env(std::optional<int> shard_size, const InitOptions& options) {
  FSDP_MUON_API_SCOPE("init_mesh_from_env");
  if (!shard_size) {
    const detail::LaunchEnvironment e = detail::read_launch_environment_here();
    FSDP_MUON_CHECK(e.local_world_size > 0, "the ", e.launcher,
                    " launcher gives no number of ranks per node (LOCAL_WORLD_SIZE, "
                    "OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_STEP_TASKS_PER_NODE or MPI_LOCALNRANKS with "
                    "the same count on every node); pass shard_size");
    shard_size = e.local_world_size;
  }
  return make_device_mesh(init_from_env(options), *shard_size);
}

}  // namespace fsdp_muon
