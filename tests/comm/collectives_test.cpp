// Collectives across real processes (CTest starts this under torchrun and mpirun with 1-4
// ranks). Every value is computed from (source rank, destination rank, index), so a receiver
// checks exactly what it got, and every byte counter against its own formula.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/distributed_main.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using testing::world;

at::TensorOptions on_device(at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(world().device());
}

// Elements rank `src` sends rank `dst`: uneven, and zero for some pairs (including some
// self-blocks) at every world size above one.
int64_t count(int src, int dst) { return (3 * src + 5 * dst) % 4; }

double value(int src, int dst, int64_t i) { return src * 1000 + dst * 100 + i; }

void run_all_to_all_v(at::ScalarType dtype) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  std::vector<int64_t> send_counts(w), recv_counts(w);
  std::vector<double> send_values;
  int64_t expected_bytes = 0;
  for (int p = 0; p < w; ++p) {
    send_counts[p] = count(r, p);
    recv_counts[p] = count(p, r);
    for (int64_t i = 0; i < send_counts[p]; ++i) {
      send_values.push_back(value(r, p, i));
    }
    if (p != r) {
      expected_bytes += send_counts[p] * static_cast<int64_t>(c10::elementSize(dtype));
    }
  }
  const int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  at::Tensor send = at::tensor(send_values, at::kDouble).to(on_device(dtype));
  at::Tensor recv = at::full({recv_total}, -1, on_device(dtype));

  c.reset_stats();
  c.all_to_all_v(send, send_counts, recv, recv_counts);
  EXPECT_EQ(c.stats().all_to_all_v_bytes, expected_bytes);
  EXPECT_EQ(c.stats().total_bytes(), expected_bytes);
  EXPECT_EQ(c.stats().calls, 1);

  const at::Tensor got = recv.to(at::kCPU, at::kDouble);
  int64_t offset = 0;
  for (int src = 0; src < w; ++src) {
    for (int64_t i = 0; i < recv_counts[src]; ++i) {
      EXPECT_EQ(got[offset + i].item<double>(), value(src, r, i))
          << "element " << i << " from rank " << src;
    }
    offset += recv_counts[src];
  }
}

// On the CPU, to_device is the host tensor itself (no copy); anything but a defined CPU tensor is
// refused, naming what it got.
FSDP_MUON_WORLD_TEST(Collectives, ToDeviceOnTheCpuIsTheTensorItself) {
  const at::Tensor host = at::arange(4, at::kLong);
  EXPECT_TRUE(world().to_device(host).is_same(host));
  testing::expect_error([] { world().to_device(at::Tensor()); }, {"to_device", "undefined"});
  testing::expect_error([] { world().to_device(at::empty({2}, at::Device(at::kMeta))); },
                        {"to_device", "meta"});
}

FSDP_MUON_WORLD_TEST(Collectives, AllToAllVUnevenAndZeroCountsFloat) {
  run_all_to_all_v(at::kFloat);
}
FSDP_MUON_WORLD_TEST(Collectives, AllToAllVUnevenAndZeroCountsInt64) {
  run_all_to_all_v(at::kLong);
}

FSDP_MUON_WORLD_TEST(Collectives, AllToAllVNothingToSendButSomethingToReceive) {
  // Rank 0 sends nothing at all; everyone else sends rank 0 two elements.
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  std::vector<int64_t> send_counts(w, 0), recv_counts(w, 0);
  if (r != 0) {
    send_counts[0] = 2;
  } else {
    for (int p = 1; p < w; ++p) {
      recv_counts[p] = 2;
    }
  }
  at::Tensor send = at::full({r == 0 ? 0 : 2}, r, on_device(at::kFloat));
  at::Tensor recv = at::full({r == 0 ? 2 * (w - 1) : 0}, -1, on_device(at::kFloat));
  c.reset_stats();
  c.all_to_all_v(send, send_counts, recv, recv_counts);
  EXPECT_EQ(c.stats().all_to_all_v_bytes, r == 0 ? 0 : 8);
  if (r == 0) {
    const at::Tensor expected = at::arange(1, w, at::kFloat).repeat_interleave(2).to(recv.device());
    EXPECT_TRUE(at::equal(recv, expected)) << recv;
  }
}

