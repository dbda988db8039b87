#include "checkpoint/failure_injection.h"

#include <cstdlib>
#include <mutex>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp_muon {
namespace {

std::mutex g_mutex;
int64_t g_fail_after = -1;  // completed writes to let through first; negative: disarmed
InjectedFailure g_kind = InjectedFailure::kCrash;
bool g_env_read = false;
constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;
int64_t g_chunk_bytes = kDefaultChunkBytes;
int64_t g_sync_fail_after = -1;  // folder fsyncs to let through first; negative: disarmed
std::function<void(bool)> g_latest_hook;

}  // namespace

namespace checkpoint {

InjectedFailure take_injected_failure(const char* api) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_env_read) {
    g_env_read = true;
    if (const char* env = std::getenv("FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES")) {
      char* end = nullptr;
      const long long n = std::strtoll(env, &end, 10);
      TORCH_CHECK(end != env && *end == '\0', api, ": FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES='", env,
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
  std::lock_guard<std::mutex> lock(g_mutex);
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
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    hook = g_latest_hook;
  }
  if (hook) hook(after);
}

int64_t checkpoint_chunk_bytes() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_chunk_bytes;
}

}  // namespace checkpoint

namespace detail {

void set_checkpoint_chunk_bytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_chunk_bytes = bytes > 0 ? bytes : kDefaultChunkBytes;
}

void set_checkpoint_folder_sync_failure(int64_t syncs) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_sync_fail_after = syncs;
}

void set_checkpoint_latest_read_hook(std::function<void(bool after)> hook) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_latest_hook = std::move(hook);
}

void set_checkpoint_failure_injection(int64_t files, InjectedFailure kind) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_env_read = true;
  g_fail_after = files;
  g_kind = kind;
}

}  // namespace detail
}  // namespace fsdp_muon
