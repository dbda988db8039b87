#include "checkpoint/failure_injection.h"

#include <cstdlib>
#include <utility>

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon {
namespace {

// Per thread: a process of a launched job does its checkpoint I/O on the thread that calls
// save/load, and a test playing several ranks as threads of one process (tests/common) arms
// one rank's hooks without touching the others'.
// Completed writes to let through first; negative: disarmed.
thread_local int64_t g_fail_after = -1;
thread_local InjectedFailure g_kind = InjectedFailure::kCrash;
thread_local bool g_env_read = false;
constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;
thread_local int64_t g_chunk_bytes = kDefaultChunkBytes;
// Folder fsyncs to let through first; negative: disarmed.
thread_local int64_t g_sync_fail_after = -1;
thread_local std::function<void(bool)> g_latest_hook;

}  // namespace

namespace checkpoint {

InjectedFailure take_injected_failure() {
  if (!g_env_read) {
    g_env_read = true;
    if (const char* env = std::getenv("FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES")) {
      char* end = nullptr;
      const long long n = std::strtoll(env, &end, 10);
      FSDP_MUON_CHECK(end != env && *end == '\0', "FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES='", env,
                      "' is not an integer");
      if (g_fail_after < 0) {
        g_fail_after = n;
        g_kind = InjectedFailure::kCrash;
      }
    }
  }
  if (g_fail_after < 0) return InjectedFailure::kNone;
  if (g_fail_after == 0) {
    g_fail_after = -1;
    return g_kind;
  }
  --g_fail_after;
  return InjectedFailure::kNone;
}

bool take_injected_folder_sync_failure() {
  if (g_sync_fail_after < 0) return false;
  if (g_sync_fail_after == 0) {
    g_sync_fail_after = -1;
    return true;
  }
  --g_sync_fail_after;
  return false;
}

void run_latest_read_hook(bool after) {
  std::function<void(bool)> hook;
  { hook = g_latest_hook; }
  if (hook) hook(after);
}

int64_t checkpoint_chunk_bytes() { return g_chunk_bytes; }

}  // namespace checkpoint

namespace detail {

void set_checkpoint_chunk_bytes(int64_t bytes) {
  g_chunk_bytes = bytes > 0 ? bytes : kDefaultChunkBytes;
}

void set_checkpoint_folder_sync_failure(int64_t syncs) { g_sync_fail_after = syncs; }

void set_checkpoint_latest_read_hook(std::function<void(bool after)> hook) {
  g_latest_hook = std::move(hook);
}

void set_checkpoint_failure_injection(int64_t files, InjectedFailure kind) {
  g_env_read = true;
  g_fail_after = files;
  g_kind = kind;
}

}  // namespace detail
}  // namespace fsdp_muon