FSDP_MUON_WORLD_TEST(Collectives, AllToAllVRejectsBadCountsBeforeCommunicating) {
  Communicator& c = world();
  const int w = c.size();
  at::Tensor buf = at::zeros({w}, on_device(at::kFloat));
  std::vector<int64_t> ones(w, 1);
  c.reset_stats();
  EXPECT_THROW(c.all_to_all_v(buf, std::vector<int64_t>(w + 1, 0), buf, ones), c10::Error);
  std::vector<int64_t> too_many(w, 1);
  too_many[0] = 2;
  EXPECT_THROW(c.all_to_all_v(buf, too_many, buf, ones), c10::Error);
  EXPECT_THROW(c.all_to_all_v(buf.view({1, w}), ones, buf, ones), c10::Error);
  EXPECT_THROW(c.all_to_all_v(buf, ones, buf.to(at::kDouble), ones), c10::Error);
  EXPECT_EQ(c.stats().calls, 0);
  EXPECT_EQ(c.stats().total_bytes(), 0);
}

FSDP_MUON_WORLD_TEST(Collectives, AllGatherIntoFlatBuffer) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const int64_t n = 5;
    at::Tensor send = (at::arange(n, at::kFloat) + 10 * r).to(on_device(dtype));
    at::Tensor recv = at::full({w * n}, -1, on_device(dtype));
    c.reset_stats();
    c.all_gather(send, recv);
    EXPECT_EQ(c.stats().all_gather_bytes, (w - 1) * n * int64_t(c10::elementSize(dtype)));
    const at::Tensor got = recv.to(at::kCPU, at::kFloat);
    for (int src = 0; src < w; ++src) {
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(got[src * n + i].item<float>(), 10 * src + i) << "dtype " << dtype;
      }
    }
  }
}

// ---- all_gather_v ----

// Rank r's block under all_gather_v: counts[r] elements, element i = 10 r + i (exact in bf16).
at::Tensor gather_v_block(int r, const std::vector<int64_t>& counts, at::ScalarType dtype) {
  return (at::arange(counts[r], at::kFloat) + 10 * r).to(on_device(dtype));
}

// Gathers every rank's block under `counts` (synchronously or not) and checks every element,
// that the bytes counted are (size - 1) * this rank's send bytes, and that the send buffer is
// unchanged.
void run_all_gather_v(Communicator& c, const std::vector<int64_t>& counts, at::ScalarType dtype,
                      bool async) {
  const int r = c.rank();
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const at::Tensor send = gather_v_block(r, counts, dtype);
  const at::Tensor before = send.clone();
  const at::Tensor recv = at::full({total}, -1, on_device(dtype));
  c.reset_stats();
  if (async) {
    std::unique_ptr<CommWork> work = c.all_gather_v_async(send, recv, counts);
    work->wait();
    EXPECT_TRUE(work->waited());
  } else {
    c.all_gather_v(send, recv, counts);
  }
  const int64_t sent = (c.size() - 1) * counts[r] * int64_t(c10::elementSize(dtype));
  EXPECT_EQ(c.stats().all_gather_v_bytes, sent);
  EXPECT_EQ(c.stats().total_bytes(), sent);
  EXPECT_EQ(c.stats().calls, 1);
  std::vector<float> expected;
  for (int src = 0; src < c.size(); ++src) {
    for (int64_t i = 0; i < counts[src]; ++i) expected.push_back(10.0f * src + i);
  }
  const at::Tensor got = recv.to(at::kCPU, at::kFloat);
  ASSERT_EQ(got.numel(), static_cast<int64_t>(expected.size()));
  for (int64_t k = 0; k < got.numel(); ++k) {
    EXPECT_EQ(got[k].item<float>(), expected[k])
        << "element " << k << ", dtype " << dtype << (async ? ", async" : "");
  }
  EXPECT_TRUE(at::equal(send, before));
}

// Uneven, with one rank's block empty at every world size above one (1, 0, 3, 2, ...).
std::vector<int64_t> uneven_counts(int w) {
  std::vector<int64_t> counts(w);
  for (int p = 0; p < w; ++p) counts[p] = (3 * p + 1) % 4;
  return counts;
}

FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, UnevenCountsFloatAndBFloat16) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const bool async : {false, true}) {
      run_all_gather_v(world(), uneven_counts(world().size()), dtype, async);
    }
  }
}

