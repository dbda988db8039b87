// The in-process CUDA world (in_process_cuda_communicator.h has the protocol and why).

#include "common/in_process_cuda_communicator.h"

// As the header: the CUDA headers below exist only in a CUDA build of LibTorch.
#if FSDP_MUON_WITH_CUDA

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/cuda/Sleep.h>
#include <c10/core/AutogradState.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "comm/agreement.h"
#include "common/check.h"
#include "common/distributed_main.h"

namespace fsdp_muon::testing {
namespace {

using Clock = std::chrono::steady_clock;

void check_cuda(cudaError_t status, const char* call) {
  FSDP_MUON_CHECK(status == cudaSuccess, "CUDA call ", call,
                  " failed: ", cudaGetErrorString(status));
}

// A CUDA event that marks a point on a stream (no timing). Destroying it once streams were made
// to wait on it is fine: a wait keeps the work it captured.
class Event {
 public:
  Event() {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~Event() { (void)cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(cudaStream_t stream) const {
    check_cuda(cudaEventRecord(event_, stream), "cudaEventRecord");
  }
  // `stream` waits for what preceded the last record(). Only that: an event never recorded
  // makes it wait for nothing, which is why every record comes before the barrier its waiters
  // pass first.
  void order_before(cudaStream_t stream) const {
    check_cuda(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// For error paths, which must not throw again: `waiter` waits for what `stream` holds now.
void order_after_quietly(cudaStream_t waiter, cudaStream_t stream) noexcept {
  cudaEvent_t event = nullptr;
  if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) return;
  if (cudaEventRecord(event, stream) == cudaSuccess) (void)cudaStreamWaitEvent(waiter, event, 0);
  (void)cudaEventDestroy(event);
}

// The kinds of asynchronous collective, each on a stream of its own per rank, as the NCCL
// communicator's lanes.
enum class Lane : size_t { kAllGather = 0, kReduceScatter, kAllReduce, kAllToAll };
constexpr size_t kLanes = 4;

// The result of one asynchronous collective, computed on its lane into `staged` and held back
// from `recv` until it is delivered: by CommWork::wait() on the caller's current stream, by the
// work's destructor on the calling stream, or by the rank's next synchronous collective on its
// stream, whichever comes first. Until then `recv` holds what the call left there (the poison,
// or the caller's own data where the contract makes the caller's data part of the result), so a
// read that the library does not order after the collective sees that, whatever the timing.
struct Delivery {
  std::shared_ptr<Event> done;  // on the lane: the result is staged and every peer has read
  at::Tensor recv;
  const void* recv_memory = nullptr;  // where `recv` was when the collective started
  at::Tensor staged;                  // undefined: nothing to write
  std::shared_ptr<Event> arrived;     // once delivered: after the write, on the stream that made it
};

// One rank of the in-process worlds on a device plays one device, whatever communicator of it is
// used (its world's, a split's): its lanes and the end of each lane's last asynchronous
// collective, which its synchronous collectives wait for, as NCCL's DeviceOrder; and its
// asynchronous collectives' results not yet delivered, oldest first.
struct RankDevice {
  std::mutex mutex;
  std::array<std::optional<c10::cuda::CUDAStream>, kLanes> lanes;
  std::array<std::shared_ptr<Event>, kLanes> last_async;
  std::vector<std::shared_ptr<Delivery>> pending;
};

// `device.mutex` is held. Writes `d`'s result into its receive buffer on `stream`, once: later
// calls only return the event after that write. The stream first waits for the collective's end.
const std::shared_ptr<Event>& deliver(RankDevice& device, Delivery& d,
                                      const c10::cuda::CUDAStream& stream) {
  if (d.arrived) return d.arrived;
  // Taken out first: a write that failed is not tried again (its buffer may be gone by then).
  auto& pending = device.pending;
  pending.erase(std::remove_if(pending.begin(), pending.end(),
                               [&](const std::shared_ptr<Delivery>& p) { return p.get() == &d; }),
                pending.end());
  const at::Tensor recv = std::move(d.recv);
  const at::Tensor staged = std::move(d.staged);
  d.done->order_before(stream.stream());
  // NCCL writes where the buffer was when the collective started: memory the caller has since
  // given back (ZeRO-3's weights resized to 0 bytes before the wait) is what it would corrupt.
  // Said, not written: a write into the new memory would hide that.
  TORCH_CHECK(!staged.defined() || recv.data_ptr() == d.recv_memory,
              "in-process CUDA world: the receive buffer of an asynchronous collective moved to "
              "other memory before the collective was waited for (NCCL would have written the "
              "old memory)");
  if (staged.defined()) {
    const c10::cuda::CUDAStreamGuard on_stream(stream);
    // Written as NCCL writes it, below autograd (no history, no version bump): this may run in a
    // destructor or a later collective, whatever the grad mode there.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    recv.copy_(staged);
    // The lane made `staged`, the caller `recv`: neither block is handed out again before this
    // copy has run.
    staged.record_stream(stream);
    recv.record_stream(stream);
  }
  auto arrived = std::make_shared<Event>();
  arrived->record(stream.stream());
  d.arrived = std::move(arrived);
  return d.arrived;
}

// Made on first use and never destroyed, like the lane streams in it: a work or a waiting stream
// may refer to them until the process ends, and the next world of this rank reuses them.
RankDevice& rank_device(int device_index, int rank) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, std::unique_ptr<RankDevice>> devices;
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<RankDevice>& device = devices[{device_index, rank}];
  if (!device) device = std::make_unique<RankDevice>();
  return *device;
}

// `device.mutex` is held by the caller. Created by us and non-blocking, as the NCCL backend's:
// no other code gets it from ATen's pool and queues work between our collectives.
c10::cuda::CUDAStream lane_stream(RankDevice& device, int device_index, Lane lane) {
  std::optional<c10::cuda::CUDAStream>& stream = device.lanes[static_cast<size_t>(lane)];
  if (!stream) {
    const auto index = static_cast<c10::DeviceIndex>(device_index);
    const c10::cuda::CUDAGuard guard(index);
    cudaStream_t created = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags");
    stream = c10::cuda::getStreamFromExternal(created, index);
  }
  return *stream;
}

std::atomic<int64_t>& async_delay() {
  static std::atomic<int64_t> cycles{0};
  return cycles;
}

// The root rank whose next collective throws (fail_next_in_process_cuda_collective); -1: none.
std::atomic<int>& injected_failure() {
  static std::atomic<int> root_rank{-1};
  return root_rank;
}

enum class Kind {
  kAllToAllV,
  kAllGather,
  kAllGatherV,
  kReduceScatterMean,
  kAllReduce,
  kBroadcast,
  kBarrier
};

const char* name_of(Kind kind) {
  switch (kind) {
    case Kind::kAllToAllV:
      return "all_to_all_v";
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kAllGatherV:
      return "all_gather_v";
    case Kind::kReduceScatterMean:
      return "reduce_scatter_mean";
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kBarrier:
      return "barrier";
  }
  return "?";
}

// One rank's call of a collective, as the base class checked it.
struct Call {
  explicit Call(Kind k) : kind(k) {}
  Kind kind;
  at::Tensor send;                   // what the peers read (all_reduce, broadcast: the tensor)
  at::Tensor recv;                   // where this rank's result lands (likewise)
  std::vector<int64_t> send_counts;  // all_to_all_v
  std::vector<int64_t> recv_counts;  // all_to_all_v, all_gather_v
  ReduceOp op = ReduceOp::kSum;      // all_reduce
  int root = 0;                      // broadcast
};

// What a rank hands its peers for one collective.
struct Deposit {
  std::optional<Call> call;
  std::shared_ptr<Event> ready;      // on its stream: its send buffer is produced
  std::shared_ptr<Event> read_done;  // on its stream: it has read every peer's buffer
};

// One collective of one world, from the first arrival until every rank has left it.
struct Round {
  explicit Round(int size)
      : deposits(static_cast<size_t>(size)),
        here(static_cast<size_t>(size), std::array<bool, 2>{false, false}),
        reads_enqueued(static_cast<size_t>(size), false) {}
  std::vector<Deposit> deposits;
  std::vector<std::array<bool, 2>> here;  // rank p has arrived at barrier 0 / 1
  // Rank p's stream holds every read of its peers' buffers it will make in this round (it came to
  // barrier 1, or it threw): what a rank that throws waits for before its buffers may go.
  std::vector<bool> reads_enqueued;
  std::array<int, 2> arrived{0, 0};
  int departed = 0;
  // Set by the first rank that gave up waiting: a rank arriving late fails too, rather than read
  // the buffers of ranks that have moved on.
  std::string abandoned;
};

// What a world made by make_in_process_cuda_world and every world split from it share: one lock
// and one condition for all their rendezvous, and which of the root world's ranks have left.
struct Family {
  Family(int size, int device, std::chrono::milliseconds t)
      : device_index(device), timeout(t), left(size) {}
  const int device_index;
  const std::chrono::milliseconds timeout;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<std::string> left;  // by root rank: why it left; empty while it plays
};

class World {
 public:
  // `root_ranks[r]`: rank r's rank in the family's root world (its device, its leaving);
  // `parent_ranks[r]`: its rank in the world this one was split from (the root: the same).
  World(std::shared_ptr<Family> family, std::vector<int> root_ranks, std::vector<int> parent_ranks)
      : family_(std::move(family)),
        root_ranks_(std::move(root_ranks)),
        parent_ranks_(std::move(parent_ranks)) {}

  int size() const { return static_cast<int>(root_ranks_.size()); }
  int root_rank(int rank) const { return root_ranks_[static_cast<size_t>(rank)]; }
  Family& family() const { return *family_; }

  // Barrier 0 of collective `seq`: deposits `rank`'s call and `ready`, waits until every rank
  // has, and returns every rank's deposit.
  std::vector<Deposit> meet(int64_t seq, int rank, const Call& call,
                            const std::shared_ptr<Event>& ready) {
    std::unique_lock<std::mutex> lock(family_->mutex);
    Round& round = round_of(seq);
    round.deposits[static_cast<size_t>(rank)].call = call;
    round.deposits[static_cast<size_t>(rank)].ready = ready;
    arrive_and_wait(lock, round, /*barrier=*/0, seq, rank, call.kind);
    return round.deposits;
  }

  // Barrier 1: deposits `read_done`, waits until every rank has, and returns every rank's.
  std::vector<std::shared_ptr<Event>> meet_again(int64_t seq, int rank, Kind kind,
                                                 const std::shared_ptr<Event>& read_done) {
    std::unique_lock<std::mutex> lock(family_->mutex);
    Round& round = round_of(seq);
    round.deposits[static_cast<size_t>(rank)].read_done = read_done;
    // Before the barrier's check of an abandoned round: a rank that throws waits for this.
    round.reads_enqueued[static_cast<size_t>(rank)] = true;
    family_->changed.notify_all();
    arrive_and_wait(lock, round, /*barrier=*/1, seq, rank, kind);
    std::vector<std::shared_ptr<Event>> out;
    for (const Deposit& d : round.deposits) out.push_back(d.read_done);
    return out;
  }

  // `rank` leaves collective `seq` (a `kind`) by an exception (`why`): the round fails at once for
  // the peers that wait in it or come to it later, naming `rank`, instead of waiting for its body
  // to end. Where every rank had passed barrier 0, the peers' streams may read this rank's buffers,
  // which its caller may free as soon as this throws: first every peer enqueues all it will read
  // (each leaves barrier 1 or throws at once, the round being abandoned; bounded by the timeout),
  // then the device runs it all. Never throws: it runs while an exception is in flight.
  void abandon(int64_t seq, int rank, Kind kind, const std::string& why) noexcept {
    // First said here: the device synchronize below has no bound, and the harness reports the
    // rank's outcome only after it.
    std::fprintf(stderr, "[in_process_cuda] rank %d threw in %s (collective #%lld): %s\n", rank,
                 name_of(kind), static_cast<long long>(seq), why.c_str());
    std::fflush(stderr);
    try {
      std::unique_lock<std::mutex> lock(family_->mutex);
      Round& round = round_of(seq);
      if (round.abandoned.empty()) {
        round.abandoned = c10::str("rank ", rank, " threw in ", name_of(kind), " (collective #",
                                   seq, " of this communicator): ", why);
      }
      round.reads_enqueued[static_cast<size_t>(rank)] = true;
      family_->changed.notify_all();
      if (round.arrived[0] != size()) return;  // no rank passed barrier 0: no rank read
      family_->changed.wait_for(lock, family_->timeout, [&] {
        return std::all_of(round.reads_enqueued.begin(), round.reads_enqueued.end(),
                           [](bool enqueued) { return enqueued; });
      });
    } catch (...) {
      // A lock or an allocation failed: still let the device finish what it holds.
    }
    (void)cudaDeviceSynchronize();
    (void)cudaGetLastError();  // a sticky error stays; anything else must not fail later checks
  }

  // `rank` is done with collective `seq` (also when it threw): the last rank out drops the round
  // and with it the peers' tensors and events. Every rank has by then made its streams wait for
  // what it needed of them.
  void depart(int64_t seq) noexcept {
    std::lock_guard<std::mutex> lock(family_->mutex);
    auto it = rounds_.find(seq);
    if (it == rounds_.end()) {
      it = rounds_.emplace(seq, std::make_unique<Round>(size())).first;
    }
    if (++it->second->departed == size()) rounds_.erase(it);
  }

  // The world of `members` (ranks here, in their new order) split under `tag`: made by the first
  // member to ask, shared by the others.
  std::shared_ptr<World> child(const std::string& tag, const std::vector<int>& members, int rank) {
    std::lock_guard<std::mutex> lock(family_->mutex);
    std::shared_ptr<World>& made = children_[tag];
    if (!made) {
      std::vector<int> roots;
      for (int m : members) roots.push_back(root_rank(m));
      made = std::make_shared<World>(family_, std::move(roots), members);
    }
    FSDP_MUON_CHECK(made->parent_ranks_ == members, "in_process_cuda rank ", rank, " of ", size(),
                    ": split ", tag, " has members ", c10::IntArrayRef(to_int64(members)),
                    " here but ", c10::IntArrayRef(to_int64(made->parent_ranks_)),
                    " on the member that made it");
    return made;
  }

  void leave(int rank, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(family_->mutex);
      std::string& left = family_->left[static_cast<size_t>(root_rank(rank))];
      if (left.empty()) left = why.empty() ? "left" : why;
    }
    family_->changed.notify_all();
  }

 private:
  static std::vector<int64_t> to_int64(const std::vector<int>& v) {
    return std::vector<int64_t>(v.begin(), v.end());
  }

  // `family_->mutex` is held.
  Round& round_of(int64_t seq) {
    std::unique_ptr<Round>& round = rounds_[seq];
    if (!round) round = std::make_unique<Round>(size());
    return *round;
  }

  // Marks `rank` arrived at `barrier` of `round` and waits, bounded by the timeout, until every
  // rank has; a rank that left without arriving fails it at once.
  void arrive_and_wait(std::unique_lock<std::mutex>& lock, Round& round, int barrier, int64_t seq,
                       int rank, Kind kind) {
    const auto b = static_cast<size_t>(barrier);
    const auto where = [&] {
      return c10::str("in_process_cuda rank ", rank, " of ", size(), ": ");
    };
    FSDP_MUON_CHECK(round.abandoned.empty(), where(), round.abandoned);
    round.here[static_cast<size_t>(rank)][b] = true;
    ++round.arrived[b];
    family_->changed.notify_all();
    const auto deadline = Clock::now() + family_->timeout;
    for (;;) {
      if (round.arrived[b] == size()) return;
      std::string failure = round.abandoned;
      std::vector<int64_t> missing;
      for (int p = 0; p < size() && failure.empty(); ++p) {
        if (round.here[static_cast<size_t>(p)][b]) continue;
        const std::string& left = family_->left[static_cast<size_t>(root_rank(p))];
        if (!left.empty()) {
          failure = c10::str("rank ", p, " will never join ", name_of(kind), " (collective #", seq,
                             " of this communicator): it left the world (", left, ")");
        }
        missing.push_back(p);
      }
      if (failure.empty() && Clock::now() >= deadline) {
        failure = c10::str("ranks ", c10::IntArrayRef(missing), " did not join ", name_of(kind),
                           " (collective #", seq, " of this communicator) within ",
                           family_->timeout.count(),
                           " ms (a rank stopped, is stuck, or calls collectives in another order)");
      }
      if (!failure.empty()) {
        if (round.abandoned.empty()) round.abandoned = failure;
        family_->changed.notify_all();
        FSDP_MUON_CHECK(false, where(), failure);
      }
      family_->changed.wait_until(lock, deadline);
    }
  }

  std::shared_ptr<Family> family_;
  std::vector<int> root_ranks_;
  std::vector<int> parent_ranks_;
  // Guarded by family_->mutex.
  std::map<int64_t, std::unique_ptr<Round>> rounds_;
  std::map<std::string, std::shared_ptr<World>> children_;
};

// Every rank checks the same deposits and so throws the same error, or none: calls that do not
// match fail the collective on every rank, instead of reading past a peer's buffer.
void check_calls_match(const std::vector<Deposit>& all, int rank, int64_t seq) {
  const int w = static_cast<int>(all.size());
  const Call& first = *all[0].call;
  const auto where = [&] {
    return c10::str("in_process_cuda rank ", rank, " of ", w, ", collective #", seq, ": ");
  };
  for (int p = 1; p < w; ++p) {
    const Call& c = *all[static_cast<size_t>(p)].call;
    FSDP_MUON_CHECK(c.kind == first.kind, where(), "rank ", p, " called ", name_of(c.kind),
                    " where rank 0 called ", name_of(first.kind),
                    "; every rank must call the same collectives in the same order");
    if (c.kind == Kind::kBarrier) continue;
    FSDP_MUON_CHECK(c.send.scalar_type() == first.send.scalar_type(), where(), "rank ", p,
                    " passes ", c.send.scalar_type(), ", rank 0 ", first.send.scalar_type());
    switch (c.kind) {
      case Kind::kAllGather:
      case Kind::kReduceScatterMean:
      case Kind::kAllReduce:
      case Kind::kBroadcast:
        FSDP_MUON_CHECK(c.send.numel() == first.send.numel(), where(), "rank ", p, " sends ",
                        c.send.numel(), " elements, rank 0 ", first.send.numel());
        FSDP_MUON_CHECK(c.op == first.op && c.root == first.root, where(), "rank ", p,
                        " passes another reduce operation or root than rank 0");
        break;
      case Kind::kAllGatherV:
        FSDP_MUON_CHECK(c.recv_counts == first.recv_counts, where(), "rank ", p,
                        " passed recv_counts ", c10::IntArrayRef(c.recv_counts), ", rank 0 ",
                        c10::IntArrayRef(first.recv_counts));
        break;
      case Kind::kAllToAllV:
      case Kind::kBarrier:
        break;
    }
  }
  if (first.kind == Kind::kAllToAllV) {
    for (int p = 0; p < w; ++p) {
      for (int q = 0; q < w; ++q) {
        const int64_t sent = all[static_cast<size_t>(p)].call->send_counts[static_cast<size_t>(q)];
        const int64_t expected =
            all[static_cast<size_t>(q)].call->recv_counts[static_cast<size_t>(p)];
        FSDP_MUON_CHECK(sent == expected, where(), "rank ", p, " sends ", sent,
                        " elements to rank ", q, ", which expects ", expected);
      }
    }
  }
}

// Element offset of block `index` when blocks of `counts` lie end to end.
int64_t offset_of(const std::vector<int64_t>& counts, int index) {
  return std::accumulate(counts.begin(), counts.begin() + index, int64_t{0});
}

// This rank's result, read from every rank's buffers with ATen ops on the current stream (the
// collective's), into fresh storage: nothing is written where a peer may still read (`nullopt`:
// nothing to write).
std::optional<at::Tensor> read_peers(const std::vector<Deposit>& all, int rank) {
  const int w = static_cast<int>(all.size());
  const Call& mine = *all[static_cast<size_t>(rank)].call;
  const auto peer = [&](int p) -> const Call& { return *all[static_cast<size_t>(p)].call; };
  switch (mine.kind) {
    case Kind::kAllToAllV: {
      at::Tensor staged = at::empty_like(mine.recv);
      for (int p = 0; p < w; ++p) {
        const int64_t n = mine.recv_counts[static_cast<size_t>(p)];
        if (n == 0) continue;
        staged.narrow(0, offset_of(mine.recv_counts, p), n)
            .copy_(peer(p).send.narrow(0, offset_of(peer(p).send_counts, rank), n));
      }
      return staged;
    }
    case Kind::kAllGather: {
      at::Tensor staged = at::empty_like(mine.recv);
      const int64_t n = mine.send.numel();
      for (int p = 0; p < w && n > 0; ++p) staged.narrow(0, p * n, n).copy_(peer(p).send);
      return staged;
    }
    case Kind::kAllGatherV: {
      at::Tensor staged = at::empty_like(mine.recv);
      for (int p = 0; p < w; ++p) {
        const int64_t n = mine.recv_counts[static_cast<size_t>(p)];
        if (n > 0) staged.narrow(0, offset_of(mine.recv_counts, p), n).copy_(peer(p).send);
      }
      return staged;
    }
    case Kind::kReduceScatterMean: {
      // GlooCommunicator's arithmetic: at::sum over the [W, n] blocks (per element a sum from
      // zero in rank order, accumulated in float for bf16 and fp16 and rounded once), then a
      // division by W in the tensor's dtype.
      const int64_t n = mine.recv.numel();
      const c10::ScalarType dtype = mine.recv.scalar_type();
      const c10::ScalarType accumulate = at::toOpMathType(dtype);
      at::Tensor sum = at::zeros({n}, mine.recv.options().dtype(accumulate));
      for (int p = 0; p < w && n > 0; ++p) sum.add_(peer(p).send.narrow(0, rank * n, n));
      at::Tensor staged = accumulate == dtype ? sum : sum.to(dtype);
      if (c10::isIntegralType(dtype, /*includeBool=*/true)) {
        staged.div_(w, "trunc");
      } else {
        staged.div_(w);
      }
      return staged;
    }
    case Kind::kAllReduce: {
      // In rank order, each step rounded to the dtype (Gloo's element-wise reduce functions).
      at::Tensor staged = peer(0).send.clone();
      for (int p = 1; p < w; ++p) {
        const at::Tensor& x = peer(p).send;
        switch (mine.op) {
          case ReduceOp::kSum:
            staged.add_(x);
            break;
          case ReduceOp::kMax:
            staged = at::maximum(staged, x);
            break;
          case ReduceOp::kMin:
            staged = at::minimum(staged, x);
            break;
        }
      }
      return staged;
    }
    case Kind::kBroadcast:
      if (rank == mine.root) return std::nullopt;
      return peer(mine.root).send.clone();
    case Kind::kBarrier:
      return std::nullopt;
  }
  return std::nullopt;
}

// Whether flat tensors `a` and `b` share bytes.
bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// Fills `t` with what no collective of these tests produces and no stale buffer holds: NaN for
// floating types, the bytes 0x5A for integers (0x5A5A5A5A5A5A5A5A in an int64). Other dtypes are
// left alone: no bool value differs from both results, and the tests use no others.
void poison(const at::Tensor& t) {
  if (t.numel() == 0) return;
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // as deliver() writes
  // Only dtypes whose fill cannot fail: a throw here, before the rendezvous, would leave this
  // rank a collective behind its peers.
  switch (t.scalar_type()) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kHalf:
    case c10::kBFloat16:
      t.fill_(std::numeric_limits<double>::quiet_NaN());
      break;
    case c10::kByte:
    case c10::kChar:
    case c10::kShort:
    case c10::kInt:
    case c10::kLong:
      t.view(c10::kByte).fill_(0x5A);
      break;
    default:
      break;
  }
}

// On the current stream (the caller's), the parts of `call.recv` the collective overwrites and
// the caller does not provide: all of it, except for an all-reduce (in place: the input), an
// all-gather whose send buffer is this rank's block of the receive buffer (the rest of it), and
// any other receive buffer that overlaps the send buffer (nothing: the peers read the send).
void poison_receive_buffer(const Call& call, int rank) {
  const at::Tensor& recv = call.recv;
  if (call.kind == Kind::kAllReduce || !recv.defined() || recv.numel() == 0) return;
  if (!overlap(call.send, recv)) {
    poison(recv);
    return;
  }
  if (call.kind != Kind::kAllGather && call.kind != Kind::kAllGatherV) return;
  const int64_t n = call.send.numel();
  const int64_t own = call.kind == Kind::kAllGather ? rank * n : offset_of(call.recv_counts, rank);
  if (own + n > recv.numel() || call.send.data_ptr() != recv.narrow(0, own, n).data_ptr()) return;
  poison(recv.narrow(0, 0, own));
  poison(recv.narrow(0, own + n, recv.numel() - own - n));
}

// An asynchronous collective. wait() delivers its result (unless the rank's synchronous collective
// did already) and orders the caller's current stream and the calling stream after that; the
// buffers are held until then, so the allocator hands their blocks out again only in an order
// after the collective.
class InProcessWork final : public CommWork {
 public:
  InProcessWork(RankDevice& device, std::shared_ptr<Delivery> delivery, int device_index,
                c10::cuda::CUDAStream calling_stream, std::vector<at::Tensor> buffers)
      : device_(device),
        delivery_(std::move(delivery)),
        device_index_(device_index),
        calling_stream_(calling_stream),
        buffers_(std::move(buffers)) {}

