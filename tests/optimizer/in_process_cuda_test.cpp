// The library's multi-rank GPU paths on one GPU: every rank a thread of the in-process CUDA world
// (tests/common/in_process_cuda_communicator.h), with real streams per rank and per lane, so that
// a stream wait the library forgets gives wrong bits. Each case runs with the asynchronous
// collectives delayed on their lanes and without:
//   - every collective, synchronous and asynchronous, uneven and empty blocks, fp32, bf16 and
//     int64, equals GlooCommunicator's in-process world on the same inputs bit for bit (this is
//     what proves the CUDA world itself); a read before wait() sees poison, not the result,
//     whatever the timing; a rank that never comes, calls another collective or throws inside
//     one is an error on its peers at once;
//   - FsdpMuon's exchange at W = 2 and 4 (rows of 1, sizes no W divides, ranks holding nothing)
//     equals single-device Muon on the GPU bit for bit, weights and momentum;
//   - ZeRO-3 with prefetch at W = 2 and 4, and HSDP 2x2 (every replica mode), train bit for bit
//     like ZeRO-1 and like single-device Muon + AdamW on the GPU, whose gradients Gloo averages
//     on the CPU from the ranks' CUDA-computed ones; the CUDA reduce-scatter (and replica
//     all-reduce) give Gloo's bits.
// Skips, saying why, where no GPU is usable; scripts/gpu-check runs it (label gpu).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp/shard_module.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "common/block_stack.h"
#include "common/distributed_main.h"
#include "common/model_specs.h"
#include "common/test_util.h"

#if FSDP_MUON_WITH_CUDA
#include <ATen/CPUGeneratorImpl.h>

#include "common/in_process_cuda_communicator.h"
#endif

namespace fsdp_muon {
namespace {

#if FSDP_MUON_WITH_CUDA

using testing::expect_error;
using testing::gloo_world;
using testing::gloo_world_ptr;
using testing::on_cuda_world_of;
using testing::Spec;
using testing::world;
using testing::world_ptr;

// ~20 ms on a 2 GHz GPU per asynchronous collective, on its lane. A read of a result before
// wait() is wrong without it (deferred delivery: the poison); the delay is for the send side: the
// lane reads the send buffers that much later, so a caller that overwrites or frees one before
// wait() has its write run first and the peers receive wrong bits. 20 ms rather than 5: such a
// write may come some kernels, allocations or a backward node after the call, not only right
// behind it. The cost: the delayed passes start about 700 asynchronous collectives per rank (the
// ranks' and lanes' sleeps overlap), at most about 15 s in all.
constexpr int64_t kDelayCycles = 40'000'000;

// Runs `body` at world size `size` without the delay and with it.
void with_and_without_delay(int size, const std::function<void()>& body) {
  for (const bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "collectives delayed" : "collectives prompt");
    std::optional<testing::InProcessCudaDelay> delay;
    if (delayed) delay.emplace(kDelayCycles);
    on_cuda_world_of(size, body);
  }
}

// `t` on the host, through the rank's communicator (a bounded wait).
at::Tensor host(const at::Tensor& t) { return world().to_host(t.detach()).clone(); }

// The same dtype, shape and bytes (unlike at::equal, -0.0 differs from 0.0 and NaN equals
// itself).
::testing::AssertionResult same_bits(const at::Tensor& got_in, const at::Tensor& want_in) {
  const at::Tensor got = got_in.is_cpu() ? got_in : host(got_in);
  const at::Tensor want = want_in.is_cpu() ? want_in : host(want_in);
  if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure()
           << got.scalar_type() << got.sizes() << " against " << want.scalar_type() << want.sizes();
  }
  const at::Tensor a = got.contiguous().reshape({-1}).view(at::kByte);
  const at::Tensor b = want.contiguous().reshape({-1}).view(at::kByte);
  if (at::equal(a, b)) return ::testing::AssertionSuccess();
  const at::Tensor differ = got.to(at::kDouble).ne(want.to(at::kDouble));
  return ::testing::AssertionFailure()
         << differ.sum().item<int64_t>() << " of " << got.numel() << " elements differ, by up to "
         << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
}

// same_bits, every NaN (the in-process CUDA world's poison, whatever its payload) as one value.
::testing::AssertionResult same_bits_any_nan(const at::Tensor& got, const at::Tensor& want) {
  constexpr double kNan = -4242.0;  // no buffer of these tests holds it
  return same_bits(got.nan_to_num(kNan), want.nan_to_num(kNan));
}

// ---------------------------------------------------------------------------------------------
// The collectives against Gloo