// The first and the last rank send nothing (at two ranks, nobody does); the others 2, 3, ...
FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, EmptyBlocksOfTheFirstAndLastRank) {
  const int w = world().size();
  std::vector<int64_t> counts(w);
  for (int p = 0; p < w; ++p) counts[p] = p == 0 || p == w - 1 ? 0 : p + 1;
  run_all_gather_v(world(), counts, at::kFloat, /*async=*/false);
  run_all_gather_v(world(), counts, at::kBFloat16, /*async=*/true);
}

// Only one rank sends (the last), as when one rank owns everything.
FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, OneRankSendsEverything) {
  const int w = world().size();
  std::vector<int64_t> counts(w, 0);
  counts[w - 1] = 17;
  run_all_gather_v(world(), counts, at::kFloat, /*async=*/false);
  run_all_gather_v(world(), counts, at::kFloat, /*async=*/true);
}

FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, EveryBlockEmpty) {
  const std::vector<int64_t> counts(world().size(), 0);
  run_all_gather_v(world(), counts, at::kFloat, /*async=*/false);
  run_all_gather_v(world(), counts, at::kFloat, /*async=*/true);
  // And the communicator still works afterwards.
  at::Tensor one = at::ones({1}, on_device(at::kFloat));
  world().all_reduce(one);
  EXPECT_EQ(one.item<float>(), world().size());
}

// Equal counts give all_gather's result, and the bytes all_gather counts.
FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, EqualCountsMatchAllGather) {
  Communicator& c = world();
  const int w = c.size();
  at::Tensor send;
  {
    testing::SeededRandom random(4321 + c.rank());
    send = at::randn({6}, on_device(at::kFloat));
  }
  at::Tensor gathered = at::empty({6 * w}, on_device(at::kFloat));
  at::Tensor gathered_v = at::full({6 * w}, -1, on_device(at::kFloat));
  c.reset_stats();
  c.all_gather(send, gathered);
  c.all_gather_v(send, gathered_v, std::vector<int64_t>(w, 6));
  EXPECT_TRUE(at::equal(gathered, gathered_v));
  EXPECT_EQ(c.stats().all_gather_v_bytes, c.stats().all_gather_bytes);
}

// Every local mistake is refused before anything is sent, synchronous and asynchronous alike,
// naming the call, what is wrong and what to pass instead; nothing is counted.
FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, RejectsBadArgumentsBeforeCommunicating) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  const std::vector<int64_t> counts = uneven_counts(w);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const at::Tensor send = gather_v_block(r, counts, at::kFloat);
  const at::Tensor recv = at::zeros({total}, on_device(at::kFloat));
  const std::string api = "fsdp_muon::Communicator::all_gather_v: ";
  c.reset_stats();
  for (const bool async : {false, true}) {
    auto call = [&](const at::Tensor& s, const at::Tensor& v, const std::vector<int64_t>& n) {
      if (async) {
        c.all_gather_v_async(s, v, n)->wait();
      } else {
        c.all_gather_v(s, v, n);
      }
    };
    std::vector<int64_t> longer = counts;
    longer.push_back(0);
    testing::expect_error([&] { call(send, recv, longer); },
                          {api + "recv_counts has " + std::to_string(w + 1) +
                           " entries; it needs one per rank (" + std::to_string(w) + ")"});
    testing::expect_error([&] { call(send, recv, std::vector<int64_t>(w - 1, 0)); },
                          {api + "recv_counts has " + std::to_string(w - 1) + " entries"});
    std::vector<int64_t> negative = counts;
    negative[w - 1] = -2;
    testing::expect_error(
        [&] { call(send, recv, negative); },
        {api + "negative count in recv_counts (entry " + std::to_string(w - 1) + " is -2)"});
    // This rank's entry is not its send size (the sum still matches the receive buffer).
    std::vector<int64_t> other = counts;
    other[r] += 1;
    testing::expect_error(
        [&] { call(send, at::zeros({total + 1}, on_device(at::kFloat)), other); },
        {api + "the send buffer holds " + std::to_string(counts[r]) + " elements but recv_counts[" +
             std::to_string(r) + "] (this rank's block) is " + std::to_string(counts[r] + 1),
         "this rank's at index rank()"});
    testing::expect_error(
        [&] { call(send, at::zeros({total + 2}, on_device(at::kFloat)), counts); },
        {api + "recv_counts sum to " + std::to_string(total) + " elements but the buffer holds " +
         std::to_string(total + 2)});
    testing::expect_error([&] { call(send, recv.to(at::kDouble), counts); },
                          {api + "send and receive dtypes differ"});
    testing::expect_error(
        [&] {
          call(send.view({1, -1}), recv, counts);
        },
        {api + "send buffer must be a flat contiguous 1-D tensor"});
    testing::expect_error([&] { call(send, at::Tensor(), counts); },
                          {api + "receive buffer is undefined"});
    // A send buffer inside recv must be exactly this rank's block: one element off, it overlaps
    // a neighbour's block, whose copy would overwrite what this one's still reads.
    if (counts[r] > 0 && total > counts[r]) {
      const int64_t own = std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
      const at::Tensor inside = at::zeros({total}, on_device(at::kFloat));
      const at::Tensor shifted = inside.narrow(0, own == 0 ? 1 : own - 1, counts[r]);
      testing::expect_error([&] { call(shifted, inside, counts); },
                            {api +
                             "the send buffer overlaps the receive buffer other than as this "
                             "rank's block (elements [" +
                             std::to_string(own) + ", " + std::to_string(own + counts[r]) + ")"});
    }
  }
  EXPECT_EQ(c.stats().calls, 0);
  EXPECT_EQ(c.stats().total_bytes(), 0);
  // The communicator is still usable afterwards, and this rank's own slice of recv is a valid
  // send buffer (in place).
  run_all_gather_v(c, counts, at::kFloat, /*async=*/false);
  const int64_t own = std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
  at::Tensor in_place = at::zeros({total}, on_device(at::kFloat));
  in_place.narrow(0, own, counts[r]).copy_(send);
  c.all_gather_v(in_place.narrow(0, own, counts[r]), in_place, counts);
  at::Tensor expected = at::zeros({total}, on_device(at::kFloat));
  c.all_gather_v(send, expected, counts);
  EXPECT_TRUE(at::equal(c.to_host(in_place), c.to_host(expected)));
}

