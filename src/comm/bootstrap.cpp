// init_from_env (docs/DESIGN.md §5, Launch): the launch environment, the rendezvous store and
// the job's identity (launch_environment.h, rendezvous_store.h, job_identity.h), then the
// backend chosen here and its communicator.

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/gloo_communicator.h>
#include <fsdp_muon/comm/nccl_communicator.h>
#include <fsdp_muon/config.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/cuda.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/device_choice.h"
#include "comm/job_identity.h"
#include "comm/launch_environment.h"
#include "comm/rendezvous_store.h"
#include "common/check.h"
#include "common/enum_names.h"

namespace fsdp_muon {
namespace {

using detail::env_variable;
using detail::LaunchEnvironment;

// Every CommBackend and its name.
constexpr detail::EnumName<CommBackend> kBackendNames[] = {
    {CommBackend::kAuto, "auto"},
    {CommBackend::kNccl, "nccl"},
    {CommBackend::kGloo, "gloo"},
};
static_assert(detail::rows_in_enumerator_order(kBackendNames));

// NCCL drives cuda:<local rank>. Without the local rank every rank of a node would share device
// 0 (and NCCL fails, or worse, runs slowly); checked before CUDA itself so the launch mistake is
// reported as such on any machine.
void check_local_rank_for_nccl(const LaunchEnvironment& e, const std::string& why) {
  FSDP_MUON_CHECK(e.world_size == 1 || !e.local_rank_variable.empty(), "NCCL (", why,
                  ") in a world of ", e.world_size,
                  " ranks needs this rank's local rank to choose its GPU, but none of LOCAL_RANK, ",
                  "OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID is set (", e.launcher,
                  " rank ", e.rank, "); export LOCAL_RANK=<index of this process on its node>, or ",
                  "start the job with torchrun, mpirun or srun, which set it");
}

// The backend to set up: never kAuto.
CommBackend choose_backend(const InitOptions& options, const LaunchEnvironment& e) {
  std::string name = options.backend;
  const char* source = "InitOptions::backend";
  if (name == to_string(CommBackend::kAuto)) {
    if (const auto chosen = env_variable("FSDP_MUON_BACKEND")) {
      name = *chosen;
      source = "FSDP_MUON_BACKEND";
    }
  }
  const std::optional<CommBackend> parsed = parse_comm_backend(name);
  FSDP_MUON_CHECK(parsed, source, "='", name, "' is not one of ", detail::all_names(kBackendNames));
  const bool cuda = FSDP_MUON_WITH_CUDA && torch::cuda::is_available();
  CommBackend backend = *parsed;
  if (backend == CommBackend::kAuto) {
    backend = cuda ? CommBackend::kNccl : CommBackend::kGloo;
    if (backend == CommBackend::kNccl) {
      check_local_rank_for_nccl(e, "chosen by backend auto: CUDA is available");
    }
  } else if (backend == CommBackend::kNccl) {
    check_local_rank_for_nccl(e, std::string("asked for by ") + source);
  }
  switch (backend) {
    case CommBackend::kNccl:
      FSDP_MUON_CHECK(
          FSDP_MUON_WITH_CUDA, source,
          " asks for NCCL but this build of fsdp_muon has no CUDA (LibTorch without CUDA)");
      FSDP_MUON_CHECK(cuda, source,
                      " asks for NCCL but no CUDA device is available to this process");
      break;
    case CommBackend::kGloo:
      FSDP_MUON_CHECK(FSDP_MUON_WITH_GLOO, source, " asks for Gloo but this build of ",
                      "fsdp_muon has none (configured with FSDP_MUON_WITH_GLOO=OFF)");
      break;
    case CommBackend::kAuto:
      break;  // resolved above
  }
  return backend;
}

}  // namespace

const char* to_string(CommBackend backend) { return detail::name_of(kBackendNames, backend); }

std::optional<CommBackend> parse_comm_backend(std::string_view name) {
  return detail::value_named(kBackendNames, name);
}

namespace {

// Longest timeout accepted: far beyond any job, and still exact in milliseconds.
constexpr double kMaxTimeoutSeconds = 1e9;

// InitOptions::timeout_seconds, or FSDP_MUON_TIMEOUT when that is set.
// A decimal number of seconds: digits with an optional fraction and exponent, nothing else.
// strtod alone would also take hexadecimal ("0x10"), "inf" and leading blanks or signs; the
// README promises that any non-number is an error.
bool is_plain_decimal(const std::string& text) {
  size_t i = 0;
  size_t digits = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i, ++digits;
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i, ++digits;
  }
  if (digits == 0) return false;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
    size_t exponent = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i, ++exponent;
    if (exponent == 0) return false;
  }
  return i == text.size();
}

