// The NCCL communicator in a world of one on cuda:0: Communicator::to_host brings a
// collective's result to the host in order with the current stream, a host wait that outlasts
// the timeout aborts the communicator and throws, and the waits order the caller's stream after
// the communication stream (docs/DESIGN.md §5). W=1 cannot exercise NCCL's launch path (no
// connection, no proxy: a copy on the stream), so the blocking launch and its watchdog are
// tested with two ranks where two GPUs are visible. Skips, saying why, where no GPU is usable.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fsdp_muon/comm/nccl_communicator.h>
#include <fsdp_muon/config.h>

#include "common/test_util.h"

#if FSDP_MUON_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "comm/nccl_internal.h"
#endif

namespace fsdp_muon {
namespace {

using Clock = std::chrono::steady_clock;

#if FSDP_MUON_WITH_CUDA

std::shared_ptr<Communicator> world_of_one(std::chrono::milliseconds timeout) {
  return make_nccl_communicator(c10::make_intrusive<c10d::HashStore>(), /*rank=*/0, /*size=*/1,
                                /*device_index=*/0, timeout);
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no exception)";
}

// NCCL_COMM_BLOCKING would override both communicators' modes: refused before anything else
// (so this runs without a GPU too).
TEST(NcclCommunicator, RefusesNcclCommBlocking) {
  for (const char* value : {"0", "1"}) {
    ASSERT_EQ(::setenv("NCCL_COMM_BLOCKING", value, 1), 0);
    const std::string message = message_of([] { world_of_one(std::chrono::seconds(10)); });
    ::unsetenv("NCCL_COMM_BLOCKING");
    EXPECT_EQ(message.rfind(std::string("fsdp_muon::make_nccl_communicator: NCCL_COMM_BLOCKING=") +
                                value + " is set;",
                            0),
              0u)
        << message;
    EXPECT_NE(message.find("unset NCCL_COMM_BLOCKING"), std::string::npos) << message;
  }
}

TEST(NcclCommunicator, ToHostReturnsTheResultInOrderWithTheCurrentStream) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  const auto comm = world_of_one(std::chrono::seconds(120));
  const auto on = at::TensorOptions().device(comm->device());
  // A non-default stream: to_host must wait for that stream's work, not the default stream's.
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false);
  const c10::cuda::CUDAStreamGuard guard(side);
  at::Tensor t = at::arange(6, on.dtype(at::kFloat));
  comm->all_reduce(t, ReduceOp::kSum);
  // Enqueued after the collective on the same stream: a copy that did not wait would miss it.
  at::cuda::sleep(20'000'000);
  t.mul_(3);
  const at::Tensor host = comm->to_host(t);
  EXPECT_TRUE(host.is_cpu());
  EXPECT_TRUE(host.is_pinned());
  EXPECT_TRUE(at::equal(host, at::arange(6, at::kFloat) * 3));

  // Integers, a non-contiguous view and an empty tensor.
  at::Tensor m = at::arange(12, on.dtype(at::kLong)).view({3, 4});
  comm->all_reduce(m.view({-1}), ReduceOp::kMax);
  EXPECT_TRUE(at::equal(comm->to_host(m.t()), at::arange(12, at::kLong).view({3, 4}).t()));
  const at::Tensor empty = comm->to_host(at::empty({0}, on));
  EXPECT_TRUE(empty.is_cpu());
  EXPECT_EQ(empty.numel(), 0);

  // A CPU tensor is already on the host.
  const at::Tensor cpu = at::ones({2});
  EXPECT_TRUE(comm->to_host(cpu).is_same(cpu));
  EXPECT_EQ(comm->stats().calls, 2);  // to_host is no collective
}

// to_device never waits on the host for the stream: with a long sleep queued on the current
// stream, it returns while the stream is still busy (a pageable copy would have waited for the
// sleep), and the value lands in order behind it.
TEST(NcclCommunicator, ToDeviceDoesNotWaitForTheStream) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  const auto comm = world_of_one(std::chrono::seconds(120));
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false);
  const c10::cuda::CUDAStreamGuard guard(side);
  at::cuda::sleep(2'000'000'000);  // about a second on current GPUs
  const at::Tensor on_device = comm->to_device(at::arange(5, at::kLong));
  EXPECT_FALSE(side.query()) << "to_device waited for the stream's work";
  EXPECT_EQ(on_device.device(), comm->device());
  EXPECT_TRUE(at::equal(comm->to_host(on_device), at::arange(5, at::kLong)));
}