  ~InProcessWork() override {
    if (waited()) return;
    // Unwaited, the collective still finishes (the contract): its result lands on the calling
    // stream, which then may reuse the buffers, as they go back to the allocator with this work.
    // Never throws: failing that, the calling stream at least waits for the collective.
    try {
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      std::lock_guard<std::mutex> lock(device_.mutex);
      deliver(device_, *delivery_, calling_stream_)->order_before(calling_stream_.stream());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[in_process_cuda] an unwaited work's result was not delivered: %s\n",
                   e.what());
      std::fflush(stderr);
      (void)cudaStreamWaitEvent(calling_stream_.stream(), delivery_->done->get(), 0);
    } catch (...) {
      (void)cudaStreamWaitEvent(calling_stream_.stream(), delivery_->done->get(), 0);
    }
  }

 protected:
  void do_wait() override {
    const auto index = static_cast<c10::DeviceIndex>(device_index_);
    const c10::cuda::CUDAGuard guard(index);
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(index);
    std::shared_ptr<Event> arrived;
    {
      std::lock_guard<std::mutex> lock(device_.mutex);
      arrived = deliver(device_, *delivery_, caller);
    }
    // Delivered on `caller` just now, or earlier on a synchronous collective's stream.
    arrived->order_before(caller.stream());
    if (calling_stream_ != caller) arrived->order_before(calling_stream_.stream());
    buffers_.clear();
  }

