#pragma once
// A watchdog for blocking library calls made on the caller's thread (docs/DESIGN.md §5): the
// caller marks a call's start and end (two atomic stores, no lock, no system call), and one
// thread per watchdog, waking a few times per timeout, runs the expiry handler once when a call
// has been running longer than the timeout. The NCCL communicator uses it for its blocking
// launches (which can wait for peers and for the GPU); its handler ends the process, because
// NCCL cannot abort a call that another thread is inside (§5).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace fsdp_muon::detail {

class CallWatchdog {
 public:
  // `what`: the library call (e.g. "fsdp_muon::Communicator::all_gather"); `call`: the call it
  // is blocked in (e.g. "ncclAllGather"); `elapsed`: how long it has been running.
  using Handler =
      std::function<void(const char* what, const char* call, std::chrono::milliseconds elapsed)>;

  // Starts the watchdog thread. `timeout` > 0.
  CallWatchdog(std::chrono::milliseconds timeout, Handler on_expiry);
  ~CallWatchdog();  // stops and joins the thread
  CallWatchdog(const CallWatchdog&) = delete;
  CallWatchdog& operator=(const CallWatchdog&) = delete;

  // One call at a time (the calls it watches are never concurrent: NCCL forbids it). Both
  // strings must outlive the call (string literals).
  void begin(const char* what, const char* call) noexcept;
  void end() noexcept;

  // begin() on construction, end() on destruction.
  class Scope {
   public:
    Scope(CallWatchdog& watchdog, const char* what, const char* call) noexcept
        : watchdog_(watchdog) {
      watchdog_.begin(what, call);
    }
    ~Scope() { watchdog_.end(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CallWatchdog& watchdog_;
  };

  std::chrono::milliseconds timeout() const { return timeout_; }
  // Whether a call is being watched now (another thread's, for a caller that must not touch the
  // object that call is using).
  bool busy() const noexcept { return started_ns_.load() != 0; }

 private:
  void run();

  const std::chrono::milliseconds timeout_;
  const Handler on_expiry_;
  // Nanoseconds since the steady clock's epoch at begin(); 0 while no call runs. The watchdog
  // reads it before and after the names: the same nonzero value twice means the names belong
  // to that call.
  std::atomic<int64_t> started_ns_{0};
  std::atomic<const char*> what_{""};
  std::atomic<const char*> call_{""};
  std::mutex mutex_;
  std::condition_variable stop_signal_;
  bool stopping_ = false;
  std::thread thread_;
};

// The exit status of a process the watchdog ended (as timeout(1) uses for a command it ended).
constexpr int kWatchdogExitStatus = 124;

// Writes `message` and a newline to stderr (one write(2), no stdio lock) and ends the process
// with _exit(kWatchdogExitStatus): no atexit handlers, no SIGABRT handler, no core dump, so the
// end is as bounded as the wait that led to it.
[[noreturn]] void terminate_with(const std::string& message);

// What the NCCL communicator's watchdog prints: the watched call `what` (its own thread cannot
// read the caller's ApiScope, so the name travels with the call), the NCCL call it is blocked
// in, the rank, the device, how long, and why the process ends instead of throwing.
std::string nccl_launch_timeout_message(const char* what, const char* call, int rank, int size,
                                        int device_index, std::chrono::milliseconds elapsed,
                                        std::chrono::milliseconds limit);

// The same for an ncclCommAbort that does not return (it waits for the device's streams, which
// may wait for another communicator's kernel stuck on a dead peer), with `cause`: the error the
// abort was for, which would otherwise be lost with the process.
std::string nccl_abort_timeout_message(const char* what, int rank, int size, int device_index,
                                       std::chrono::milliseconds elapsed,
                                       std::chrono::milliseconds limit, const std::string& cause);

}  // namespace fsdp_muon::detail
