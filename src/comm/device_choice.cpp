#include "comm/device_choice.h"

#include <fsdp_muon/config.h>

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon::detail {

int choose_cuda_device(int visible_devices, const LaunchEnvironment& e) {
  if (visible_devices == 1) {
    return 0;
  }
  const std::string from = e.local_rank_variable.empty()
                               ? std::string("no local rank variable set, so 0")
                               : "from " + e.local_rank_variable;
  FSDP_MUON_CHECK(visible_devices > 0,
                  "NCCL needs a CUDA device, but none "
                  "is visible to ",
                  e.launcher, " rank ", e.rank,
                  " (check CUDA_VISIBLE_DEVICES and the GPUs the launcher gave this process)");
  FSDP_MUON_CHECK(e.local_rank >= 0 && e.local_rank < visible_devices, "local rank ", e.local_rank,
                  " (", from, ") has no CUDA device: ", visible_devices, " are visible to ",
                  e.launcher, " rank ", e.rank,
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
                               const std::function<std::string()>& placement,
                               std::chrono::milliseconds timeout) {
  store.setTimeout(timeout);
  const std::string me = std::to_string(rank);
  const char* shared = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  const bool shared_allowed = shared != nullptr && std::string(shared) == "1";
  // Whatever happens here, this rank checks in, so no rank waits out the timeout for it.
  try {
    const std::string where = placement();
    // The first rank to claim a placement owns it; a later one records the first conflict.
    const std::string owner = text_of(store.compareSet("device/" + where, {}, bytes_of(me)));
    if (owner != me && !shared_allowed) {
      store.compareSet("device_conflict", {},
                       bytes_of("ranks " + owner + " and " + me + " both use " + where));
    }
  } catch (const c10::Error& ex) {
    store.compareSet("device_error", {},
                     bytes_of("rank " + me + ": " + ex.what_without_backtrace()));
  } catch (const std::exception& ex) {
    store.compareSet("device_error", {}, bytes_of("rank " + me + ": " + ex.what()));
  }
  // The last rank to check in publishes that all have; then every rank reads the same verdict.
  if (store.add("device_checked", 1) == world_size) store.set("device_check_done", bytes_of("1"));
  try {
    store.wait({"device_check_done"});
  } catch (const std::exception&) {
    FSDP_MUON_CHECK(false, "only ", store.add("device_checked", 0), " of ", world_size,
                    " ranks reached the GPU check within ", timeout.count(), " ms (this is rank ",
                    rank, "); a rank failed or stalled before it");
  }
  if (store.check({"device_error"})) {
    FSDP_MUON_CHECK(false, "choosing the GPU failed on ", text_of(store.get("device_error")));
  }
  if (store.check({"device_conflict"})) {
    FSDP_MUON_CHECK(false, "NCCL needs one GPU per rank, but ",
                    text_of(store.get("device_conflict")),
                    " (host and PCI bus id); start at most one process per GPU on each node, "
                    "give each process its own GPU (CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1), "
                    "set NCCL_MULTI_RANK_GPU_ENABLE=1 where your NCCL supports ranks sharing a GPU "
                    "(MIG), or use the gloo backend (FSDP_MUON_BACKEND=gloo)");
  }
}

std::string host_identity() {
  if (const char* id = std::getenv("NCCL_HOSTID"); id != nullptr && *id != 0) return id;
  char host[256] = {0};
  FSDP_MUON_CHECK(::gethostname(host, sizeof(host) - 1) == 0, "gethostname failed");
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot_id);
  return std::string(host) + (boot_id.empty() ? "" : "/" + boot_id);
}

#if FSDP_MUON_WITH_CUDA
std::string cuda_device_placement(int device) {
  return host_identity() + " " + cuda_pci_bus_id(device);
}
#else
std::string cuda_device_placement(int /*device*/) {
  FSDP_MUON_CHECK(false, "this build of fsdp_muon has no CUDA");
}
#endif

}  // namespace fsdp_muon::detail