double timeout_seconds(const InitOptions& options) {
  // Set but empty is an error too, not "unset": an empty value is usually a script's mistake.
  if (const char* raw = std::getenv("FSDP_MUON_TIMEOUT")) {
    const std::string text = raw;
    errno = 0;
    char* end = nullptr;
    const double parsed = std::strtod(text.c_str(), &end);
    FSDP_MUON_CHECK(
        is_plain_decimal(text) && end == text.c_str() + text.size() && errno == 0 &&
            std::isfinite(parsed) && parsed > 0 && parsed <= kMaxTimeoutSeconds,
        "FSDP_MUON_TIMEOUT='", text,
        "' is not a timeout in seconds; give a positive number such as 30 or 2.5 (at most ",
        kMaxTimeoutSeconds, "), or unset it to use InitOptions::timeout_seconds");
    return parsed;
  }
  FSDP_MUON_CHECK(std::isfinite(options.timeout_seconds) && options.timeout_seconds > 0 &&
                      options.timeout_seconds <= kMaxTimeoutSeconds,
                  "InitOptions::timeout_seconds=", options.timeout_seconds,
                  " must be positive and finite (at most ", kMaxTimeoutSeconds, " s)");
  return options.timeout_seconds;
}

}  // namespace

std::shared_ptr<Communicator> init_from_env(const InitOptions& options) {
  FSDP_MUON_API_SCOPE("init_from_env");
  const double seconds = timeout_seconds(options);
  const LaunchEnvironment e = detail::read_launch_environment_here();
  const CommBackend backend = choose_backend(options, e);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));

  // Each communicator gets its own key space, numbered in call order (the same on every rank).
  static std::atomic<int> instances{0};
  const int instance = instances++;
  // torchrun restarts its workers against the same agent store: each attempt gets fresh keys.
  const std::string attempt =
      e.launcher == "torchrun" ? env_variable("TORCHELASTIC_RESTART_COUNT").value_or("0") : "0";
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "fsdp_muon/attempt_" + attempt + "/communicator_" + std::to_string(instance),
      detail::base_store(e, timeout));
  std::ostringstream waiting;
  waiting << detail::ApiPrefix{} << "setting up " << to_string(backend) << " for " << e.launcher
          << " rank " << e.rank << " of " << e.world_size << " failed (are all " << e.world_size
          << " processes started and reachable within " << seconds << " s?): ";
  detail::agree_on_job(*store, e, timeout, waiting.str());

  // NCCL: the device (device_choice.h), agreed before anything else, with errors of its own: two
  // ranks on one GPU, each seeing only it, would fail inside NCCL on some ranks only.
  int nccl_device = -1;
  if (backend == CommBackend::kNccl) {
    const int visible = torch::cuda::device_count();
    detail::check_one_rank_per_device(
        *store, e.rank, e.world_size,
        [&] {
          nccl_device = detail::choose_cuda_device(visible, e);
          return detail::cuda_device_placement(nccl_device);
        },
        timeout);
  }

  try {
    switch (backend) {
      case CommBackend::kNccl: {
        // One visible device is this rank's whatever its local rank (srun --gpus-per-task=1);
        // otherwise cuda:<local rank> (device_choice.h).
        const int device = nccl_device;
        // The rank's own GPU becomes the current device, so user code that says kCUDA (and
        // LibTorch's default stream) lands there, not on device 0. The guard interface needs
        // no CUDA headers.
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
            ->setDevice(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
        return make_nccl_communicator(store, e.rank, e.world_size, device, timeout);
      }
      case CommBackend::kGloo: {
        // Without an address every rank is on this node, and loopback always connects there.
        const bool local = e.master_addr.empty() || e.master_addr == "localhost" ||
                           e.master_addr.rfind("127.", 0) == 0;
        return make_gloo_communicator(store, e.rank, e.world_size, timeout,
                                      local ? "127.0.0.1" : "");
      }
      case CommBackend::kAuto:
        break;  // choose_backend never returns it
    }
    FSDP_MUON_CHECK(false, "no communicator for backend ", to_string(backend));
  } catch (const c10::Error& ex) {
    FSDP_MUON_CHECK(false, "setting up ", to_string(backend), " for ", e.launcher, " rank ", e.rank,
                    " of ", e.world_size, " failed (are all ", e.world_size,
                    " processes started and reachable within ", seconds,
                    " s?): ", ex.what_without_backtrace());
  }
}

#if !FSDP_MUON_WITH_CUDA
std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::Store>, int, int, int,
                                                     std::chrono::milliseconds) {
  FSDP_MUON_API_SCOPE("make_nccl_communicator");
  FSDP_MUON_CHECK(false, "this build of fsdp_muon has no CUDA");
}
#endif

#if !FSDP_MUON_WITH_GLOO
std::shared_ptr<Communicator> make_gloo_communicator(c10::intrusive_ptr<c10d::Store>, int, int,
                                                     std::chrono::milliseconds,
                                                     const std::string&) {
  FSDP_MUON_API_SCOPE("make_gloo_communicator");
  FSDP_MUON_CHECK(false, "this build of fsdp_muon has no Gloo");
}
#endif

}  // namespace fsdp_muon