// In flight with other collectives, started before and after a synchronous one and waited for
// in reverse: every result equals the synchronous call's.
FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, AsyncInFlightWithOtherCollectives) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  const std::vector<int64_t> counts = uneven_counts(w);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<int64_t> reversed(counts.rbegin(), counts.rend());
  const at::Tensor first_send = gather_v_block(r, counts, at::kFloat);
  const at::Tensor second_send = gather_v_block(r, reversed, at::kFloat) * 2;
  at::Tensor first_sync = at::empty({total}, on_device(at::kFloat));
  at::Tensor second_sync = at::empty({total}, on_device(at::kFloat));
  c.all_gather_v(first_send, first_sync, counts);
  c.all_gather_v(second_send, second_sync, reversed);

  at::Tensor first = at::full({total}, -1, on_device(at::kFloat));
  at::Tensor second = at::full({total}, -1, on_device(at::kFloat));
  at::Tensor summed = at::full({3}, r + 1.0, on_device(at::kFloat));
  at::Tensor gathered = at::full({2 * w}, -1, on_device(at::kFloat));
  c.reset_stats();
  std::unique_ptr<CommWork> a = c.all_gather_v_async(first_send, first, counts);
  std::unique_ptr<CommWork> g =
      c.all_gather_async(at::full({2}, r, on_device(at::kFloat)), gathered);
  c.all_reduce(summed);
  std::unique_ptr<CommWork> b = c.all_gather_v_async(second_send, second, reversed);
  b->wait();
  g->wait();
  a->wait();
  EXPECT_TRUE(at::equal(first, first_sync));
  EXPECT_TRUE(at::equal(second, second_sync));
  EXPECT_TRUE(at::equal(gathered, at::arange(w, on_device(at::kFloat)).repeat_interleave(2)));
  EXPECT_EQ(summed[0].item<float>(), w * (w + 1) / 2.0f);
  EXPECT_EQ(c.stats().all_gather_v_bytes, (w - 1) * (counts[r] + reversed[r]) * 4);
}

