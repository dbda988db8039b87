#include "comm/device_choice.h"

#include <fsdp_muon/config.h>

#include <unistd.h>

#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace fsdp_muon::detail {

int choose_cuda_device(int visible_devices, const LaunchEnvironment& e) {
  if (visible_devices == 1) {
    return 0;
  }
  const std::string from = e.local_rank_variable.empty()
                               ? std::string("no local rank variable set, so 0")
                               : "from " + e.local_rank_variable;
  TORCH_CHECK(visible_devices > 0,
              "fsdp_muon::init_from_env: NCCL needs a CUDA device, but none "
              "is visible to ",
              e.launcher, " rank ", e.rank,
              " (check CUDA_VISIBLE_DEVICES and the GPUs the launcher gave this process)");
  TORCH_CHECK(e.local_rank >= 0 && e.local_rank < visible_devices,
              "fsdp_muon::init_from_env: local rank ", e.local_rank, " (", from,
              ") has no CUDA device: ", visible_devices, " are visible to ", e.launcher, " rank ",
              e.rank,
              ", so the local rank chooses among them; start at most one process per "
              "visible GPU on each node, or give each process exactly one GPU "
              "(CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1), which it then uses whatever its "
              "local rank");
  return e.local_rank;
}

namespace {

std::vector<uint8_t> bytes_of(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::string text_of(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace

void check_one_rank_per_device(c10d::Store& store, int rank, int world_size,
                               const std::string& placement, std::chrono::milliseconds timeout) {
  store.setTimeout(timeout);
  // The first rank to claim a placement owns it; a later one learns the owner and records the
  // first conflict for everyone.
  const std::string me = std::to_string(rank);
  const std::string owner = text_of(store.compareSet("device/" + placement, {}, bytes_of(me)));
  if (owner != me) {
    store.compareSet("device_conflict", {},
                     bytes_of("ranks " + owner + " and " + me + " both use " + placement));
  }
  // The last rank to check in publishes that all have; then every rank reads the same verdict.
  if (store.add("device_checked", 1) == world_size) store.set("device_check_done", bytes_of("1"));
  store.wait({"device_check_done"});
  if (store.check({"device_conflict"})) {
    TORCH_CHECK(false, "fsdp_muon::init_from_env: NCCL needs one GPU per rank, but ",
                text_of(store.get("device_conflict")),
                " (host and PCI bus id); start at most one process per GPU on each node, "
                "give each process its own GPU (CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1), "
                "or use the gloo backend (FSDP_MUON_BACKEND=gloo)");
  }
}

#if FSDP_MUON_WITH_CUDA
std::string cuda_device_placement(int device) {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return std::string(host) + " " + cuda_pci_bus_id(device);
}
#else
std::string cuda_device_placement(int /*device*/) {
  TORCH_CHECK(false, "fsdp_muon::init_from_env: this build of fsdp_muon has no CUDA");
}
#endif

}  // namespace fsdp_muon::detail
