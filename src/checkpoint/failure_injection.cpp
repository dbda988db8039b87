#include "checkpoint/failure_injection.h"

#include <cstdlib>
#include <mutex>

#include <c10/util/Exception.h>

namespace fsdp_muon {
namespace {

std::mutex g_mutex;
int64_t g_fail_after = -1;  // completed writes to let through first; negative: disarmed
bool g_env_read = false;

}  // namespace

namespace checkpoint {

bool take_injected_failure(const char* api) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_env_read) {
    g_env_read = true;
    if (const char* env = std::getenv("FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES")) {
      char* end = nullptr;
      const long long n = std::strtoll(env, &end, 10);
      TORCH_CHECK(end != env && *end == '\0', api, ": FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES='", env,
                  "' is not an integer");
      if (g_fail_after < 0) g_fail_after = n;
    }
  }
  if (g_fail_after < 0) return false;
  if (g_fail_after == 0) {
    g_fail_after = -1;
    return true;
  }
  --g_fail_after;
  return false;
}

}  // namespace checkpoint

namespace detail {

void set_checkpoint_failure_injection(int64_t files) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_env_read = true;
  g_fail_after = files;
}

}  // namespace detail
}  // namespace fsdp_muon