// Cycles of at::cuda::sleep per second on this GPU, measured.
double sleep_cycles_per_second() {
  at::cuda::sleep(1'000'000);  // the first launch loads the kernel
  c10::cuda::device_synchronize();
  const int64_t cycles = 200'000'000;
  const auto start = Clock::now();
  at::cuda::sleep(cycles);
  c10::cuda::device_synchronize();
  return static_cast<double>(cycles) / std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(NcclCommunicator, ToHostPastTheTimeoutAbortsAndThrows) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  // A first communicator, with time to spare, pays NCCL's one-time start-up (plugins,
  // topology), so that the second one's set-up fits its short timeout.
  world_of_one(std::chrono::seconds(120)).reset();
  const auto timeout = std::chrono::seconds(5);
  const auto comm = world_of_one(timeout);
  const auto on = at::TensorOptions().device(comm->device());
  at::Tensor t = at::ones({4}, on);
  comm->all_reduce(t, ReduceOp::kSum);
  // The stream stays busy well past the timeout, as it would behind a collective waiting for a
  // peer that never comes.
  const double seconds = std::chrono::duration<double>(timeout).count();
  at::cuda::sleep(static_cast<int64_t>(1.6 * seconds * sleep_cycles_per_second()));
  const auto start = Clock::now();
  const std::string message = message_of([&] { comm->to_host(t); });
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  c10::cuda::device_synchronize();  // let the sleep finish before anything else runs

  EXPECT_EQ(message.rfind("fsdp_muon::Communicator::all_reduce: nccl on rank 0 of 1 (cuda:0): ", 0),
            0u)
      << message;
  EXPECT_NE(message.find("did not complete within 5000 ms"), std::string::npos) << message;
  EXPECT_NE(message.find("the communicator has been aborted"), std::string::npos) << message;
  EXPECT_GE(waited, 0.95 * seconds);
  // Aborting may wait for the busy stream (NCCL frees device memory), so allow the whole sleep.
  EXPECT_LT(waited, 1.6 * seconds + 30.0);

  // Aborted for good: collectives and host waits refuse.
  EXPECT_NE(message_of([&] { comm->all_reduce(t); }).find("was aborted by an earlier error"),
            std::string::npos);
  EXPECT_NE(message_of([&] { comm->to_host(t); }).find("was aborted by an earlier error"),
            std::string::npos);
}

TEST(NcclCommunicator, ToHostRejectsATensorOnAnotherDevice) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "one CUDA device: no other device to put a tensor on";
  }
  const auto comm = world_of_one(std::chrono::seconds(120));
  const at::Tensor elsewhere = at::ones({2}, at::TensorOptions().device(at::kCUDA, 1));
  EXPECT_NE(message_of([&] {
              comm->to_host(elsewhere);
            }).find("fsdp_muon::Communicator::to_host: tensor is on cuda:1"),
            std::string::npos);
}

// The asynchronous collectives run on the communicator's own stream: they see what the caller's
// stream wrote before they started (even behind a long kernel), wait() orders the caller's stream
// after them, and a synchronous collective started later runs after them.
TEST(NcclCommunicator, AsyncCollectivesOrderWithTheCallersStream) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  const auto comm = world_of_one(std::chrono::seconds(120));
  const auto on = at::TensorOptions().device(comm->device()).dtype(at::kFloat);
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false);
  const c10::cuda::CUDAStreamGuard guard(side);

  at::Tensor send = at::ones({1000}, on);
  at::cuda::sleep(50'000'000);  // the send buffer is still being written when the call returns
  send.mul_(5);
  at::Tensor gathered = at::zeros({1000}, on);
  at::Tensor reduced = at::zeros({1000}, on);
  at::Tensor moved = at::zeros({1000}, on);
  auto g = comm->all_gather_async(send, gathered);
  g->wait();
  // On the caller's stream right after wait(), before anything else orders the two streams: a
  // wait() that did not order the caller's stream would race the gather and leave 5s or 1s.
  gathered.add_(1);
  auto r = comm->reduce_scatter_mean_async(send, reduced);
  auto a = comm->all_to_all_v_async(send, {1000}, moved, {1000});
  at::Tensor summed = at::full({4}, 2.0f, on);
  comm->all_reduce(summed);  // synchronous, after the asynchronous ones
  a->wait();
  r->wait();
  EXPECT_TRUE(at::equal(comm->to_host(gathered), at::full({1000}, 6.0f)));
  EXPECT_TRUE(at::equal(comm->to_host(reduced), at::full({1000}, 5.0f)));
  EXPECT_TRUE(at::equal(comm->to_host(moved), at::full({1000}, 5.0f)));
  EXPECT_TRUE(at::equal(comm->to_host(summed), at::full({4}, 2.0f)));
  EXPECT_EQ(comm->stats().calls, 4);
}