 private:
  RankDevice& device_;
  std::shared_ptr<Delivery> delivery_;
  int device_index_;
  c10::cuda::CUDAStream calling_stream_;
  std::vector<at::Tensor> buffers_;
};

class InProcessCudaCommunicator final : public Communicator {
 public:
  InProcessCudaCommunicator(std::shared_ptr<World> world, int rank)
      : Communicator(rank, world->size()),
        world_(std::move(world)),
        device_index_(world_->family().device_index),
        device_(rank_device(device_index_, world_->root_rank(rank))) {}

  c10::Device device() const override {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index_));
  }
  std::string backend_name() const override { return "in_process_cuda"; }

  void leave(const std::string& why) const { world_->leave(rank(), why); }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                       const at::Tensor& recv, const std::vector<int64_t>& recv_counts) override {
    run_sync(all_to_all_v_call(send, send_counts, recv, recv_counts));
  }
  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override {
    run_sync(call_of(Kind::kAllGather, send, recv));
  }
  void do_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                       const std::vector<int64_t>& recv_counts) override {
    run_sync(all_gather_v_call(send, recv, recv_counts));
  }
  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    run_sync(call_of(Kind::kReduceScatterMean, send, recv));
  }
  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    run_sync(all_reduce_call(tensor, op));
  }
  void do_broadcast(const at::Tensor& tensor, int root) override {
    Call call = call_of(Kind::kBroadcast, tensor, tensor);
    call.root = root;
    run_sync(call);
  }
  void do_barrier() override {
    // The host waits too, as NCCL's barrier does: every rank's work before it has then run.
    wait_on_host(run_sync(Call(Kind::kBarrier)), "barrier");
  }

  std::unique_ptr<CommWork> do_all_to_all_v_async(
      const at::Tensor& send, const std::vector<int64_t>& send_counts, const at::Tensor& recv,
      const std::vector<int64_t>& recv_counts) override {
    return run_async(Lane::kAllToAll, all_to_all_v_call(send, send_counts, recv, recv_counts));
  }
  std::unique_ptr<CommWork> do_all_gather_async(const at::Tensor& send,
                                                const at::Tensor& recv) override {
    return run_async(Lane::kAllGather, call_of(Kind::kAllGather, send, recv));
  }
  std::unique_ptr<CommWork> do_all_gather_v_async(
      const at::Tensor& send, const at::Tensor& recv,
      const std::vector<int64_t>& recv_counts) override {
    return run_async(Lane::kAllGather, all_gather_v_call(send, recv, recv_counts));
  }
  std::unique_ptr<CommWork> do_reduce_scatter_mean_async(const at::Tensor& send,
                                                         const at::Tensor& recv) override {
    return run_async(Lane::kReduceScatter, call_of(Kind::kReduceScatterMean, send, recv));
  }
  std::unique_ptr<CommWork> do_all_reduce_async(const at::Tensor& tensor, ReduceOp op) override {
    return run_async(Lane::kAllReduce, all_reduce_call(tensor, op));
  }

  // Pinned memory, a non-blocking copy behind everything on the current stream, and a host wait
  // bounded by the timeout, as the NCCL backend's.
  at::Tensor do_to_host(const at::Tensor& tensor) override {
    const auto index = static_cast<c10::DeviceIndex>(device_index_);
    const c10::cuda::CUDAGuard guard(index);
    const at::Tensor source = tensor.contiguous();
    at::Tensor host =
        at::empty(source.sizes(), source.options().device(c10::kCPU).pinned_memory(true));
    host.copy_(source, /*non_blocking=*/true);
    wait_on_host(c10::cuda::getCurrentCUDAStream(index).stream(), "to_host");
    return host;
  }

  std::shared_ptr<Communicator> do_split(const std::vector<int>& members, int new_rank,
                                         const std::string& tag) override {
    return std::make_shared<InProcessCudaCommunicator>(world_->child(tag, members, rank()),
                                                       new_rank);
  }

 private:
  static Call call_of(Kind kind, const at::Tensor& send, const at::Tensor& recv) {
    Call call(kind);
    call.send = send;
    call.recv = recv;
    return call;
  }
  static Call all_to_all_v_call(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                                const at::Tensor& recv, const std::vector<int64_t>& recv_counts) {
    Call call = call_of(Kind::kAllToAllV, send, recv);
    call.send_counts = send_counts;
    call.recv_counts = recv_counts;
    return call;
  }
  static Call all_gather_v_call(const at::Tensor& send, const at::Tensor& recv,
                                const std::vector<int64_t>& recv_counts) {
    Call call = call_of(Kind::kAllGatherV, send, recv);
    call.recv_counts = recv_counts;
    return call;
  }
  static Call all_reduce_call(const at::Tensor& tensor, ReduceOp op) {
    Call call = call_of(Kind::kAllReduce, tensor, tensor);
    call.op = op;
    return call;
  }

  // A synchronous collective: on the caller's current stream, after the last asynchronous
  // collective of every lane of this rank (docs/DESIGN.md §5), whose results it first delivers
  // there, oldest first. Returns that stream.
  cudaStream_t run_sync(const Call& call) {
    const auto index = static_cast<c10::DeviceIndex>(device_index_);
    const c10::cuda::CUDAGuard guard(index);
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(index);
    {
      std::lock_guard<std::mutex> lock(device_.mutex);
      // A copy: deliver() takes each off the list.
      const std::vector<std::shared_ptr<Delivery>> pending = device_.pending;
      for (const std::shared_ptr<Delivery>& d : pending) deliver(device_, *d, caller);
      for (const std::shared_ptr<Event>& last : device_.last_async) {
        if (last) last->order_before(caller.stream());
      }
    }
    const std::optional<at::Tensor> staged = exchange(call, caller);
    if (staged && staged->numel() > 0) {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;  // as NCCL writes: no version bump
      call.recv.copy_(*staged);
    }
    return caller.stream();
  }

  // An asynchronous collective: on `lane`, which first waits for the caller's current stream
  // (the send buffer may be produced there); the caller's stream waits for nothing. Its result
  // waits in a Delivery (see there); the receive buffer is poisoned first, on the caller's stream.
  std::unique_ptr<CommWork> run_async(Lane lane, const Call& call) {
    const auto index = static_cast<c10::DeviceIndex>(device_index_);
    const c10::cuda::CUDAGuard guard(index);
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(index);
    const c10::cuda::CUDAStream stream = [&] {
      std::lock_guard<std::mutex> lock(device_.mutex);
      return lane_stream(device_, device_index_, lane);
    }();
    // Before `produced`: the lane, and the peers' reads of the send buffer behind its `ready`,
    // come after the poison, which never touches a send buffer.
    poison_receive_buffer(call, rank());
    {
      const Event produced;
      produced.record(caller.stream());
      produced.order_before(stream.stream());
    }
    if (const int64_t cycles = async_delay().load(); cycles > 0) {
      const c10::cuda::CUDAStreamGuard on_lane(stream);
      at::cuda::sleep(cycles);
    }
    // Recorded on the calling stream, as the NCCL backend does: a block allocated on another
    // stream then waits for the calling stream, which wait() orders after the collective.
    std::vector<at::Tensor> buffers;
    for (const at::Tensor* t : {&call.send, &call.recv}) {
      if (t->defined() && t->numel() > 0) {
        t->record_stream(caller);
        buffers.push_back(*t);
      }
    }
    auto delivery = std::make_shared<Delivery>();
    try {
      const std::optional<at::Tensor> staged = exchange(call, stream);
      if (staged && staged->numel() > 0) {
        delivery->recv = call.recv;
        delivery->recv_memory = call.recv.data_ptr();
        delivery->staged = *staged;
      }
    } catch (...) {
      // The caller may free the buffers once this throws: its stream first waits for whatever
      // the lane still holds.
      order_after_quietly(caller.stream(), stream.stream());
      throw;
    }
    delivery->done = std::make_shared<Event>();
    delivery->done->record(stream.stream());
    {
      std::lock_guard<std::mutex> lock(device_.mutex);
      device_.last_async[static_cast<size_t>(lane)] = delivery->done;
      device_.pending.push_back(delivery);
    }
    return std::make_unique<InProcessWork>(device_, std::move(delivery), device_index_, caller,
                                           std::move(buffers));
  }

  // The protocol of the header's comment, on `stream`, but for the last write: returns this
  // rank's result, staged on `stream`, which has waited for every peer's reads (nullopt: nothing
  // to write). A failure here fails the round for the peers at once (World::abandon).
  std::optional<at::Tensor> exchange(const Call& call, const c10::cuda::CUDAStream& stream) {
    last_ = name_of(call.kind);
    const int64_t seq = seq_++;
    // Whatever happens, this rank leaves the round: the last one out drops it.
    struct Departure {
      World& world;
      int64_t seq;
      ~Departure() { world.depart(seq); }
    } departure{*world_, seq};
    try {
      // ATen's ops below, and the staging tensors' blocks, on the collective's stream.
      const c10::cuda::CUDAStreamGuard on_stream(stream);
      const cudaStream_t s = stream.stream();

      auto ready = std::make_shared<Event>();
      ready->record(s);
      const std::vector<Deposit> all = world_->meet(seq, rank(), call, ready);
      check_calls_match(all, rank(), seq);
      for (int p = 0; p < size(); ++p) {
        if (p != rank()) all[static_cast<size_t>(p)].ready->order_before(s);
      }
      int armed = world_->root_rank(rank());
      const bool injected = injected_failure().compare_exchange_strong(armed, -1);
      FSDP_MUON_CHECK(!injected, "in_process_cuda rank ", rank(), " of ", size(),
                      ": an injected failure (fail_next_in_process_cuda_collective)");
      std::optional<at::Tensor> staged = read_peers(all, rank());

      auto read_done = std::make_shared<Event>();
      read_done->record(s);
      const std::vector<std::shared_ptr<Event>> reads =
          world_->meet_again(seq, rank(), call.kind, read_done);
      for (int p = 0; p < size(); ++p) {
        if (p != rank()) reads[static_cast<size_t>(p)]->order_before(s);
      }
      return staged;
    } catch (...) {
      // Before `departure`: the round must still be there for the peers to read why.
      world_->abandon(seq, rank(), call.kind, detail::current_exception_message());
      throw;
    }
  }

  // Polls until everything enqueued on `stream` so far has run, at most the timeout.
  void wait_on_host(cudaStream_t stream, const char* what) {
    const Event done;
    done.record(stream);
    const auto timeout = world_->family().timeout;
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      const cudaError_t status = cudaEventQuery(done.get());
      if (status == cudaSuccess) return;
      FSDP_MUON_CHECK(status == cudaErrorNotReady, "in_process_cuda rank ", rank(), " of ", size(),
                      ": ", what, ": CUDA error ", cudaGetErrorString(status));
      (void)cudaGetLastError();  // "not ready" is no error: later checks must not see it
      FSDP_MUON_CHECK(Clock::now() < deadline, "in_process_cuda rank ", rank(), " of ", size(),
                      ": ", what, " did not complete within ", timeout.count(),
                      " ms (the collective enqueued last: ", last_.empty() ? "none" : last_, ")");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  std::shared_ptr<World> world_;
  int device_index_;
  RankDevice& device_;
  int64_t seq_ = 0;   // collectives called so far: the rendezvous' key
  std::string last_;  // the last one's name, for to_host's and barrier's errors
};