// Rank `rank`'s input for case `seed`: from a generator of its own, so the ranks draw without a
// shared lock. `exact`: small integers, whose sums are exact in any order (Gloo's all-reduce does
// not add in rank order at W >= 3).
at::Tensor values(uint64_t seed, int rank, int64_t numel, c10::ScalarType dtype, bool exact) {
  at::Generator gen =
      at::make_generator<at::CPUGeneratorImpl>(seed * 131 + static_cast<uint64_t>(rank));
  at::Tensor x = at::randn({numel}, gen);
  if (exact || c10::isIntegralType(dtype, /*includeBool=*/false)) x = x.mul(8).round();
  return x.to(dtype);
}

int64_t total(const std::vector<int64_t>& counts) {
  return std::accumulate(counts.begin(), counts.end(), int64_t{0});
}

using Results = std::vector<at::Tensor>;

// One collective with this rank's inputs on comm.device(); returns what it leaves in every
// buffer, on the host.
struct Collective {
  std::string name;
  std::function<Results(Communicator& comm, bool async)> run;
};

at::Tensor on_device(Communicator& comm, const at::Tensor& t) { return t.to(comm.device()); }
at::Tensor to_cpu(Communicator& comm, const at::Tensor& t) { return comm.to_host(t).clone(); }

std::vector<Collective> collectives(int w) {
  std::vector<Collective> out;
  uint64_t seed = 0;
  const std::vector<c10::ScalarType> floats = {at::kFloat, at::kBFloat16};
  for (const c10::ScalarType dtype : floats) {
    // Uneven blocks, some empty (a rank's block to itself among them).
    const auto block = [](int from, int to) { return int64_t{(from + 2 * to + 1) % 4} * 5; };
    out.push_back(
        {"all_to_all_v " + std::string(c10::toString(dtype)), [=](Communicator& comm, bool async) {
           const int r = comm.rank();
           std::vector<int64_t> send_counts(w), recv_counts(w);
           for (int q = 0; q < w; ++q) {
             send_counts[q] = block(r, q);
             recv_counts[q] = block(q, r);
           }
           const at::Tensor send =
               on_device(comm, values(seed + 1, r, total(send_counts), dtype, false));
           const at::Tensor recv = on_device(comm, at::full({total(recv_counts)}, -7, dtype));
           if (async) {
             comm.all_to_all_v_async(send, send_counts, recv, recv_counts)->wait();
           } else {
             comm.all_to_all_v(send, send_counts, recv, recv_counts);
           }
           return Results{to_cpu(comm, recv), to_cpu(comm, send)};
         }});
    // Uneven blocks, one empty, from a separate send buffer and in place (send = own block).
    for (const bool in_place : {false, true}) {
      out.push_back(
          {std::string("all_gather_v") + (in_place ? " in place " : " ") + c10::toString(dtype),
           [=](Communicator& comm, bool async) {
             const int r = comm.rank();
             const std::vector<int64_t> all_counts = {3, 0, 7, 1};
             const std::vector<int64_t> counts(all_counts.begin(), all_counts.begin() + w);
             const int64_t own = std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
             const at::Tensor mine = values(seed + 2, r, counts[r], dtype, false);
             const at::Tensor recv = on_device(comm, at::full({total(counts)}, -7, dtype));
             at::Tensor send = on_device(comm, mine);
             if (in_place) {
               send = recv.narrow(0, own, counts[r]);
               send.copy_(on_device(comm, mine));
             }
             if (async) {
               comm.all_gather_v_async(send, recv, counts)->wait();
             } else {
               comm.all_gather_v(send, recv, counts);
             }
             return Results{to_cpu(comm, recv)};
           }});
    }
    out.push_back({"broadcast " + std::string(c10::toString(dtype)), [=](Communicator& comm, bool) {
                     const at::Tensor t =
                         on_device(comm, values(seed + 3, comm.rank(), 13, dtype, false));
                     comm.broadcast(t, w - 1);
                     return Results{to_cpu(comm, t)};
                   }});
    seed += 10;
  }
  for (const c10::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    for (const int64_t n : {int64_t{5}, int64_t{0}}) {
      const std::string what =
          std::string(c10::toString(dtype)) + ", " + std::to_string(n) + " per rank";
      out.push_back({"all_gather " + what, [=](Communicator& comm, bool async) {
                       const at::Tensor send =
                           on_device(comm, values(seed + 4, comm.rank(), n, dtype, false));
                       const at::Tensor recv = on_device(comm, at::full({w * n}, -7, dtype));
                       if (async) {
                         comm.all_gather_async(send, recv)->wait();
                       } else {
                         comm.all_gather(send, recv);
                       }
                       return Results{to_cpu(comm, recv)};
                     }});
      // Gloo's mean: a sum in rank order (float for bf16), then / W; random values at every W.
      const int64_t rows = n == 0 ? 0 : 37;
      out.push_back({"reduce_scatter_mean " + what, [=](Communicator& comm, bool async) {
                       const at::Tensor send =
                           on_device(comm, values(seed + 5, comm.rank(), w * rows, dtype, false));
                       const at::Tensor recv = on_device(comm, at::full({rows}, -7, dtype));
                       if (async) {
                         comm.reduce_scatter_mean_async(send, recv)->wait();
                       } else {
                         comm.reduce_scatter_mean(send, recv);
                       }
                       return Results{to_cpu(comm, recv), to_cpu(comm, send)};
                     }});
    }
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      // Random sums only where their order cannot matter (W = 2).
      const bool exact = op == ReduceOp::kSum && w > 2;
      out.push_back({"all_reduce " + std::string(c10::toString(dtype)) + " op " +
                         std::to_string(static_cast<int>(op)) + (exact ? " (exact values)" : ""),
                     [=](Communicator& comm, bool async) {
                       const at::Tensor t =
                           on_device(comm, values(seed + 6, comm.rank(), 29, dtype, exact));
                       if (async) {
                         comm.all_reduce_async(t, op)->wait();
                       } else {
                         comm.all_reduce(t, op);
                       }
                       return Results{to_cpu(comm, t)};
                     }});
    }
    seed += 10;
  }
  out.push_back({"barrier", [](Communicator& comm, bool) {
                   comm.barrier();
                   return Results{};
                 }});
  return out;
}