// The waits, tested so that they fail when missing: the communication stream is held busy
// (a sleep kernel of ~0.3 s enqueued there first), so the collective runs long after the
// caller's stream could have moved on. A wait() that did not order the caller's stream lets
// gathered.add_(1) run on the zeros first (the gather then overwrites: 5, not 6); a synchronous
// collective that did not wait for the asynchronous one copies zeros.
TEST(NcclCommunicator, WaitsOrderTheCallersStreamAfterABusyCommunicationStream) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  const auto comm = world_of_one(std::chrono::seconds(120));
  const auto on = at::TensorOptions().device(comm->device()).dtype(at::kFloat);
  const int64_t busy = static_cast<int64_t>(0.3 * sleep_cycles_per_second());
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false);
  const c10::cuda::CUDAStreamGuard guard(side);
  const c10::cuda::CUDAStream communication =
      detail::nccl_lane_stream(0, detail::CommLane::kAllGather);
  ASSERT_NE(communication, side);

  const at::Tensor send = at::full({1000}, 5.0f, on);
  at::Tensor gathered = at::zeros({1000}, on);
  {
    const c10::cuda::CUDAStreamGuard busy_guard(communication);
    at::cuda::sleep(busy);
  }
  auto work = comm->all_gather_async(send, gathered);
  work->wait();
  gathered.add_(1);
  EXPECT_TRUE(at::equal(comm->to_host(gathered), at::full({1000}, 6.0f)))
      << "wait() did not order the caller's stream after the collective";

  // A synchronous collective started after an asynchronous one runs after it.
  at::Tensor first = at::zeros({1000}, on);
  at::Tensor second = at::zeros({1000}, on);
  {
    const c10::cuda::CUDAStreamGuard busy_guard(communication);
    at::cuda::sleep(busy);
  }
  auto pending = comm->all_gather_async(send, first);
  comm->all_gather(first, second);  // reads what the asynchronous gather writes
  pending->wait();
  EXPECT_TRUE(at::equal(comm->to_host(second), at::full({1000}, 5.0f)))
      << "the synchronous collective did not wait for the asynchronous one started before it";
}