thread_local std::shared_ptr<Communicator> rank_gloo;

}  // namespace

std::vector<std::shared_ptr<Communicator>> make_in_process_cuda_world(
    int size, int device_index, std::chrono::milliseconds timeout) {
  FSDP_MUON_API_SCOPE("testing::make_in_process_cuda_world");
  FSDP_MUON_CHECK(size >= 1, "size must be at least 1, got ", size);
  FSDP_MUON_CHECK(device_index >= 0 && device_index < c10::cuda::device_count(),
                  "cuda:", device_index, " is not a visible device (", c10::cuda::device_count(),
                  " visible)");
  FSDP_MUON_CHECK(timeout.count() > 0, "the timeout must be positive");
  auto family = std::make_shared<Family>(size, device_index, timeout);
  std::vector<int> ranks(static_cast<size_t>(size));
  std::iota(ranks.begin(), ranks.end(), 0);
  auto world = std::make_shared<World>(std::move(family), ranks, ranks);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) {
    comms.push_back(std::make_shared<InProcessCudaCommunicator>(world, r));
  }
  return comms;
}

void leave_in_process_cuda_world(const Communicator& comm, const std::string& why) {
  if (const auto* c = dynamic_cast<const InProcessCudaCommunicator*>(&comm)) c->leave(why);
}

