// The watchdog that bounds the NCCL communicator's blocking calls (docs/DESIGN.md §5): a call
// that outlasts the timeout reaches the handler once, with its names; calls that end in time
// never do; the NCCL handler's way out (terminate_with) prints the message and ends the process.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "comm/call_watchdog.h"

namespace fsdp_muon::detail {
namespace {

using std::chrono::milliseconds;

struct Reports {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<std::string> calls;

  CallWatchdog::Handler handler() {
    return [this](const char* what, const char* call, milliseconds elapsed) {
      const std::lock_guard<std::mutex> lock(mutex);
      calls.push_back(std::string(what) + "/" + call + "/" +
                      (elapsed >= milliseconds(50) ? "late" : "early"));
      changed.notify_all();
    };
  }
  // Waits (at most `bound`) until `n` reports arrived; returns the reports.
  std::vector<std::string> wait_for(size_t n, milliseconds bound) {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait_for(lock, bound, [&] { return calls.size() >= n; });
    return calls;
  }
};

TEST(CallWatchdog, ACallPastTheTimeoutReachesTheHandlerOnceWithItsNames) {
  Reports reports;
  CallWatchdog watchdog(milliseconds(50), reports.handler());
  {
    const CallWatchdog::Scope scope(watchdog, "all_gather", "ncclAllGather");
    // Held until the handler has run, and then some more: it must not run twice.
    EXPECT_EQ(reports.wait_for(1, milliseconds(20000)),
              std::vector<std::string>{"all_gather/ncclAllGather/late"});
    std::this_thread::sleep_for(milliseconds(200));
  }
  EXPECT_EQ(reports.wait_for(2, milliseconds(200)).size(), 1u);
}

TEST(CallWatchdog, CallsThatEndInTimeNeverReachTheHandler) {
  Reports reports;
  CallWatchdog watchdog(milliseconds(50), reports.handler());
  // Many short calls over several timeouts: none of them is ever 50 ms old.
  const auto until = std::chrono::steady_clock::now() + milliseconds(300);
  int calls = 0;
  while (std::chrono::steady_clock::now() < until) {
    const CallWatchdog::Scope scope(watchdog, "all_reduce", "ncclAllReduce");
    ++calls;
  }
  EXPECT_GT(calls, 0);
  EXPECT_TRUE(reports.wait_for(1, milliseconds(200)).empty());
  // A later call that does outlast the timeout is still reported: the watchdog is alive.
  watchdog.begin("broadcast", "ncclBroadcast");
  EXPECT_EQ(reports.wait_for(1, milliseconds(20000)),
            std::vector<std::string>{"broadcast/ncclBroadcast/late"});
  watchdog.end();
}

TEST(CallWatchdog, EachLateCallIsReported) {
  Reports reports;
  CallWatchdog watchdog(milliseconds(50), reports.handler());
  for (const char* call : {"ncclAllGather", "ncclReduceScatter"}) {
    const size_t before = reports.wait_for(0, milliseconds(0)).size();
    const CallWatchdog::Scope scope(watchdog, "x", call);
    ASSERT_EQ(reports.wait_for(before + 1, milliseconds(20000)).size(), before + 1) << call;
  }
  EXPECT_EQ(reports.wait_for(2, milliseconds(0)),
            (std::vector<std::string>{"x/ncclAllGather/late", "x/ncclReduceScatter/late"}));
}

TEST(CallWatchdog, RejectsAZeroTimeoutAndAnEmptyHandler) {
  Reports reports;
  try {
    CallWatchdog watchdog(milliseconds(0), reports.handler());
    ADD_FAILURE() << "a zero timeout was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("timeout must be positive, got 0 ms"),
              std::string::npos);
  }
  try {
    CallWatchdog watchdog(milliseconds(10), CallWatchdog::Handler());
    ADD_FAILURE() << "an empty handler was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("the expiry handler is empty"),
              std::string::npos);
  }
}

TEST(CallWatchdogDeathTest, TerminateWithPrintsTheMessageAndExitsWithItsStatus) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(terminate_with("fsdp_muon::Communicator::all_gather: nccl on rank 1 of 2"),
              testing::ExitedWithCode(kWatchdogExitStatus),
              "fsdp_muon::Communicator::all_gather: nccl on rank 1 of 2");
}

// The NCCL communicator's expiry message, which only a hung multi-GPU launch would print (the
// GPU tests run at W=1, where NCCL never blocks: tests/comm/nccl_communicator_test.cpp).
TEST(CallWatchdog, TheNcclMessageNamesTheCallTheRankTheDeviceAndWhy) {
  const std::string message =
      nccl_launch_timeout_message("fsdp_muon::Communicator::all_gather_async", "ncclAllGather", 3,
                                  8, 2, milliseconds(10250), milliseconds(10000));
  EXPECT_EQ(message.rfind("fsdp_muon::Communicator::all_gather_async: nccl on rank 3 of 8 "
                          "(cuda:2): ncclAllGather has not returned after 10250 ms (the limit "
                          "is 10000 ms, twice the communicator's timeout)",
                          0),
            0u)
      << message;
  EXPECT_NE(message.find("NCCL cannot abort a call another thread is inside, so the process "
                         "ends here (exit status 124)"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace fsdp_muon::detail