// Every collective, synchronous and asynchronous, on the CUDA world and on Gloo's with the same
// inputs: the same bits in every buffer on every rank, and the same bytes counted.
TEST(InProcessCudaCollectives, EveryCollectiveEqualsGlooBitwise) {
  FSDP_MUON_REQUIRE_GPU("the in-process CUDA world is checked against Gloo on a GPU");
  for (const int w : {2, 4}) {
    with_and_without_delay(w, [&] {
      world().reset_stats();
      gloo_world().reset_stats();
      for (const Collective& c : collectives(w)) {
        for (const bool async : {false, true}) {
          const std::string what = c.name + (async ? " (async)" : "");
          const Results want = c.run(gloo_world(), async);
          const Results got = c.run(world(), async);
          ASSERT_EQ(got.size(), want.size()) << what;
          for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_TRUE(same_bits(got[i], want[i])) << what << ", buffer " << i;
          }
        }
      }
      const CommStats& got = world().stats();
      const CommStats& want = gloo_world().stats();
      EXPECT_EQ(got.all_to_all_v_bytes, want.all_to_all_v_bytes);
      EXPECT_EQ(got.all_gather_bytes, want.all_gather_bytes);
      EXPECT_EQ(got.all_gather_v_bytes, want.all_gather_v_bytes);
      EXPECT_EQ(got.reduce_scatter_bytes, want.reduce_scatter_bytes);
      EXPECT_EQ(got.all_reduce_bytes, want.all_reduce_bytes);
      EXPECT_EQ(got.broadcast_bytes, want.broadcast_bytes);
      EXPECT_EQ(got.calls, want.calls);
      EXPECT_EQ(world().backend_name(), "in_process_cuda");
      EXPECT_EQ(world().device(), c10::Device(c10::kCUDA, 0));
    });
  }
}