// A work dropped without wait() lets its all_gather_v finish: the next collective is intact.
FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, DroppedWorkLeavesCommunicatorUsable) {
  Communicator& c = world();
  const std::vector<int64_t> counts = uneven_counts(c.size());
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  {
    at::Tensor recv = at::empty({total}, on_device(at::kFloat));
    std::unique_ptr<CommWork> dropped =
        c.all_gather_v_async(gather_v_block(c.rank(), counts, at::kFloat), recv, counts);
  }
  run_all_gather_v(c, counts, at::kFloat, /*async=*/false);
}

// Counts that differ across ranks, where the last rank expects three elements more from rank 0
// than rank 0 sends: Gloo would complete that short receive silently; each message's header of
// the sender's counts makes it an error on every rank, naming both, and the communicator stays
// usable. (NCCL cannot tell: there it is the caller's contract alone.)
FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, CountsThatDifferAcrossRanksAreAnErrorOnEveryRank) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  if (w == 1) GTEST_SKIP() << "needs two ranks";
  if (c.backend_name() != "gloo") GTEST_SKIP() << "Gloo checks the counts; NCCL cannot";
  std::vector<int64_t> counts(w, 2);
  if (r == w - 1) counts[0] = 5;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const at::Tensor send = at::full({counts[r]}, r, on_device(at::kFloat));
  for (const bool async : {false, true}) {
    const at::Tensor recv = at::empty({total}, on_device(at::kFloat));
    testing::expect_error(
        [&] {
          if (async) {
            c.all_gather_v_async(send, recv, counts)->wait();
          } else {
            c.all_gather_v(send, recv, counts);
          }
        },
        {"fsdp_muon::Communicator::all_gather_v: the ranks passed different recv_counts: rank ",
         "but this rank (" + std::to_string(r) + " of " + std::to_string(w) + ") passed", "[5, 2",
         "[2, 2", "every rank must pass the same recv_counts"});
  }
  run_all_gather_v(c, uneven_counts(w), at::kFloat, /*async=*/false);
}

// The other direction: rank 1 expects nothing from rank 0, which sends two elements. Gloo
// refuses the longer block on its I/O thread, which ends the process with its own message (no
// hang, no corruption). In-process only: it ends the whole process.
TEST(CollectivesAllGatherVDeathTest, BlockLongerThanExpectedEndsTheProcessInGloo) {
  if (!testing::in_process()) GTEST_SKIP() << "in-process only: it ends the process";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(testing::on_world_of(2,
                                    [] {
                                      Communicator& c = world();
                                      std::vector<int64_t> counts{2, 2};
                                      if (c.rank() == 1) counts[0] = 0;
                                      const int64_t total = counts[0] + counts[1];
                                      const at::Tensor recv = at::empty({total}, at::kFloat);
                                      try {
                                        c.all_gather_v(at::ones({2}, at::kFloat), recv, counts);
                                      } catch (const c10::Error&) {
                                        // Rank 0 sees rank 1's counts differ; rank 1 never
                                        // returns.
                                      }
                                    }),
               "Received data size doesn't match expected size");
}

// A communicator of one (what split() gives a rank alone): the block is copied, nothing counted.
FSDP_MUON_WORLD_TEST(CollectivesAllGatherV, CommunicatorOfOne) {
  std::shared_ptr<Communicator> alone = world().split(world().rank(), 0);
  ASSERT_EQ(alone->size(), 1);
  for (const int64_t n : {int64_t{0}, int64_t{5}}) {
    run_all_gather_v(*alone, {n}, at::kFloat, /*async=*/false);
    run_all_gather_v(*alone, {n}, at::kBFloat16, /*async=*/true);
  }
  testing::expect_error(
      [&] {
        alone->all_gather_v(at::ones({2}, on_device(at::kFloat)),
                            at::ones({3}, on_device(at::kFloat)), {3});
      },
      {"fsdp_muon::Communicator::all_gather_v: the send buffer holds 2 elements but "
       "recv_counts[0] (this rank's block) is 3"});
}