// The lanes (docs/DESIGN.md §5, Streams): one library stream per kind of asynchronous
// collective where NCCL starts kernels in launch order, and none of them a stream the caller
// runs on. With a lane held busy (a ~0.3 s sleep there), a synchronous collective started after
// that lane's asynchronous one still reads its result: begin() waits for every lane, not one.
TEST(NcclCommunicator, ASynchronousCollectiveWaitsForEveryLane) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  const auto comm = world_of_one(std::chrono::seconds(120));
  const auto on = at::TensorOptions().device(comm->device()).dtype(at::kFloat);
  const int64_t busy = static_cast<int64_t>(0.3 * sleep_cycles_per_second());
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false);
  const c10::cuda::CUDAStreamGuard guard(side);
  const auto lane = [](detail::CommLane l) { return detail::nccl_lane_stream(0, l); };
  const std::vector<detail::CommLane> kinds = {
      detail::CommLane::kAllGather, detail::CommLane::kReduceScatter, detail::CommLane::kAllReduce,
      detail::CommLane::kAllToAll};
  for (size_t i = 0; i < kinds.size(); ++i) {
    EXPECT_NE(lane(kinds[i]), side);
    EXPECT_NE(lane(kinds[i]), c10::cuda::getDefaultCUDAStream(0));
    for (size_t j = 0; j < i; ++j) {
      EXPECT_EQ(lane(kinds[i]) == lane(kinds[j]), !detail::nccl_lanes_separate())
          << "lanes " << i << " and " << j;
    }
  }
  std::cout << "lanes " << (detail::nccl_lanes_separate() ? "separate" : "one stream") << "\n";
  if (detail::nccl_launch_order_set_by_library()) {
    // What NCCL reads at its first launch (no launch can have happened before the library's load).
    const char* variable = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
    ASSERT_NE(variable, nullptr);
    EXPECT_STREQ(variable, "1");
  }

  const at::Tensor send = at::full({1000}, 5.0f, on);
  for (const detail::CommLane kind : kinds) {
    SCOPED_TRACE(static_cast<int>(kind));
    at::Tensor result = at::zeros({1000}, on);
    {
      const c10::cuda::CUDAStreamGuard busy_guard(lane(kind));
      at::cuda::sleep(busy);
    }
    std::unique_ptr<CommWork> work;
    switch (kind) {
      case detail::CommLane::kAllGather:
        work = comm->all_gather_async(send, result);
        break;
      case detail::CommLane::kReduceScatter:
        work = comm->reduce_scatter_mean_async(send, result);
        break;
      case detail::CommLane::kAllReduce:
        result.copy_(send);
        work = comm->all_reduce_async(result, ReduceOp::kSum);
        break;
      case detail::CommLane::kAllToAll:
        work = comm->all_to_all_v_async(send, {1000}, result, {1000});
        break;
    }
    at::Tensor copied = at::zeros({1000}, on);
    comm->all_gather(result, copied);  // reads what the asynchronous one writes
    // The caller's stream waits for the busy lane (in a world of one an in-place all-reduce
    // enqueues nothing, so the values alone would not tell).
    EXPECT_EQ(cudaStreamQuery(side.stream()), cudaErrorNotReady)
        << "the synchronous collective did not wait for the busy lane";
    (void)cudaGetLastError();
    work->wait();
    EXPECT_TRUE(at::equal(comm->to_host(copied), at::full({1000}, 5.0f)))
        << "the synchronous collective did not wait for the busy lane";
  }
}

// Separate lanes overlap: an all-gather and its wait do not queue behind a busy all-reduce lane
// (a ~1 s sleep there, no collective: NCCL's launch order would hold a later launch until an
// earlier one starts).
TEST(NcclCommunicator, AnAllGatherDoesNotQueueBehindABusyAllReduceLane) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  const auto comm = world_of_one(std::chrono::seconds(120));
  if (!detail::nccl_lanes_separate()) {
    GTEST_SKIP() << "the lanes are one stream in this process (see the warning above)";
  }
  const auto on = at::TensorOptions().device(comm->device()).dtype(at::kFloat);
  const c10::cuda::CUDAStream all_reduce =
      detail::nccl_lane_stream(0, detail::CommLane::kAllReduce);
  {
    const c10::cuda::CUDAStreamGuard busy_guard(all_reduce);
    at::cuda::sleep(static_cast<int64_t>(1.0 * sleep_cycles_per_second()));
  }
  const at::Tensor send = at::full({1000}, 5.0f, on);
  at::Tensor gathered = at::zeros({1000}, on);
  comm->all_gather_async(send, gathered)->wait();
  EXPECT_TRUE(at::equal(comm->to_host(gathered), at::full({1000}, 5.0f)));
  EXPECT_EQ(cudaStreamQuery(all_reduce.stream()), cudaErrorNotReady)
      << "the all-gather waited for the all-reduce lane";
  (void)cudaGetLastError();
  all_reduce.synchronize();
}