// Deferred delivery: before wait() the caller's stream reads the poison (or, where the caller's
// data is part of the result, that data), never the result and never a stale block that equals
// it, whatever the timing: also once the device has run everything, and with the lanes prompt as
// well as delayed. wait(), a work destroyed unwaited and a later synchronous collective deliver
// the result; delayed, a delivery that did not wait for the collective's end would copy an
// unfinished one. The prompt pass runs first, which warms up the lanes, kernels and allocator.
TEST(InProcessCudaCollectives, DelayedCollectiveIsStaleUnlessWaitedFor) {
  FSDP_MUON_REQUIRE_GPU("the stream order of the in-process CUDA world is checked on a GPU");
  with_and_without_delay(2, [] {
    const int r = world().rank();
    const auto on_gpu = at::TensorOptions().device(world().device());
    const at::Tensor send = at::full({4}, 10.0 * (r + 1), on_gpu);
    const at::Tensor expected = at::cat({at::full({4}, 10.0), at::full({4}, 20.0)});
    const at::Tensor poison = at::full({8}, std::numeric_limits<float>::quiet_NaN());

    const at::Tensor recv = at::full({8}, -1.0, on_gpu);
    auto work = world().all_gather_async(send, recv);
    // A consumer on the caller's stream that wait() did not order after the collective.
    EXPECT_TRUE(same_bits_any_nan(recv.clone(), poison)) << "read before wait()";
    // However late it runs: the lanes have finished, the result is still not there.
    torch::cuda::synchronize(0);
    EXPECT_TRUE(same_bits_any_nan(recv.clone(), poison)) << "read before wait(), the device idle";
    work->wait();
    EXPECT_TRUE(same_bits(recv, expected)) << "after wait()";

    // The allocator hands the block that holds this very result to the next buffer of its size,
    // as ZeRO-3's backward gathers the forward's weights again: stale but equal bits.
    {
      const at::Tensor first = at::empty({8}, on_gpu);
      world().all_gather_async(send, first)->wait();
      EXPECT_TRUE(same_bits(first, expected)) << "after wait()";
    }
    const at::Tensor reused = at::empty({8}, on_gpu);
    auto reused_work = world().all_gather_async(send, reused);
    EXPECT_TRUE(same_bits_any_nan(reused.clone(), poison)) << "a reused block read before wait()";
    reused_work->wait();
    EXPECT_TRUE(same_bits(reused, expected)) << "a reused block after wait()";

    // In place: an all-reduce's buffer is its input until wait().
    const at::Tensor mine = at::full({3}, r + 1.0, on_gpu);
    auto reduce = world().all_reduce_async(mine);
    EXPECT_TRUE(same_bits(mine.clone(), at::full({3}, r + 1.0))) << "all_reduce before wait()";
    reduce->wait();
    EXPECT_TRUE(same_bits(mine, at::full({3}, 3.0))) << "all_reduce after wait()";

    // An all-gather-v whose send buffer is this rank's block: that block keeps the rank's data,
    // the rest is poison.
    const std::vector<int64_t> counts = {2, 3};
    const at::Tensor gathered = at::full({5}, -1.0, on_gpu);
    const at::Tensor own = gathered.narrow(0, r == 0 ? 0 : 2, counts[r]);
    own.fill_(r + 1.0);
    auto gather_v = world().all_gather_v_async(own, gathered, counts);
    at::Tensor want_early = at::full({5}, std::numeric_limits<float>::quiet_NaN());
    want_early.narrow(0, r == 0 ? 0 : 2, counts[r]).fill_(r + 1.0);
    EXPECT_TRUE(same_bits_any_nan(gathered.clone(), want_early))
        << "all_gather_v in place before wait()";
    gather_v->wait();
    EXPECT_TRUE(same_bits(gathered, at::tensor({1.0F, 1.0F, 2.0F, 2.0F, 2.0F})))
        << "all_gather_v in place after wait()";

    // Integers: the bytes 0x5A.
    const at::Tensor ints = at::full({8}, -1, on_gpu.dtype(at::kLong));
    auto int_work = world().all_gather_async(send.to(at::kLong), ints);
    EXPECT_TRUE(same_bits(ints.clone(), at::full({8}, int64_t{0x5A5A5A5A5A5A5A5A}, at::kLong)))
        << "int64 read before wait()";
    int_work->wait();
    EXPECT_TRUE(same_bits(ints, expected.to(at::kLong))) << "int64 after wait()";

    const at::Tensor dropped = at::full({8}, -1.0, on_gpu);
    world().all_gather_async(send, dropped).reset();  // destroyed unwaited
    EXPECT_TRUE(same_bits(dropped, expected)) << "after the work was destroyed unwaited";

    const at::Tensor before_sync = at::full({8}, -1.0, on_gpu);
    auto pending = world().all_gather_async(send, before_sync);
    EXPECT_TRUE(same_bits_any_nan(before_sync.clone(), poison))
        << "read before the synchronous one";
    const at::Tensor other = at::ones({3}, on_gpu);
    world().all_reduce(other);  // synchronous: after every lane's last asynchronous collective
    EXPECT_TRUE(same_bits(before_sync, expected)) << "after a later synchronous collective";
    pending->wait();
    EXPECT_TRUE(same_bits(before_sync, expected)) << "waited after the synchronous collective";
  });
}

// A rank that never comes is named at once, not after the timeout; collectives that do not match
// fail on every rank.
TEST(InProcessCudaCollectives, MissingAndMismatchedRanksAreErrors) {
  FSDP_MUON_REQUIRE_GPU("the in-process CUDA world is checked on a GPU");
  on_cuda_world_of(2, [] {
    if (world().rank() == 1) return;  // leaves without the all-reduce
    const at::Tensor t = at::ones({3}, at::TensorOptions().device(world().device()));
    expect_error(
        [&] { world().all_reduce(t); },
        {"Communicator::all_reduce", "rank 1 will never join all_reduce", "its body returned"});
  });
  on_cuda_world_of(2, [] {
    const auto on_gpu = at::TensorOptions().device(world().device());
    const at::Tensor t = at::ones({4}, on_gpu);
    if (world().rank() == 0) {
      expect_error([&] { world().all_reduce(t); },
                   {"rank 1 called all_gather where rank 0 called all_reduce"});
    } else {
      const at::Tensor all = at::empty({8}, on_gpu);
      expect_error([&] { world().all_gather(t, all); },
                   {"rank 1 called all_gather where rank 0 called all_reduce"});
    }
  });
}