FSDP_MUON_WORLD_TEST(Collectives, ReduceScatterMeanIsExactOnIntegerValues) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  const int64_t n = 6;
  // Rank r's element i of block b: r * w + 7 b + i. The mean over ranks is
  // w (w - 1) / 2 + 7 b + i, an integer, so the float result must be exact.
  std::vector<double> values;
  for (int b = 0; b < w; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      values.push_back(r * w + 7 * b + i);
    }
  }
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    at::Tensor send = at::tensor(values, at::kDouble).to(on_device(dtype));
    at::Tensor recv = at::full({n}, -1, on_device(dtype));
    c.reset_stats();
    c.reduce_scatter_mean(send, recv);
    EXPECT_EQ(c.stats().reduce_scatter_bytes, (w - 1) * n * int64_t(c10::elementSize(dtype)));
    EXPECT_EQ(c.stats().total_bytes(), c.stats().reduce_scatter_bytes);
    const at::Tensor got = recv.to(at::kCPU, at::kDouble);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(got[i].item<double>(), w * (w - 1) / 2 + 7 * r + i) << "dtype " << dtype;
    }
    // The send buffer is the caller's and stays as it was.
    EXPECT_TRUE(at::equal(send.to(at::kCPU, at::kDouble), at::tensor(values, at::kDouble)));
  }
}

FSDP_MUON_WORLD_TEST(Collectives, AllReduceSumMaxMin) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  const int64_t n = 7;
  auto mine = [&](int rank, int64_t i) { return double((rank * 5 + i * 3) % 11) - 4; };
  for (const auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    std::vector<double> values;
    for (int64_t i = 0; i < n; ++i) {
      values.push_back(mine(r, i));
    }
    at::Tensor t = at::tensor(values, at::kDouble).to(on_device(at::kFloat));
    c.reset_stats();
    c.all_reduce(t, op);
    // Ring minimum 2 (w - 1) / w of the buffer, in whole bytes.
    EXPECT_EQ(c.stats().all_reduce_bytes, 2 * (w - 1) * n * 4 / w);
    const at::Tensor got = t.to(at::kCPU, at::kDouble);
    for (int64_t i = 0; i < n; ++i) {
      double expected = mine(0, i);
      for (int p = 1; p < w; ++p) {
        const double v = mine(p, i);
        expected = op == ReduceOp::kSum   ? expected + v
                   : op == ReduceOp::kMax ? std::max(expected, v)
                                          : std::min(expected, v);
      }
      EXPECT_EQ(got[i].item<double>(), expected) << "op " << int(op) << " element " << i;
    }
  }
}

FSDP_MUON_WORLD_TEST(Collectives, BroadcastFromLastRank) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  const int root = w - 1;
  const int64_t n = 9;
  at::Tensor t =
      r == root ? at::arange(n, on_device(at::kLong)) * 3 : at::full({n}, -1, on_device(at::kLong));
  c.reset_stats();
  c.broadcast(t, root);
  EXPECT_EQ(c.stats().broadcast_bytes, r == root ? (w - 1) * n * 8 : 0);
  EXPECT_TRUE(at::equal(t.cpu(), at::arange(n, at::kLong) * 3)) << t;
  EXPECT_THROW(c.broadcast(t, w), c10::Error);
}

FSDP_MUON_WORLD_TEST(Collectives, BarrierWaitsForEveryRank) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  // A directory every rank agrees on: rank 0 draws its name and broadcasts it.
  at::Tensor id = at::zeros({1}, on_device(at::kLong));
  if (r == 0) {
    id.fill_(static_cast<int64_t>(std::random_device{}() & 0x7fffffff));
  }
  c.broadcast(id, 0);
  // POSIX calls rather than std::filesystem: libtorch.so exports its own copy of the latter.
  const std::string dir = "/tmp/fsdp_muon_barrier_" + std::to_string(id.item<int64_t>());
  auto file_of = [&](int p) { return dir + "/rank_" + std::to_string(p); };
  ::mkdir(dir.c_str(), 0700);  // EEXIST from a faster rank is fine
  c.barrier();
  // Later ranks arrive later, so a barrier that let anyone through early would be seen.
  std::this_thread::sleep_for(std::chrono::milliseconds(40 * r));
  std::ofstream(file_of(r)) << r;
  c.reset_stats();
  c.barrier();
  EXPECT_EQ(c.stats().calls, 1);
  EXPECT_EQ(c.stats().total_bytes(), 0);
  int seen = 0;
  for (int p = 0; p < w; ++p) {
    seen += ::access(file_of(p).c_str(), F_OK) == 0;
  }
  EXPECT_EQ(seen, w);
  c.barrier();
  ::unlink(file_of(r).c_str());
  c.barrier();
  if (r == 0) {
    ::rmdir(dir.c_str());
  }
}