// The test-only delay (set_async_collective_delay_for_testing) holds every asynchronous
// collective back on the communication stream: a read that skips wait() sees the old contents
// (what the library's own CUDA tests rely on to catch a missing wait), one after wait() the
// result.
TEST(NcclCommunicator, TheTestDelayHoldsEveryAsynchronousCollectiveBack) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  const auto comm = world_of_one(std::chrono::seconds(120));
  const auto on = at::TensorOptions().device(comm->device()).dtype(at::kFloat);
  const at::Tensor send = at::full({1000}, 5.0f, on);
  at::Tensor gathered = at::zeros({1000}, on);
  detail::set_async_collective_delay_for_testing(
      static_cast<int64_t>(0.3 * sleep_cycles_per_second()));
  auto work = comm->all_gather_async(send, gathered);
  // to_host orders only the caller's stream: without wait() the gather has not run yet.
  EXPECT_TRUE(at::equal(comm->to_host(gathered), at::zeros({1000})))
      << "the delay did not hold the collective back";
  work->wait();
  EXPECT_TRUE(at::equal(comm->to_host(gathered), at::full({1000}, 5.0f)));
  detail::set_async_collective_delay_for_testing(0);
}

// all_gather_v in a world of one: its block (or nothing) lands in place, synchronous and
// asynchronous, in fp32 and bf16, and nothing is counted as sent.
TEST(NcclCommunicator, AllGatherVInAWorldOfOne) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  const auto comm = world_of_one(std::chrono::seconds(120));
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto on = at::TensorOptions().device(comm->device()).dtype(dtype);
    const at::Tensor send = at::arange(7, on);
    at::Tensor recv = at::full({7}, -1, on);
    comm->all_gather_v(send, recv, {7});
    EXPECT_TRUE(at::equal(comm->to_host(recv), send.cpu()));
    at::Tensor again = at::full({7}, -1, on);
    comm->all_gather_v_async(send, again, {7})->wait();
    EXPECT_TRUE(at::equal(comm->to_host(again), send.cpu()));
    const at::Tensor empty = at::empty({0}, on);
    comm->all_gather_v(empty, empty, {0});
    comm->all_gather_v_async(empty, empty, {0})->wait();
  }
  EXPECT_EQ(comm->stats().all_gather_v_bytes, 0);
  EXPECT_EQ(comm->stats().calls, 8);
}

// all_gather_v across two ranks (threads on cuda:0 and cuda:1), where two GPUs are visible:
// uneven blocks, an empty one on either side, every block empty, synchronous and asynchronous.
TEST(NcclCommunicator, AllGatherVOfUnevenBlocksOnTwoRanks) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  if (torch::cuda::device_count() < 2) {
    std::cout << "[  SKIPPED ] one CUDA device: two ranks need two\n";
    GTEST_SKIP() << "one CUDA device: two ranks need two";
  }
  const auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<std::vector<int64_t>> cases{{3, 5}, {0, 4}, {6, 0}, {0, 0}};
  auto run = [&](int rank) {
    const auto comm = make_nccl_communicator(store, rank, 2, rank, std::chrono::seconds(120));
    const auto on = at::TensorOptions().device(comm->device()).dtype(at::kFloat);
    for (const auto& counts : cases) {
      for (const bool async : {false, true}) {
        const at::Tensor send = at::arange(counts[rank], on) + 10 * rank;
        at::Tensor recv = at::full({counts[0] + counts[1]}, -1, on);
        if (async) {
          comm->all_gather_v_async(send, recv, counts)->wait();
        } else {
          comm->all_gather_v(send, recv, counts);
        }
        const at::Tensor expected =
            at::cat({at::arange(counts[0], at::kFloat), at::arange(counts[1], at::kFloat) + 10});
        EXPECT_TRUE(at::equal(comm->to_host(recv), expected))
            << "rank " << rank << ", counts " << counts[0] << ", " << counts[1]
            << (async ? ", async" : "");
      }
    }
    EXPECT_EQ(comm->stats().all_gather_v_bytes, 2 * (rank == 0 ? 3 + 6 : 5 + 4) * 4);
  };
  std::thread rank1([&] { run(1); });
  run(0);
  rank1.join();
}

