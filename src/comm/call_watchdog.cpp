#include "comm/call_watchdog.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon::detail {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

CallWatchdog::CallWatchdog(std::chrono::milliseconds timeout, Handler on_expiry)
    : timeout_(timeout), on_expiry_(std::move(on_expiry)) {
  FSDP_MUON_API_SCOPE("CallWatchdog");
  FSDP_MUON_CHECK(timeout.count() > 0, "timeout must be positive, got ", timeout.count(), " ms");
  FSDP_MUON_CHECK(on_expiry_, "the expiry handler is empty");
  thread_ = std::thread([this] { run(); });
}

CallWatchdog::~CallWatchdog() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_signal_.notify_all();
  thread_.join();
}

void CallWatchdog::begin(const char* what, const char* call) noexcept {
  what_.store(what, std::memory_order_relaxed);
  call_.store(call, std::memory_order_relaxed);
  // Release: a watchdog that sees this start also sees the names stored before it.
  started_ns_.store(std::max<int64_t>(now_ns(), 1), std::memory_order_release);
}

void CallWatchdog::end() noexcept { started_ns_.store(0, std::memory_order_release); }

void CallWatchdog::run() {
  // A call is noticed at most one period after its deadline; waking a few times per timeout
  // costs nothing measurable, and the caller pays no system call for being watched.
  const auto period =
      std::clamp(timeout_ / 4, std::chrono::milliseconds(1), std::chrono::milliseconds(1000));
  const int64_t timeout_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout_).count();
  int64_t reported = 0;  // the call already reported (the handler runs once per call)
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_signal_.wait_for(lock, period, [this] { return stopping_; })) {
    const int64_t started = started_ns_.load(std::memory_order_acquire);
    if (started == 0 || started == reported) continue;
    const char* what = what_.load(std::memory_order_relaxed);
    const char* call = call_.load(std::memory_order_relaxed);
    // The names are this call's only if it is still the one running.
    if (started_ns_.load(std::memory_order_acquire) != started) continue;
    const int64_t elapsed = now_ns() - started;
    if (elapsed <= timeout_ns) continue;
    reported = started;
    lock.unlock();
    on_expiry_(
        what, call,
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::nanoseconds(elapsed)));
    lock.lock();
  }
}

void terminate_with(const std::string& message) {
  const std::string line = message + "\n";
  size_t written = 0;
  while (written < line.size()) {
    const ssize_t n = ::write(STDERR_FILENO, line.data() + written, line.size() - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  ::_exit(kWatchdogExitStatus);
}

std::string nccl_launch_timeout_message(const char* what, const char* call, int rank, int size,
                                        int device_index, std::chrono::milliseconds elapsed,
                                        std::chrono::milliseconds limit) {
  return std::string(what) + ": nccl on rank " + std::to_string(rank) + " of " +
         std::to_string(size) + " (cuda:" + std::to_string(device_index) + "): " + call +
         " has not returned after " + std::to_string(elapsed.count()) + " ms (the limit is " +
         std::to_string(limit.count()) +
         " ms, twice the communicator's timeout): a rank missing or stuck, while NCCL connects "
         "to its peers or queues behind kernels waiting for one. NCCL cannot abort a call "
         "another thread is inside, so the process ends here (exit status " +
         std::to_string(kWatchdogExitStatus) + ")";
}

std::string nccl_abort_timeout_message(const char* what, int rank, int size, int device_index,
                                       std::chrono::milliseconds elapsed,
                                       std::chrono::milliseconds limit, const std::string& cause) {
  return std::string(what) + ": nccl on rank " + std::to_string(rank) + " of " +
         std::to_string(size) + " (cuda:" + std::to_string(device_index) +
         "): ncclCommAbort has not returned after " + std::to_string(elapsed.count()) +
         " ms (the limit is " + std::to_string(limit.count()) +
         " ms, twice the communicator's timeout): it waits for this device's streams, which wait "
         "for a kernel stuck on a missing peer (of this or another communicator on the device). "
         "The error it was aborting for: " +
         (cause.empty() ? std::string("(none recorded)") : cause) +
         ". The process ends here (exit status " + std::to_string(kWatchdogExitStatus) + ")";
}

}  // namespace fsdp_muon::detail
