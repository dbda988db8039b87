// The agreement helper over real Gloo communicators, two ranks as two threads of this process on
// one in-memory store: results and messages when every rank takes part, and a rank that stays
// away, which must make the others throw within the communicator's timeout instead of hanging
// (docs/DESIGN.md §5).

#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fsdp_muon/comm/gloo_communicator.h>
#include <fsdp_muon/config.h>

#include "comm/agreement.h"
#include "common/check.h"

namespace fsdp_muon {
namespace {

using Clock = std::chrono::steady_clock;

#if FSDP_MUON_WITH_GLOO

// Runs body(rank, comm) for every rank of a world of `world` Gloo communicators, each rank on
// its own thread (the communicators connect to each other while they are constructed, so they
// must be constructed together). Returns each rank's failure message, empty where it succeeded.
std::vector<std::string> run_world(int world, std::chrono::milliseconds timeout,
                                   const std::function<void(int, Communicator&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        const auto comm = make_gloo_communicator(store, r, world, timeout, "127.0.0.1");
        body(r, *comm);
      } catch (const c10::Error& e) {
        errors[r] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

TEST(Agreement, SumsContributionsOverEveryRank) {
  std::vector<std::vector<int64_t>> sums(2);
  const auto errors = run_world(2, std::chrono::seconds(60), [&](int r, Communicator& comm) {
    FSDP_MUON_API_SCOPE("AgreementTest");
    sums[r] = detail::agree_on_sum(comm, 2, [&](std::vector<int64_t>& mine) {
      mine[0] = r + 1;
      mine[1] = 10;
    });
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(sums[r], (std::vector<int64_t>{3, 20})) << "rank " << r;
  }
}

// The device part rides on the same all-reduce after the host part; a rank whose `local` fails
// contributes zeros there and every rank throws, as for the host part alone.
TEST(Agreement, SumsADevicePartInTheSameAllReduce) {
  std::vector<std::vector<int64_t>> sums(3);
  const auto errors = run_world(3, std::chrono::seconds(60), [&](int r, Communicator& comm) {
    const int64_t before = comm.stats().calls;
    FSDP_MUON_API_SCOPE("AgreementTest");
    sums[r] = detail::agree_on_sum(comm, 1, 3, [&](std::vector<int64_t>& mine) -> at::Tensor {
      mine[0] = 1;
      if (r == 1) return at::Tensor();  // zeros
      return at::tensor({int64_t{r}, int64_t{10}, int64_t{0}});
    });
    EXPECT_EQ(comm.stats().calls - before, 1) << "rank " << r;  // one collective
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(sums[r], (std::vector<int64_t>{3, 2, 20, 0})) << "rank " << r;
  }
  const auto failed = run_world(2, std::chrono::seconds(60), [&](int r, Communicator& comm) {
    FSDP_MUON_API_SCOPE("AgreementTest");
    detail::agree_on_sum(comm, 0, 2, [&](std::vector<int64_t>&) -> at::Tensor {
      TORCH_CHECK(r != 0, "fsdp_muon::AgreementTest: rank 0 broke");
      return at::ones({2}, at::kLong);
    });
  });
  EXPECT_EQ(failed[0], "fsdp_muon::AgreementTest: rank 0 broke");
  EXPECT_EQ(
      failed[1],
      "fsdp_muon::AgreementTest failed on rank 0 of 2: fsdp_muon::AgreementTest: rank 0 broke");
}

TEST(Agreement, ALocalFailureIsAnErrorOnEveryRank) {
  const auto errors = run_world(2, std::chrono::seconds(60), [&](int r, Communicator& comm) {
    FSDP_MUON_API_SCOPE("AgreementTest");
    detail::run_agreed(comm,
                       [&] { TORCH_CHECK(r != 1, "fsdp_muon::AgreementTest: rank 1 broke"); });
  });
  EXPECT_EQ(errors[1], "fsdp_muon::AgreementTest: rank 1 broke");
  EXPECT_EQ(
      errors[0],
      "fsdp_muon::AgreementTest failed on rank 1 of 2: fsdp_muon::AgreementTest: rank 1 broke");
}

TEST(Agreement, RanksThatDifferAreNamed) {
  std::vector<std::vector<int>> differ(3);
  const auto errors = run_world(3, std::chrono::seconds(60), [&](int r, Communicator& comm) {
    differ[r] = detail::ranks_that_differ(comm, r == 2 ? "other" : "same");
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(differ[r], std::vector<int>{2}) << "rank " << r;
  }
}

// Rank 1 connects and then never calls `agreed`; rank 0 must throw within the timeout. Rank 1
// stays alive until rank 0 is done, so that rank 0 sees a silent peer, not a closed socket.
// Returns rank 0's message.
std::string expect_absent_rank_times_out(const std::function<void(Communicator&)>& agreed) {
  const auto timeout = std::chrono::seconds(2);
  std::promise<void> rank0_done;
  std::shared_future<void> done = rank0_done.get_future().share();
  double waited = -1;
  const auto errors = run_world(2, timeout, [&](int r, Communicator& comm) {
    if (r == 1) {
      // Bounded, so that a rank 0 that failed to start cannot hang the test.
      done.wait_for(std::chrono::seconds(120));
      return;
    }
    const auto start = Clock::now();
    try {
      agreed(comm);
    } catch (...) {
      waited = std::chrono::duration<double>(Clock::now() - start).count();
      rank0_done.set_value();
      throw;
    }
    rank0_done.set_value();
  });
  EXPECT_EQ(errors[1], "");
  EXPECT_NE(errors[0].find("gloo failed on rank 0 of 2"), std::string::npos) << errors[0];
  // It waited for the peer, and then not much longer than the timeout (a loaded machine is slow).
  EXPECT_GE(waited, 0.5 * std::chrono::duration<double>(timeout).count());
  EXPECT_LT(waited, std::chrono::duration<double>(timeout).count() + 30.0);
  return errors[0];
}

TEST(Agreement, RunAgreedThrowsWithinTheTimeoutWhenARankStaysAway) {
  expect_absent_rank_times_out([](Communicator& comm) {
    FSDP_MUON_API_SCOPE("AgreementTest");
    detail::run_agreed(comm, [] {});
  });
}

TEST(Agreement, ALocalFailureStaysTheRootCauseWhenTheCollectiveFailsToo) {
  const std::string message = expect_absent_rank_times_out([](Communicator& comm) {
    FSDP_MUON_API_SCOPE("AgreementTest");
    detail::run_agreed(comm, [] { TORCH_CHECK(false, "fsdp_muon::AgreementTest: broke here"); });
  });
  EXPECT_EQ(message.rfind("fsdp_muon::AgreementTest: broke here (then "
                          "fsdp_muon::Communicator::all_reduce: gloo failed on rank 0 of 2",
                          0),
            0u)
      << message;
}

TEST(Agreement, RanksThatDifferThrowsWithinTheTimeoutWhenARankStaysAway) {
  expect_absent_rank_times_out(
      [](Communicator& comm) { detail::ranks_that_differ(comm, "description"); });
}

TEST(Agreement, ToHostOfACpuTensorIsTheTensorItself) {
  const auto errors = run_world(1, std::chrono::seconds(60), [](int, Communicator& comm) {
    const at::Tensor t = at::arange(4, at::kLong);
    const at::Tensor host = comm.to_host(t);
    EXPECT_TRUE(host.is_same(t));
    EXPECT_THROW(comm.to_host(at::Tensor()), c10::Error);
  });
  EXPECT_EQ(errors[0], "");
}

#else

TEST(Agreement, NeedsGloo) { GTEST_SKIP() << "this build of fsdp_muon has no Gloo communicator"; }

#endif  // FSDP_MUON_WITH_GLOO

}  // namespace
}  // namespace fsdp_muon