// At W=1 NCCL never blocks in a launch (every collective is ncclLaunchOneRank's copy on the
// stream: no connection, no proxy, no plan), so the blocking launch and its watchdog need two
// ranks: two threads on cuda:0 and cuda:1 of one process. Rank 1 sets up and then never calls
// the all_gather. Rank 0's launch blocks while NCCL connects to it lazily, and the watchdog ends
// the process (exit 124) with the collective and the rank named; where NCCL connected at set-up
// (no cuMem, NCCL_RUNTIME_CONNECT=0) the launch returns and to_host times out and throws, which
// names them too. Either way the process ends within the bound.
TEST(NcclCommunicatorDeathTest, ACollectiveWaitingForAMissingRankEndsNamingItsCallAndRank) {
  FSDP_MUON_REQUIRE_GPU("NCCL is checked on a GPU machine");
  if (torch::cuda::device_count() < 2) {
    std::cout << "[  SKIPPED ] one CUDA device: two ranks need two\n";
    GTEST_SKIP() << "one CUDA device: two ranks need two";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        const auto store = c10::make_intrusive<c10d::HashStore>();
        const auto timeout = std::chrono::seconds(3);
        std::shared_ptr<Communicator> peer;
        std::thread rank1([&] { peer = make_nccl_communicator(store, 1, 2, 1, timeout); });
        const auto comm = make_nccl_communicator(store, 0, 2, 0, timeout);
        rank1.join();
        const auto on = at::TensorOptions().device(at::kCUDA, 0).dtype(at::kFloat);
        const at::Tensor send = at::ones({1 << 20}, on);
        const at::Tensor recv = at::empty({2 << 20}, on);
        try {
          comm->all_gather(send, recv);
          comm->to_host(recv);
          std::fprintf(stderr, "the all_gather completed without rank 1\n");
        } catch (const c10::Error& e) {
          std::fprintf(stderr, "%s\n", e.what_without_backtrace());
        }
        std::_Exit(2);
      },
      "fsdp_muon::Communicator::all_gather: nccl on rank 0 of 2 \\(cuda:0\\)");
}

// The lanes' decision (pure logic, runs without a GPU): NCCL's version, the CUDA version, and
// the variable as NCCL reads it (strtoll, base 0).
TEST(NcclLaunchOrder, DecidedFromTheVersionTheVariableAndTheDriver) {
  using detail::decide_launch_order;
  const auto old_nccl = decide_launch_order(22509, nullptr, 13000);
  EXPECT_FALSE(old_nccl.separate_lanes);
  EXPECT_FALSE(old_nccl.set_variable);
  EXPECT_NE(old_nccl.why.find("2.25.9"), std::string::npos) << old_nccl.why;

  for (const char* unset : {static_cast<const char*>(nullptr), ""}) {
    const auto decided = decide_launch_order(22809, unset, 13000);
    EXPECT_TRUE(decided.separate_lanes);
    EXPECT_TRUE(decided.set_variable);
  }
  for (const char* on : {"1", "2", "0x1"}) {
    const auto decided = decide_launch_order(22600, on, 12030);
    EXPECT_TRUE(decided.separate_lanes) << on;
    EXPECT_FALSE(decided.set_variable) << on;
  }
  for (const char* off : {"0", "off", "0x0"}) {
    const auto decided = decide_launch_order(22809, off, 13000);
    EXPECT_FALSE(decided.separate_lanes) << off;
    EXPECT_FALSE(decided.set_variable) << off;
    EXPECT_NE(decided.why.find(std::string("NCCL_LAUNCH_ORDER_IMPLICIT=") + off), std::string::npos)
        << decided.why;
  }
  // Older CUDA: NCCL would order by completion, so no overlap, and the variable is left alone.
  for (const char* variable : {static_cast<const char*>(nullptr), "1"}) {
    const auto old_cuda = decide_launch_order(22809, variable, 12020);
    EXPECT_FALSE(old_cuda.separate_lanes);
    EXPECT_FALSE(old_cuda.set_variable);
    EXPECT_NE(old_cuda.why.find("CUDA 12.2"), std::string::npos) << old_cuda.why;
  }
}

#else

TEST(NcclCommunicator, NeedsCuda) {
  std::cout << "[  SKIPPED ] this build of fsdp_muon has no CUDA\n";
  GTEST_SKIP() << "this build of fsdp_muon has no CUDA";
}

#endif  // FSDP_MUON_WITH_CUDA

}  // namespace
}  // namespace fsdp_muon