// An FSDP group whose shards are empty still takes part in every collective.
FSDP_MUON_WORLD_TEST(Collectives, EmptyBuffersAreFine) {
  Communicator& c = world();
  at::Tensor empty = at::empty({0}, on_device(at::kFloat));
  c.reset_stats();
  c.all_gather(empty, empty);
  c.reduce_scatter_mean(empty, empty);
  c.all_reduce(empty, ReduceOp::kMax);
  c.broadcast(empty, 0);
  c.all_to_all_v(empty, std::vector<int64_t>(c.size(), 0), empty,
                 std::vector<int64_t>(c.size(), 0));
  c.all_gather_v(empty, empty, std::vector<int64_t>(c.size(), 0));
  EXPECT_EQ(c.stats().calls, 6);
  EXPECT_EQ(c.stats().total_bytes(), 0);
  // And the communicator still works afterwards.
  at::Tensor one = at::ones({1}, on_device(at::kFloat));
  c.all_reduce(one);
  EXPECT_EQ(one.item<float>(), c.size());
}

FSDP_MUON_WORLD_TEST(Collectives, StatsAccumulateAcrossKindsAndReset) {
  Communicator& c = world();
  const int w = c.size();
  at::Tensor a = at::ones({4}, on_device(at::kFloat));
  at::Tensor g = at::zeros({4 * w}, on_device(at::kFloat));
  c.reset_stats();
  c.all_gather(a, g);
  c.all_reduce(a);
  c.reduce_scatter_mean(g, a);
  c.all_gather_v(a, g, std::vector<int64_t>(w, 4));
  const CommStats& s = c.stats();
  EXPECT_EQ(s.calls, 4);
  EXPECT_EQ(s.all_gather_bytes, (w - 1) * 16);
  EXPECT_EQ(s.all_reduce_bytes, 2 * (w - 1) * 16 / w);
  EXPECT_EQ(s.reduce_scatter_bytes, (w - 1) * 16);
  EXPECT_EQ(s.all_gather_v_bytes, (w - 1) * 16);
  EXPECT_EQ(s.total_bytes(), (w - 1) * 48 + 2 * (w - 1) * 16 / w);
  c.reset_stats();
  EXPECT_EQ(c.stats().calls, 0);
  EXPECT_EQ(c.stats().total_bytes(), 0);
}

// ---- asynchronous collectives ----

// Several collectives in flight at once, a synchronous one started between them, waited for in
// the reverse order: every result equals the synchronous call's, bit for bit, and the bytes are
// counted the same.
FSDP_MUON_WORLD_TEST(CollectivesAsync, InFlightTogetherMatchSynchronousResultsAndBytes) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  // Non-integer values, so a reduction that summed in another order would show.
  std::vector<int64_t> send_counts(w), recv_counts(w);
  for (int p = 0; p < w; ++p) {
    send_counts[p] = count(r, p);
    recv_counts[p] = count(p, r);
  }
  const int64_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
  const int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  at::Tensor gather_send, scatter_send, a2a_send;
  {
    testing::SeededRandom random(1234 + r);
    gather_send = at::randn({7}, on_device(at::kFloat));
    scatter_send = at::randn({w * 5}, on_device(at::kFloat));
    a2a_send = at::randn({send_total}, on_device(at::kFloat));
  }

  at::Tensor gathered_sync = at::empty({w * 7}, on_device(at::kFloat));
  at::Tensor scattered_sync = at::empty({5}, on_device(at::kFloat));
  at::Tensor a2a_sync = at::empty({recv_total}, on_device(at::kFloat));
  c.reset_stats();
  c.all_gather(gather_send, gathered_sync);
  c.reduce_scatter_mean(scatter_send, scattered_sync);
  c.all_to_all_v(a2a_send, send_counts, a2a_sync, recv_counts);
  const CommStats sync_stats = c.stats();

  at::Tensor gathered = at::full({w * 7}, -1, on_device(at::kFloat));
  at::Tensor scattered = at::full({5}, -1, on_device(at::kFloat));
  at::Tensor a2a = at::full({recv_total}, -1, on_device(at::kFloat));
  at::Tensor summed = at::full({3}, r + 1.0, on_device(at::kFloat));
  c.reset_stats();
  std::unique_ptr<CommWork> g = c.all_gather_async(gather_send, gathered);
  std::unique_ptr<CommWork> s = c.reduce_scatter_mean_async(scatter_send, scattered);
  c.all_reduce(summed);  // synchronous, started between asynchronous ones
  std::unique_ptr<CommWork> a = c.all_to_all_v_async(a2a_send, send_counts, a2a, recv_counts);
  a->wait();
  s->wait();
  g->wait();
  EXPECT_TRUE(a->waited());
  g->wait();  // a second wait does nothing

  EXPECT_TRUE(at::equal(gathered, gathered_sync));
  EXPECT_TRUE(at::equal(scattered, scattered_sync));
  EXPECT_TRUE(at::equal(a2a, a2a_sync));
  EXPECT_EQ(summed[0].item<float>(), w * (w + 1) / 2.0f);
  EXPECT_EQ(c.stats().all_gather_bytes, sync_stats.all_gather_bytes);
  EXPECT_EQ(c.stats().reduce_scatter_bytes, sync_stats.reduce_scatter_bytes);
  EXPECT_EQ(c.stats().all_to_all_v_bytes, sync_stats.all_to_all_v_bytes);
  EXPECT_EQ(c.stats().calls, sync_stats.calls + 1);
}