static size_t deliver_leftover_results(int device_index, int rank) {
  RankDevice& device = rank_device(device_index, rank);
  const auto index = static_cast<c10::DeviceIndex>(device_index);
  const c10::cuda::CUDAGuard guard(index);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(index);
  std::lock_guard<std::mutex> lock(device.mutex);
  const std::vector<std::shared_ptr<Delivery>> pending = device.pending;  // deliver() erases
  for (const std::shared_ptr<Delivery>& d : pending) deliver(device, *d, stream);
  return pending.size();
}

void set_in_process_cuda_async_delay(int64_t cycles) { async_delay() = cycles; }

void fail_next_in_process_cuda_collective(int root_rank) { injected_failure() = root_rank; }

void on_cuda_world_of(int size, const std::function<void()>& body) {
  TORCH_CHECK(torch::cuda::is_available(), "on_cuda_world_of needs a CUDA device");
  constexpr int kDevice = 0;
  const std::vector<std::shared_ptr<Communicator>> comms =
      make_in_process_cuda_world(size, kDevice, std::chrono::seconds(timeout_seconds()));
  // A copy: a failure drops distributed_main's entry.
  const std::vector<std::shared_ptr<Communicator>> gloo = in_process_gloo_world(size);
  // Taken here, one per rank, so that no two ranks share a stream.
  std::vector<c10::cuda::CUDAStream> streams;
  for (int r = 0; r < size; ++r) {
    streams.push_back(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, kDevice));
  }
  std::vector<size_t> leftover(static_cast<size_t>(size), 0);
  RankThreadHooks hooks;
  hooks.enter = [&](int r) {
    c10::cuda::set_device(kDevice);
    c10::cuda::setCurrentCUDAStream(streams[static_cast<size_t>(r)]);
    c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
    rank_gloo = gloo[static_cast<size_t>(r)];
  };
  hooks.leave = [&](int r, const std::string& outcome) {
    rank_gloo.reset();
    // gtest reports a rank's failures only once every rank's thread has ended: printed here, the
    // first error shows even when a peer then hangs until CTest's timeout kills the process.
    if (outcome != kRankBodyReturned) {
      std::fprintf(stderr, "[in_process_cuda] W=%d rank %d: %s\n", size, r, outcome.c_str());
      std::fflush(stderr);
    }
    leave_in_process_cuda_world(*comms[static_cast<size_t>(r)], outcome);
    // Works still alive after the body (held past it, or leaked) would free their tensors during
    // static destruction, after CUDA's allocator: their results land now, and are reported.
    try {
      leftover[static_cast<size_t>(r)] = deliver_leftover_results(kDevice, r);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[in_process_cuda] W=%d rank %d: %s\n", size, r, e.what());
    }
  };
  const bool skipped = run_on_rank_threads(comms, body, hooks);
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(leftover[static_cast<size_t>(r)], 0u)
        << "W=" << size << " rank " << r
        << ": asynchronous collectives neither waited for nor destroyed when the body returned";
  }
  // The next test starts on an idle device (a delayed lane may still sleep).
  torch::cuda::synchronize(kDevice);
  if (skipped) GTEST_SKIP() << "skipped at W=" << size;
}

Communicator& gloo_world() { return *gloo_world_ptr(); }

std::shared_ptr<Communicator> gloo_world_ptr() {
  TORCH_CHECK(rank_gloo, "gloo_world() is for the body of on_cuda_world_of");
  return rank_gloo;
}

}  // namespace fsdp_muon::testing

#endif  // FSDP_MUON_WITH_CUDA