// A rank that throws inside a collective, after every rank arrived, fails it for its peers at
// once, naming itself and its error: rank 1 stays in its body until rank 0 has failed, so rank 0
// cannot learn of it from rank 1 leaving (that error says "will never join", after up to 5 s).
TEST(InProcessCudaCollectives, ARankThatThrowsInACollectiveFailsItsPeersAtOnce) {
  FSDP_MUON_REQUIRE_GPU("the in-process CUDA world is checked on a GPU");
  std::atomic<bool> rank0_failed{false};
  testing::fail_next_in_process_cuda_collective(1);
  on_cuda_world_of(2, [&] {
    const at::Tensor t = at::ones({3}, at::TensorOptions().device(world().device()));
    if (world().rank() == 1) {
      expect_error([&] { world().all_reduce(t); }, {"an injected failure"});
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!rank0_failed && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_TRUE(rank0_failed) << "rank 0 still waits in the all-reduce rank 1 threw in";
    } else {
      expect_error([&] { world().all_reduce(t); },
                   {"rank 1 threw in all_reduce", "an injected failure"});
      rank0_failed = true;
    }
    // The world works on: the next collective is a fresh round.
    const at::Tensor u = at::ones({3}, at::TensorOptions().device(world().device()));
    world().all_reduce(u);
    EXPECT_TRUE(same_bits(u, at::full({3}, 2.0F)));
  });
  testing::fail_next_in_process_cuda_collective(-1);  // disarmed, had it not fired
}

// ---------------------------------------------------------------------------------------------
// FsdpMuon's exchange against single-device Muon

// As tests/optimizer/fsdp_muon_distributed_test.cpp: at W = 2 and 4 a row of 1, a column of 1,
// sizes no W divides, 1-D parameters between matrices, and ranks holding nothing of a matrix.
std::vector<std::vector<Spec>> exchange_specs() {
  return {{{"a.w1", {5, 7}}, {"a.b1", {7}}, {"a.row", {1, 9}}, {"a.w3", {13, 3}}},
          {{"b.w", {3, 11}}, {"b.tiny", {2, 2}}, {"b.big", {17, 6}}, {"b.norm", {5}}},
          {{"c.col", {9, 1}}, {"c.w", {6, 6}}}};
}

struct Model {
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<std::vector<at::Tensor>> reference;  // full tensors on the GPU, [group][parameter]
};

Model make_model(uint64_t seed) {
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> drawn;
  {
    testing::SeededRandom random(seed);
    for (const auto& specs : exchange_specs()) drawn.push_back(testing::random_parameters(specs));
  }
  Model model;
  for (size_t g = 0; g < drawn.size(); ++g) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    std::vector<at::Tensor> reference;
    for (const auto& [name, t] : drawn[g]) {
      const at::Tensor p = t.detach().to(world().device());
      named.emplace_back(name, p.clone().requires_grad_(true));
      reference.push_back(p.clone().requires_grad_(true));
    }
    model.groups.push_back(std::make_shared<FsdpParameterGroup>(
        std::move(named), world_ptr(),
        FsdpParameterGroupOptions().broadcast_from_rank0(false).name("g" + std::to_string(g))));
    model.reference.push_back(std::move(reference));
  }
  return model;
}

// The same full gradients on every rank: each writes its slice into its gradient shards.
void feed_gradients(Model& model, uint64_t seed) {
  std::vector<std::vector<at::Tensor>> drawn;
  {
    testing::SeededRandom random(seed);
    for (const auto& params : model.reference) {
      drawn.emplace_back();
      for (const at::Tensor& p : params) drawn.back().push_back(at::randn(p.sizes()));
    }
  }
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    group->zero_grad();
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const at::Tensor full = drawn[g][i].to(world().device());
      const auto [first, second] = group->held_range(i);
      group->sharded_parameter(i).grad().copy_(full.reshape({-1}).slice(0, first, second));
      model.reference[g][i].mutable_grad() = full.clone();
    }
  }
}