// A pipeline as full sharding and FsdpMuon run it: the next exchange is started before the
// current result is used, many times over, with the caller computing in between.
FSDP_MUON_WORLD_TEST(CollectivesAsync, PipelinedGathersDeliverEachRoundsData) {
  Communicator& c = world();
  const int r = c.rank();
  const int w = c.size();
  const int rounds = 12;
  const int64_t n = 1000;
  std::vector<at::Tensor> out(rounds);
  std::unique_ptr<CommWork> next;
  auto start = [&](int t) {
    out[t] = at::empty({w * n}, on_device(at::kFloat));
    return c.all_gather_async(at::full({n}, 100.0 * t + r, on_device(at::kFloat)), out[t]);
  };
  next = start(0);
  for (int t = 0; t < rounds; ++t) {
    std::unique_ptr<CommWork> current = std::move(next);
    if (t + 1 < rounds) next = start(t + 1);
    // Compute while the collectives run (its result is unused; the point is the interleaving).
    at::Tensor busy = at::full({64, 64}, 0.5, on_device(at::kFloat));
    busy = busy.matmul(busy);
    current->wait();
    const at::Tensor expect =
        (at::arange(w, at::kFloat) + 100.0 * t).repeat_interleave(n).to(on_device(at::kFloat));
    EXPECT_TRUE(at::equal(out[t], expect)) << "round " << t;
  }
}

FSDP_MUON_WORLD_TEST(CollectivesAsync, RejectsBadBuffersBeforeStarting) {
  Communicator& c = world();
  const int w = c.size();
  at::Tensor buf = at::zeros({w}, on_device(at::kFloat));
  c.reset_stats();
  try {
    c.all_gather_async(buf, at::zeros({w * w + 1}, on_device(at::kFloat)));
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp_muon::Communicator::all_gather: receive buffer"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(c.reduce_scatter_mean_async(buf, at::zeros({2}, on_device(at::kFloat))), c10::Error);
  EXPECT_THROW(
      c.all_to_all_v_async(buf, std::vector<int64_t>(w + 1, 0), buf, std::vector<int64_t>(w, 1)),
      c10::Error);
  EXPECT_EQ(c.stats().calls, 0);
  EXPECT_EQ(c.stats().total_bytes(), 0);
}

// A work dropped without wait() (an exception between start and wait) lets its collective
// finish: the communicator stays usable and the next collective sees the next data.
FSDP_MUON_WORLD_TEST(CollectivesAsync, DroppedWorkLeavesCommunicatorUsable) {
  Communicator& c = world();
  const int w = c.size();
  {
    at::Tensor recv = at::empty({w * 3}, on_device(at::kFloat));
    std::unique_ptr<CommWork> dropped =
        c.all_gather_async(at::ones({3}, on_device(at::kFloat)), recv);
  }
  at::Tensor one = at::ones({1}, on_device(at::kFloat));
  c.all_reduce(one);
  EXPECT_EQ(one.item<float>(), w);
}

}  // namespace
}  // namespace fsdp_muon
