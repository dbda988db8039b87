// The failure domain (comm/failure_domain.h): the logic that makes a failure of one NCCL
// communicator abort every other communicator on its device, tested with plain callbacks.

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm/failure_domain.h"

namespace fsdp_muon::detail {
namespace {

// One member's record of its aborts.
struct Recorder {
  std::mutex mutex;
  std::vector<std::string> causes;
  std::vector<std::thread::id> threads;
  FailureDomain::Abort abort() {
    return [this](const std::string& cause) {
      std::lock_guard<std::mutex> lock(mutex);
      causes.push_back(cause);
      threads.push_back(std::this_thread::get_id());
    };
  }
};

TEST(FailureDomain, TheFirstFailureAbortsEveryOtherMemberEachOnItsOwnThread) {
  const auto domain = FailureDomain::of("test:first");
  Recorder a, b, c;
  const int64_t ia = domain->join("world", a.abort());
  const int64_t ib = domain->join("shard", b.abort());
  const int64_t ic = domain->join("replicate", c.abort());
  EXPECT_EQ(domain->first_failure(), std::nullopt);

  EXPECT_EQ(domain->fail(ib, "all_reduce: peer 3 died"), "shard: all_reduce: peer 3 died");
  EXPECT_TRUE(b.causes.empty()) << "the failing member aborts itself";
  ASSERT_EQ(a.causes, std::vector<std::string>{"shard: all_reduce: peer 3 died"});
  ASSERT_EQ(c.causes, std::vector<std::string>{"shard: all_reduce: peer 3 died"});
  EXPECT_NE(a.threads[0], std::this_thread::get_id());
  EXPECT_NE(c.threads[0], std::this_thread::get_id());
  EXPECT_NE(a.threads[0], c.threads[0]) << "one thread per abort: the slowest bounds the whole";
  EXPECT_EQ(domain->first_failure(), "shard: all_reduce: peer 3 died");

  // A later failure names the first and aborts nothing more.
  EXPECT_EQ(domain->fail(ia, "to_host: aborted"), "shard: all_reduce: peer 3 died");
  EXPECT_EQ(b.causes.size(), 0u);
  EXPECT_EQ(c.causes.size(), 1u);
  for (int64_t id : {ia, ib, ic}) domain->leave(id);
}

// The failing member's own abort runs on its thread while the others' run on theirs: an abort
// that waits for the device behind another member's stuck kernel must not wait for that
// member's abort to start first. Here B's abort returns only once A's own abort has run.
TEST(FailureDomain, TheFailingMembersOwnAbortRunsAlongsideTheOthers) {
  const auto domain = FailureDomain::of("test:alongside");
  std::atomic<bool> own_ran{false};
  std::atomic<bool> b_saw_own{false};
  const int64_t ia = domain->join("a", [](const std::string&) {});
  const int64_t ib = domain->join("b", [&](const std::string&) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!own_ran.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    b_saw_own = own_ran.load();
  });
  std::thread::id own_thread;
  domain->fail(ia, "boom", [&] {
    own_thread = std::this_thread::get_id();
    own_ran = true;
  });
  EXPECT_TRUE(b_saw_own.load()) << "the others' aborts waited for nothing, or for the own abort";
  EXPECT_EQ(own_thread, std::this_thread::get_id());
  // A second failure runs its own abort and nothing else.
  bool second_own = false;
  EXPECT_EQ(domain->fail(ib, "later", [&] { second_own = true; }), "a: boom");
  EXPECT_TRUE(second_own);
  domain->leave(ia);
  domain->leave(ib);
}

TEST(FailureDomain, AMemberThatLeftIsNotAbortedAndOneJoiningLateIsAbortedAtOnce) {
  const auto domain = FailureDomain::of("test:late");
  Recorder gone, stays, late;
  const int64_t ig = domain->join("gone", gone.abort());
  const int64_t is = domain->join("stays", stays.abort());
  const int64_t failing = domain->join("failing", [](const std::string&) {});
  domain->leave(ig);
  domain->fail(failing, "boom");
  EXPECT_TRUE(gone.causes.empty());
  EXPECT_EQ(stays.causes.size(), 1u);
  const int64_t il = domain->join("late", late.abort());
  ASSERT_EQ(late.causes, std::vector<std::string>{"failing: boom"});
  EXPECT_EQ(late.threads[0], std::this_thread::get_id());
  for (int64_t id : {is, failing, il}) domain->leave(id);
}

TEST(FailureDomain, LeavingWaitsForAnAbortStillRunning) {
  const auto domain = FailureDomain::of("test:leave");
  std::atomic<bool> release{false};
  std::atomic<bool> abort_returned{false};
  const int64_t slow = domain->join("slow", [&](const std::string&) {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    abort_returned = true;
  });
  const int64_t failing = domain->join("failing", [](const std::string&) {});
  std::thread failer([&] { domain->fail(failing, "boom"); });
  // The abort is running (or about to): leave() must not return before it has.
  std::atomic<bool> left{false};
  bool returned_when_left = false;
  std::thread leaver([&] {
    while (domain->first_failure() == std::nullopt) std::this_thread::yield();
    domain->leave(slow);
    returned_when_left = abort_returned.load();
    left = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(left.load());
  release = true;
  leaver.join();
  failer.join();
  EXPECT_TRUE(returned_when_left);
  domain->leave(failing);
}

TEST(FailureDomain, OneDomainPerKeyWhileHeld) {
  const auto a = FailureDomain::of("cuda:7");
  EXPECT_EQ(FailureDomain::of("cuda:7"), a);
  EXPECT_NE(FailureDomain::of("cuda:6"), a);
}

}  // namespace
}  // namespace fsdp_muon::detail