// Momentum: each rank keeps exactly its slice of the reference's, bit for bit.
void expect_same_momentum(const FsdpMuon& fsdp, const FsdpParameterGroup& group, size_t i,
                          const Muon& muon, const at::Tensor& ref, const std::string& what) {
  const at::Tensor& p = group.sharded_parameter(i);
  const auto mine = fsdp.state().find(p.unsafeGetTensorImpl());
  const auto theirs = muon.state().find(ref.unsafeGetTensorImpl());
  ASSERT_NE(theirs, muon.state().end()) << what << ": the reference has no state";
  if (p.numel() == 0 && mine == fsdp.state().end()) return;  // holds none of it
  ASSERT_NE(mine, fsdp.state().end()) << what << ": no state for " << group.slot(i).name;
  const auto& m = static_cast<const MuonParamState&>(*mine->second);
  const auto& t = static_cast<const MuonParamState&>(*theirs->second);
  const auto [first, second] = group.held_range(i);
  EXPECT_TRUE(
      same_bits(m.momentum_buffer(), t.momentum_buffer().reshape({-1}).slice(0, first, second)))
      << what << ": momentum of " << group.slot(i).name;
}

void expect_matches_muon(const Model& model, const FsdpMuon& fsdp, const Muon& muon,
                         const std::string& what) {
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    const auto module_params = group->model_parameters();
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const at::Tensor& ref = model.reference[g][i];
      const auto [first, second] = group->held_range(i);
      EXPECT_TRUE(same_bits(group->sharded_parameter(i),
                            ref.detach().reshape({-1}).slice(0, first, second)))
          << what << ": shard of " << group->slot(i).name;
      EXPECT_TRUE(same_bits(module_params[i], ref))
          << what << ": model weight " << group->slot(i).name;
      if (ref.dim() == 2) expect_same_momentum(fsdp, *group, i, muon, ref, what);
    }
  }
}

MuonOptions fp32_muon_options() {
  // fp32 Newton–Schulz through cuBLAS, the same per matrix on its owner as in Muon.
  return MuonOptions(0.02).weight_decay(0.1).newton_schulz(
      NewtonSchulzOptions().compute_dtype(at::kFloat));
}

TEST(InProcessCudaFsdpMuon, ExchangeEqualsSingleDeviceMuonBitwise) {
  FSDP_MUON_REQUIRE_GPU("FsdpMuon's exchange across ranks is checked on a GPU");
  for (const int w : {2, 4}) {
    with_and_without_delay(w, [&] {
      // The default plan, and a round per owned matrix with the rounds' asynchronous gathers
      // and scatters overlapping the Newton–Schulz of others.
      const std::vector<std::pair<std::string, FsdpMuonConfig>> configs = {
          {"default plan", FsdpMuonConfig()},
          {"a round per matrix, overlapped",
           FsdpMuonConfig().planner(OwnerPlanOptions().prefetch_budget_bytes(0))}};
      uint64_t seed = 7;
      for (const auto& [name, base] : configs) {
        SCOPED_TRACE(name);
        FsdpMuonConfig config = base;
        config.batch_newton_schulz(NewtonSchulzBatching::kWhereBitwise);
        Model model = make_model(++seed);
        std::vector<at::Tensor> sharded, reference;
        for (size_t g = 0; g < model.groups.size(); ++g) {
          for (size_t i = 0; i < model.groups[g]->num_parameters(); ++i) {
            if (model.groups[g]->slot(i).shape.size() != 2) continue;
            sharded.push_back(model.groups[g]->sharded_parameter(i));
            reference.push_back(model.reference[g][i]);
          }
        }
        FsdpMuon fsdp(sharded, fp32_muon_options(), config);
        Muon muon(reference, fp32_muon_options());
        if (name != "default plan") {
          EXPECT_GT(fsdp.owner_plan().rounds.size(), 1u);
        }
        for (int step = 0; step < 3; ++step) {
          feed_gradients(model, 1000 * seed + step);
          fsdp.step();
          muon.step();
          expect_matches_muon(model, fsdp, muon, name + ", step " + std::to_string(step));
        }
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// ZeRO-3 and HSDP training against single-device Muon + AdamW

// A column and a row of 1 and sizes no shard size divides, as the CPU suites use.
const std::vector<int64_t> kDims = {6, 11, 5, 1, 7, 3};

using testing::Block;
using testing::Stack;

// The model every run starts from, the same on every rank, on the rank's GPU.
Stack seeded_stack() {
  Stack net{nullptr};
  {
    testing::SeededRandom random(5);
    net = Stack(kDims);
  }
  net->to(world().device());
  return net;
}

// World rank `rank`'s batch at step `step`: each rank its own.
at::Tensor input_of(int rank, int step) {
  at::Tensor x;
  {
    testing::SeededRandom random(900 + 97 * step + rank);
    x = at::randn({4, kDims.front()});
  }
  return x.to(world().device());
}

const torch::optim::AdamWOptions kAdamW = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);

struct RunSpec {
  ShardingStrategy strategy;
  ReplicaNewtonSchulz replica_mode;
  std::string name() const {
    return std::string(to_string(strategy)) + ", " + to_string(replica_mode);
  }
};

// A sharded model on `mesh` with FsdpMuon on its matrices and AdamW on the rest.
struct Run {
  Run(const DeviceMesh& mesh, const RunSpec& run_spec) : spec(run_spec), net(seeded_stack()) {
    groups = shard_module(
        *net, mesh,
        ShardModuleOptions().group_options(
            FsdpParameterGroupOptions().sharding_strategy(spec.strategy).prefetch(true)));
    std::vector<at::Tensor> matrices, others;
    for (const auto& g : groups) {
      for (size_t i = 0; i < g->num_parameters(); ++i) {
        (g->slot(i).shape.size() == 2 ? matrices : others).push_back(g->sharded_parameter(i));
      }
    }
    // No prefetch budget under ZeRO-3: a round per owned matrix, the rounds' exchanges
    // overlapping.
    OwnerPlanOptions planner = OwnerPlanOptions().replica_newton_schulz(spec.replica_mode);
    if (spec.strategy == ShardingStrategy::kOptimGradsParams) planner.prefetch_budget_bytes(0);
    muon = std::make_unique<FsdpMuon>(
        matrices, fp32_muon_options(),
        FsdpMuonConfig().planner(planner).batch_newton_schulz(NewtonSchulzBatching::kWhereBitwise));
    adamw = std::make_unique<torch::optim::AdamW>(others, kAdamW);
  }

  // zero_grad, forward through the groups, backward (ZeRO-3: gathers and reduce-scatters start
  // in it); returns the loss.
  double forward_backward(int step) {
    for (auto& g : groups) g->zero_grad();
    at::Tensor h = input_of(world().rank(), step);
    for (size_t k = 0; k < groups.size(); ++k) {
      Block block = net->blocks[k];
      h = groups[k]->forward([&](const at::Tensor& x) { return block->forward(x); }, h);
    }
    const at::Tensor loss = h.pow(2).mean();
    loss.backward();
    return host(loss).item<double>();
  }

  void reduce() {
    for (auto& g : groups) g->reduce_scatter_grads();
  }

  void optimize() {
    adamw->step();  // first: FsdpMuon's step refreshes the groups' weights
    muon->step();
  }

  RunSpec spec;
  Stack net{nullptr};
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::unique_ptr<FsdpMuon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
};

// The unsharded model on the rank's GPU with single-device Muon and AdamW.
struct Reference {
  Reference() : net(seeded_stack()) {
    std::vector<at::Tensor> matrices, others;
    for (const at::Tensor& p : net->parameters()) (p.dim() == 2 ? matrices : others).push_back(p);
    muon = std::make_unique<Muon>(matrices, fp32_muon_options());
    adamw = std::make_unique<torch::optim::AdamW>(others, kAdamW);
  }
  Stack net{nullptr};
  std::unique_ptr<Muon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
};

// What Gloo makes of the ranks' local full gradients (`local`, group by group of `run`, on the
// host): the library's two stages, a reduce-scatter (mean) over the shard group, then on a mesh
// of several replicas a sum over them divided by their number. Returns each group's gradient
// shard.
std::vector<at::Tensor> reduce_on_gloo(const Run& run, const DeviceMesh& gloo_mesh,
                                       const std::vector<at::Tensor>& local) {
  std::vector<at::Tensor> shards;
  for (size_t g = 0; g < run.groups.size(); ++g) {
    at::Tensor reduced = at::empty({run.groups[g]->shard_numel()}, local[g].options());
    gloo_mesh.shard->reduce_scatter_mean(local[g], reduced);
    if (!gloo_mesh.one_dimensional()) {
      gloo_mesh.replicate->all_reduce(reduced);
      reduced.div_(gloo_mesh.replicas());
    }
    shards.push_back(reduced);
  }
  return shards;
}

// Main-weight shards and model weights of `run` against the reference's parameters, bit for bit,
// and FsdpMuon's momentum against Muon's.
void expect_matches_reference(Run& run, const Reference& ref, const std::string& what) {
  auto ref_params = ref.net->named_parameters();
  for (const auto& g : run.groups) {
    g->unshard();  // a collective: every rank, every group
    const auto module_params = g->model_parameters();
    for (size_t i = 0; i < g->num_parameters(); ++i) {
      const std::string& name = g->slot(i).name;
      const at::Tensor expected = ref_params[name].detach();
      const auto [first, second] = g->held_range(i);
      EXPECT_TRUE(
          same_bits(g->sharded_parameter(i), expected.reshape({-1}).slice(0, first, second)))
          << what << ": main-weight shard of " << name;
      EXPECT_TRUE(same_bits(module_params[i], expected)) << what << ": model weight " << name;
      if (expected.dim() == 2) {
        expect_same_momentum(*run.muon, *g, i, *ref.muon, ref_params[name], what);
      }
    }
    g->reshard();
  }
}

// Trains `specs` (the first under kOptim, whose local gradients are read before its reduction)
// and the single-device reference side by side for three steps on the mesh of `shard_size`.
// Every run's gradient shards must be Gloo's reduction of those local gradients (every run
// computes the same ones), and the reference's gradients are Gloo's average of them, so nothing
// of the CUDA world's reductions reaches the reference.
void train_against_reference(int shard_size, const std::vector<RunSpec>& specs) {
  ASSERT_EQ(specs.front().strategy, ShardingStrategy::kOptim);
  const DeviceMesh mesh = make_device_mesh(world_ptr(), shard_size);
  const DeviceMesh gloo_mesh = make_device_mesh(gloo_world_ptr(), shard_size);
  std::vector<std::unique_ptr<Run>> runs;
  for (const RunSpec& spec : specs) runs.push_back(std::make_unique<Run>(mesh, spec));
  Reference ref;
  for (int step = 0; step < 3; ++step) {
    const std::string at_step = ", step " + std::to_string(step);
    Run& zero1 = *runs.front();
    const double loss = zero1.forward_backward(step);
    std::vector<at::Tensor> local;
    for (const auto& g : zero1.groups) {
      ASSERT_EQ(g->compute_dtype(), at::kFloat);
      local.push_back(host(g->full_grad_buffer()));
    }
    zero1.reduce();
    for (size_t k = 1; k < runs.size(); ++k) {
      EXPECT_EQ(runs[k]->forward_backward(step), loss) << runs[k]->spec.name() << at_step;
      runs[k]->reduce();
    }
    const std::vector<at::Tensor> reduced = reduce_on_gloo(zero1, gloo_mesh, local);
    for (const auto& run : runs) {
      for (size_t g = 0; g < run->groups.size(); ++g) {
        EXPECT_TRUE(same_bits(run->groups[g]->grad_shard(), reduced[g]))
            << run->spec.name() << at_step << ": the gradient shard of " << run->groups[g]->name()
            << " is not Gloo's reduction of the local gradients";
      }
      run->optimize();
    }
    // The reference: Gloo's averaged full gradients.
    auto ref_params = ref.net->named_parameters();
    for (size_t g = 0; g < zero1.groups.size(); ++g) {
      const FsdpParameterGroup& group = *zero1.groups[g];
      at::Tensor full = at::empty({group.padded_numel()}, reduced[g].options());
      gloo_mesh.shard->all_gather(reduced[g], full);
      for (size_t i = 0; i < group.num_parameters(); ++i) {
        const ParameterSlot& slot = group.slot(i);
        ref_params[slot.name].mutable_grad() =
            full.narrow(0, slot.offset, slot.numel).view(slot.shape).to(world().device());
      }
    }
    ref.adamw->step();
    ref.muon->step();
    for (const auto& run : runs) expect_matches_reference(*run, ref, run->spec.name() + at_step);
  }
}

TEST(InProcessCudaZeroThree, PrefetchingTrainsLikeZeroOneAndSingleDeviceBitwise) {
  FSDP_MUON_REQUIRE_GPU("ZeRO-3 across ranks is checked on a GPU");
  for (const int w : {2, 4}) {
    with_and_without_delay(w, [&] {
      train_against_reference(
          w, {{ShardingStrategy::kOptim, ReplicaNewtonSchulz::kByCost},
              {ShardingStrategy::kOptimGradsParams, ReplicaNewtonSchulz::kByCost}});
    });
  }
}

TEST(InProcessCudaHsdp, TwoByTwoTrainsLikeSingleDeviceBitwiseInEveryReplicaMode) {
  FSDP_MUON_REQUIRE_GPU("HSDP across ranks is checked on a GPU");
  with_and_without_delay(4, [&] {
    train_against_reference(
        2, {{ShardingStrategy::kOptim, ReplicaNewtonSchulz::kByCost},
            {ShardingStrategy::kOptimGradsParams, ReplicaNewtonSchulz::kOncePerReplica},
            {ShardingStrategy::kOptimGradsParams, ReplicaNewtonSchulz::kOncePerWorld},
            {ShardingStrategy::kOptimGradsParams, ReplicaNewtonSchulz::kOncePerWorldRelay}});
  });
}

#else

TEST(InProcessCuda, NeedsACudaBuild) {
  GTEST_SKIP() << "fsdp_muon was built without CUDA (LibTorch is not a CUDA build)";
}

#endif  // FSDP_MUON_WITH_CUDA

}  // namespace
}  // namespace fsdp_muon
