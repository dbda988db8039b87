#include <fsdp_muon/comm/nccl_communicator.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/cuda/Sleep.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/call_watchdog.h"
#include "comm/device_choice.h"
#include "comm/failure_domain.h"
#include "comm/nccl_internal.h"
#include "common/check.h"
#include "common/cuda_check.h"

namespace fsdp_muon {
namespace {

using Clock = std::chrono::steady_clock;

std::string version_string(int code) {
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." +
         std::to_string(code % 100);
}

// The process must run the NCCL it was compiled against: torch and fsdp_muon share one
// libnccl.so.2, and a different major/minor can change the ABI of ncclConfig_t and friends.
void check_nccl_version() {
  int loaded = 0;
  FSDP_MUON_CHECK_NCCL(ncclGetVersion(&loaded));
  FSDP_MUON_CHECK(
      loaded / 100 == NCCL_VERSION_CODE / 100, "this process loaded NCCL ", version_string(loaded),
      " but fsdp_muon was compiled against NCCL ", version_string(NCCL_VERSION_CODE),
      " headers; make the libnccl.so.2 torch loads (the nvidia-nccl wheel beside torch) "
      "the one fsdp_muon was built with (NCCL_HOME at configure time, LD_LIBRARY_PATH)");
}

// Errors name the collective the caller called (its ApiScope).
ncclDataType_t to_nccl(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return ncclFloat32;
    case c10::kDouble:
      return ncclFloat64;
    case c10::kHalf:
      return ncclFloat16;
    case c10::kBFloat16:
      return ncclBfloat16;
    case c10::kInt:
      return ncclInt32;
    case c10::kLong:
      return ncclInt64;
    case c10::kByte:
    case c10::kBool:
      return ncclUint8;
    case c10::kChar:
      return ncclInt8;
    default:
      FSDP_MUON_CHECK(false, "dtype ", t, " cannot be reduced by NCCL");
  }
}

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  FSDP_MUON_CHECK(false, "unknown ReduceOp ", static_cast<int>(op));
}

size_t bytes_of(const at::Tensor& t) { return static_cast<size_t>(t.nbytes()); }

constexpr const char* kFactoryApi = "fsdp_muon::make_nccl_communicator";
constexpr const char* kDestructorApi = "fsdp_muon::Communicator::~Communicator";
// What the watchdog names for an abort after an error (the failing collective is in the cause).
constexpr const char* kAbortApi = "fsdp_muon::Communicator (aborting after an error)";
constexpr const char* kAbortCall = "ncclCommAbort";

// A CUDA event that only marks a point on a stream (no timing), destroyed with its scope. An
// event destroyed before it completes is released by CUDA once it does.
class MarkerEvent {
 public:
  MarkerEvent() { FSDP_MUON_CHECK_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~MarkerEvent() { cudaEventDestroy(event_); }
  MarkerEvent(const MarkerEvent&) = delete;
  MarkerEvent& operator=(const MarkerEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// The asynchronous collectives of every NCCL communicator on one device run on the device's
// lanes: one library-created stream per kind of collective (CommLane), as FSDP2 gives the
// all-gather, the reduce-scatter and the all-reduce streams of their own, so that the next
// layer's all-gather does not queue behind a slow replica all-reduce. Two communicators' kernels
// running side by side in different orders on different ranks can hang (NCCL's guide, "Using
// multiple NCCL communicators concurrently"): lanes run side by side only where NCCL itself
// starts the device's kernels in the order they were launched (launch_order()); otherwise every
// lane is one stream, which keeps them in start order. One communicator's kernels run one after
// another whatever their streams (NCCL chains each launch after the end of the last on its device
// stream, enqueue.cc ncclLaunchPrepare/ncclLaunchFinish): lanes overlap only the kernels of
// different communicators, e.g. a shard group's all-gather and the replica all-reduce.
struct DeviceOrder {
  std::mutex mutex;
  // Created at first use and never destroyed: a work or a waiting stream may refer to them
  // until the process ends, as to ATen's pooled streams.
  std::array<std::optional<c10::cuda::CUDAStream>, detail::kCommLanes> streams;
  std::array<std::shared_ptr<MarkerEvent>, detail::kCommLanes> last_async;  // the last one's end
};

// NCCL_LAUNCH_ORDER_IMPLICIT (NCCL >= 2.26, enqueue.cc getImplicitOrder): every launch on a
// device waits until the one launched before it, of any communicator in the process, has started
// (CUDA >= 12.3's launch-completion event; older: has finished, which would serialize the lanes).
// NCCL reads it once, at the process's first launch, so the library sets it when it is loaded
// (before main for a library linked at start-up: no NCCL launch yet, and no thread of ours
// reading the environment); a library loaded later (dlopen) after NCCL's first launch needs it
// set by the user. The decision at load is what NCCL will read.
std::string launch_order_variable() {
  const char* value = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
  return value == nullptr ? std::string() : std::string(value);
}

struct LaunchOrderAtLoad {
  detail::LaunchOrder decided;
  std::string variable;  // its value once set: what NCCL reads at its first launch
};

const LaunchOrderAtLoad kLaunchOrderAtLoad = [] {
  int nccl = 0;
  if (ncclGetVersion(&nccl) != ncclSuccess) nccl = 0;
  int driver = 0;
  int runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  (void)cudaGetLastError();
  const std::string variable = launch_order_variable();
  LaunchOrderAtLoad at_load;
  at_load.decided = detail::decide_launch_order(nccl, variable.empty() ? nullptr : variable.c_str(),
                                                std::min(driver, runtime));
  // Unset or empty (which NCCL reads as 0): set, replacing the empty value.
  if (at_load.decided.set_variable) setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", /*overwrite=*/1);
  at_load.variable = launch_order_variable();
  return at_load;
}();

// The lanes' decision, checked when the first communicator is made: a variable changed since
// the library was loaded may or may not be what NCCL read, so the lanes become one stream.
const detail::LaunchOrder& launch_order() {
  static const detail::LaunchOrder order = [] {
    detail::LaunchOrder decided = kLaunchOrderAtLoad.decided;
    if (decided.separate_lanes && launch_order_variable() != kLaunchOrderAtLoad.variable) {
      decided.separate_lanes = false;
      decided.why =
          c10::str("NCCL_LAUNCH_ORDER_IMPLICIT changed from '", kLaunchOrderAtLoad.variable,
                   "' (when fsdp_muon was loaded) to '", launch_order_variable(),
                   "'; set it before the process starts, not in it");
    }
    if (!decided.separate_lanes) {
      FSDP_MUON_API_SCOPE("make_nccl_communicator");
      FSDP_MUON_WARN("the asynchronous collectives of every kind share one stream per device: ",
                     decided.why);
    }
    return decided;
  }();
  return order;
}

// set_async_collective_delay_for_testing (nccl_internal.h): 0 in every real run.
std::atomic<int64_t>& async_collective_delay() {
  static std::atomic<int64_t> cycles{0};
  return cycles;
}

DeviceOrder& device_order(int device_index) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<DeviceOrder>> orders;
  std::lock_guard<std::mutex> lock(mutex);
  auto& order = orders[device_index];
  if (!order) order = std::make_unique<DeviceOrder>();
  return *order;
}

// Where a lane's work is kept: its own slot, or slot 0 for all when the lanes are one stream.
size_t lane_slot(detail::CommLane lane) {
  return launch_order().separate_lanes ? static_cast<size_t>(lane) : 0;
}

// The stream of `lane` on the device; `order.mutex` is held by the caller. The library creates
// it (highest priority, non-blocking), so no other code can be handed it from ATen's pool and
// queue work of its own between our collectives.
c10::cuda::CUDAStream& lane_stream(DeviceOrder& order, int device_index, detail::CommLane lane) {
  std::optional<c10::cuda::CUDAStream>& stream = order.streams[lane_slot(lane)];
  if (!stream) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
    int least = 0;
    int greatest = 0;
    FSDP_MUON_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t created = nullptr;
    FSDP_MUON_CHECK_CUDA(cudaStreamCreateWithPriority(&created, cudaStreamNonBlocking, greatest));
    stream = c10::cuda::getStreamFromExternal(created, static_cast<c10::DeviceIndex>(device_index));
  }
  return *stream;
}

// An asynchronous collective on its lane: `done` marks its end there. wait()
// orders the caller's current stream, and the stream the call was made on, after it; the host
// never waits. The work holds the buffers until then, so a caller that drops its handles frees
// nothing early; and since they are released only after the calling stream waited for `done`,
// the caching allocator can hand their blocks out again on that stream at once, in stream order
// (docs/DESIGN.md §5, "Memory"). A work destroyed unwaited makes the calling stream wait first.
class NcclWork final : public CommWork {
 public:
  NcclWork(std::shared_ptr<MarkerEvent> done, int device_index, cudaStream_t calling_stream,
           std::shared_ptr<std::atomic<bool>> aborted, std::string collective,
           std::vector<at::Tensor> buffers)
      : done_(std::move(done)),
        device_index_(device_index),
        calling_stream_(calling_stream),
        aborted_(std::move(aborted)),
        collective_(std::move(collective)),
        buffers_(std::move(buffers)) {}

  ~NcclWork() override {
    if (!waited() && !buffers_.empty()) {
      // Never throws: a failure here leaves the buffers to the allocator as they are.
      (void)cudaStreamWaitEvent(calling_stream_, done_->get(), 0);
    }
  }

 protected:
  void do_wait() override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const cudaStream_t caller =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)).stream();
    // The streams that reuse the buffers are ordered after the collective first, also when the
    // communicator was aborted (an abort ends its kernels, so `done` still comes): wait() marks
    // the work waited before it runs, so the destructor will not order them again, and the
    // buffers must not reach the allocator while its lane may still write them.
    // Where CUDA refuses the wait the device is gone, and nothing will write them.
    cudaError_t ordered = cudaStreamWaitEvent(caller, done_->get(), 0);
    if (ordered == cudaSuccess && calling_stream_ != caller) {
      ordered = cudaStreamWaitEvent(calling_stream_, done_->get(), 0);
    }
    buffers_.clear();
    // An aborted communicator's collectives never completed: the receive buffer is undefined.
    TORCH_CHECK(!aborted_->load(), collective_,
                ": the nccl communicator was aborted by an error before this collective was "
                "waited for; its result is undefined");
    FSDP_MUON_CHECK_CUDA(ordered);
  }

 private:
  std::shared_ptr<MarkerEvent> done_;
  int device_index_;
  cudaStream_t calling_stream_;
  std::shared_ptr<std::atomic<bool>> aborted_;
  std::string collective_;  // "fsdp_muon::Communicator::<collective>", named in its errors
  std::vector<at::Tensor> buffers_;
};

// Two NCCL communicators per rank (docs/DESIGN.md §5). `control_` is non-blocking: set-up and
// ncclCommSplit run in NCCL's own thread while we poll, so a peer that never arrives becomes a
// timeout we can act on. `comm_` is split from it with blocking = 1 and carries every collective:
// NCCL then launches on the caller's thread (group.cc, ncclGroupEndInternal's blocking branch),
// where a non-blocking communicator would start a thread per call and return ncclInProgress.
// A blocking launch can wait on the caller's thread: for peers while NCCL connects to them (the
// first use of an algorithm or of a send/recv peer), and for the GPU when NCCL's work FIFO, its
// proxy's op slots or CUDA's launch queue are full behind kernels waiting for a peer (enqueue.cc
// waitWorkFifoAvailable, proxy.cc ncclLocalOpAppend). `watchdog_` bounds every such call.
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   int device_index, std::chrono::milliseconds timeout)
      : Communicator(rank, size), store_(store), device_index_(device_index), timeout_(timeout) {
    FSDP_MUON_CHECK(store, "store is null");
    // NCCL_COMM_BLOCKING overrides every communicator's blocking mode (init.cc,
    // envConfigOverride): it would make the set-up unbounded or the collectives non-blocking.
    const char* forced = std::getenv("NCCL_COMM_BLOCKING");
    FSDP_MUON_CHECK(
        forced == nullptr || *forced == '\0',
        "NCCL_COMM_BLOCKING=", forced == nullptr ? "" : forced,
        " is set; it overrides the blocking mode of every NCCL communicator, and fsdp_muon "
        "needs its set-up non-blocking (bounded by the timeout) and its collectives "
        "blocking (launched on your thread): unset NCCL_COMM_BLOCKING");
    int device_count = 0;
    FSDP_MUON_CHECK_CUDA(cudaGetDeviceCount(&device_count));
    FSDP_MUON_CHECK(device_index >= 0 && device_index < device_count, "device_index ", device_index,
                    " is outside the visible CUDA devices [0, ", device_count,
                    "); check LOCAL_RANK and CUDA_VISIBLE_DEVICES");
    check_nccl_version();
    launch_order();  // warns once where the lanes are one stream
    // Twice the timeout: a wait for the GPU (to_host, barrier) reaches its own timeout and
    // throws first; the watchdog is for calls that never get there.
    // The handler reads abort_cause_, written before the abort's scope begins (whose release
    // store publishes it) and destroyed after the watchdog's thread is joined (member order).
    watchdog_ = std::make_unique<detail::CallWatchdog>(
        2 * timeout_, [this, rank, size, device_index, timeout](const char* what, const char* call,
                                                                std::chrono::milliseconds elapsed) {
          detail::terminate_with(
              std::strcmp(call, kAbortCall) == 0
                  ? detail::nccl_abort_timeout_message(what, rank, size, device_index, elapsed,
                                                       2 * timeout, abort_cause_)
                  : detail::nccl_launch_timeout_message(what, call, rank, size, device_index,
                                                        elapsed, 2 * timeout));
        });

    // Rank 0 draws the id; everyone else reads it from the store (which waits for it).
    static const std::string kKey = "nccl_unique_id";
    ncclUniqueId id;
    if (rank == 0) {
      FSDP_MUON_CHECK_NCCL(ncclGetUniqueId(&id));
      const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
      store->set(kKey, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
    } else {
      store->wait({kKey}, timeout);
      const std::vector<uint8_t> bytes = store->get(kKey);
      FSDP_MUON_CHECK(bytes.size() == sizeof(id), "the NCCL unique id in the store has ",
                      bytes.size(), " bytes, expected ", sizeof(id));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }

    c10::cuda::CUDAGuard guard(device_index_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // Sharing is the parent's setting (init.cc, ncclCommInitChildComm reads the parent's
    // config.splitShare; NCCL_COMM_SPLIT_SHARE_RESOURCES overrides it): the child then uses the
    // parent's proxy thread, streams, channels and abort flag (freed by reference count), so
    // the second communicator costs no second set of buffers. NCCL forbids using parent and
    // child at the same time; control_ is idle after the split.
    config.splitShare = 1;
    // NCCL may hand out a communicator even when the call fails; fail() aborts whatever it
    // handed out, since a constructor that throws leaves no destructor to do it.
    ncclResult_t init = ncclSuccess;
    {
      const detail::CallWatchdog::Scope watched(*watchdog_, kFactoryApi, "ncclCommInitRankConfig");
      init = ncclCommInitRankConfig(&control_, size, id, rank, &config);
    }
    if (init != ncclSuccess && init != ncclInProgress) {
      fail(std::string("ncclCommInitRankConfig failed: ") + ncclGetErrorString(init) + " (" +
           ncclGetLastError(control_) + ")");
    }
    wait_until_ready(control_, "ncclCommInitRankConfig");

    // The collectives' communicator: same ranks (one color, key = rank), blocking. The split
    // runs in NCCL's thread because ncclAsyncLaunch is given the non-blocking parent (its
    // config decides ncclGroupBlocking, and ncclCommSetAsyncError reports on the parent), so the
    // wait is the parent's bounded poll; the child's own asyncResult stays ncclSuccess even when
    // the split fails (init.cc, ncclCommInitChildComm; group.cc, ncclAsyncLaunch).
    ncclConfig_t blocking = NCCL_CONFIG_INITIALIZER;
    blocking.blocking = 1;
    split_pending_ = true;
    ncclResult_t split = ncclSuccess;
    {
      const detail::CallWatchdog::Scope watched(*watchdog_, kFactoryApi, "ncclCommSplit");
      split = ncclCommSplit(control_, /*color=*/0, rank, &comm_, &blocking);
    }
    if (split != ncclSuccess && split != ncclInProgress) {
      fail(std::string("ncclCommSplit failed: ") + ncclGetErrorString(split) + " (" +
           ncclGetLastError(control_) + ")");
    }
    wait_until_ready(control_, "ncclCommSplit");
    split_pending_ = false;
    if (comm_ == nullptr) {
      fail("ncclCommSplit completed without a communicator");
    }
    check_async_error("ncclCommSplit");

    // Set up: from now on a failure of any communicator on this device aborts this one too
    // (docs/DESIGN.md §5), and one of this one aborts the others.
    domain_ = detail::FailureDomain::of("cuda:" + std::to_string(device_index_));
    domain_id_ = domain_->join(
        c10::str("the nccl communicator of rank ", rank, " of ", size, " on cuda:", device_index_),
        [this](const std::string& cause) { abort_for_domain(cause); });
  }

  ~NcclCommunicator() override {
    if (comm_ == nullptr && control_ == nullptr) {
      leave_domain();
      return;
    }
    // Destructors must not throw: a communicator that cannot finish its work is aborted.
    c10::cuda::CUDAGuard guard(device_index_);
    const bool drained_now = !failed_ && comm_ != nullptr && control_ != nullptr && drained();
    if (!drained_now && !failed_.exchange(true)) {
      // Work that never finished (a kernel waiting for a dead peer) is the device's failure: the
      // other communicators there are aborted alongside this one, whose abort may wait behind
      // their kernels (FailureDomain::fail).
      aborted_->store(true);
      abort_cause_ = c10::str(
          kDestructorApi, ": nccl on rank ", rank(), " of ", size(), " (cuda:", device_index_,
          "): destroyed with work that did not finish within ", timeout_.count(), " ms");
      const auto abort_self = [this] { abort_all(kDestructorApi); };
      if (domain_) {
        domain_->fail(domain_id_, abort_cause_, abort_self);
      } else {
        abort_self();
      }
      leave_domain();
      return;
    }
    // From here no abort of the domain's may start on this one, and one running has returned.
    leave_domain();
    if (drained_now) {
      // ncclCommFinalize on a blocking communicator synchronizes NCCL's streams on this thread
      // (init.cc, commDestroySync); drained() has bounded that wait already, and the watchdog
      // bounds the call.
      ncclResult_t child = ncclSuccess;
      {
        const detail::CallWatchdog::Scope watched(*watchdog_, kDestructorApi, "ncclCommFinalize");
        child = ncclCommFinalize(comm_);
      }
      if (child == ncclSuccess) {
        ncclResult_t parent = ncclCommFinalize(control_);
        if (parent == ncclInProgress || parent == ncclSuccess) {
          parent = poll_quietly(control_);
        }
        if (parent == ncclSuccess) {
          // Destroy runs on this thread for both (destroyFlag makes the group blocking) and
          // joins the proxy thread.
          const detail::CallWatchdog::Scope watched(*watchdog_, kDestructorApi, "ncclCommDestroy");
          warn_unless_success(ncclCommDestroy(comm_), "ncclCommDestroy (collectives)");
          warn_unless_success(ncclCommDestroy(control_), "ncclCommDestroy (set-up)");
          comm_ = control_ = nullptr;
          return;
        }
        warn_unless_success(parent, "ncclCommFinalize (set-up)");
      } else {
        warn_unless_success(child, "ncclCommFinalize (collectives)");
      }
    }
    abort_all(kDestructorApi);
  }

  c10::Device device() const override {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index_));
  }
  std::string backend_name() const override { return "nccl"; }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                       const at::Tensor& recv, const std::vector<int64_t>& recv_counts) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(*watchdog_, "fsdp_muon::Communicator::all_to_all_v",
                                              "ncclGroupEnd (ncclSend/ncclRecv)");
    const cudaStream_t stream = begin("all_to_all_v");
    enqueue_all_to_all_v(send, send_counts, recv, recv_counts, stream);
    end(stream);
  }

  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(*watchdog_, "fsdp_muon::Communicator::all_gather",
                                              "ncclAllGather");
    const cudaStream_t stream = begin("all_gather");
    enqueue_all_gather(send, recv, stream);
    end(stream);
  }

  void do_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                       const std::vector<int64_t>& recv_counts) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(*watchdog_, "fsdp_muon::Communicator::all_gather_v",
                                              "ncclGroupEnd (ncclBroadcast)");
    const cudaStream_t stream = begin("all_gather_v");
    enqueue_all_gather_v(send, recv, recv_counts, stream);
    end(stream);
  }

  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(
        *watchdog_, "fsdp_muon::Communicator::reduce_scatter_mean", "ncclReduceScatter");
    const cudaStream_t stream = begin("reduce_scatter_mean");
    enqueue_reduce_scatter_mean(send, recv, stream);
    end(stream);
  }

  std::unique_ptr<CommWork> do_all_to_all_v_async(
      const at::Tensor& send, const std::vector<int64_t>& send_counts, const at::Tensor& recv,
      const std::vector<int64_t>& recv_counts) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(*watchdog_,
                                              "fsdp_muon::Communicator::all_to_all_v_async",
                                              "ncclGroupEnd (ncclSend/ncclRecv)");
    constexpr detail::CommLane lane = detail::CommLane::kAllToAll;
    const cudaStream_t stream = begin_async("all_to_all_v", lane, {send, recv});
    guarded_enqueue(lane,
                    [&] { enqueue_all_to_all_v(send, send_counts, recv, recv_counts, stream); });
    return end_async(lane, {send, recv});
  }

  std::unique_ptr<CommWork> do_all_gather_async(const at::Tensor& send,
                                                const at::Tensor& recv) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(
        *watchdog_, "fsdp_muon::Communicator::all_gather_async", "ncclAllGather");
    constexpr detail::CommLane lane = detail::CommLane::kAllGather;
    const cudaStream_t stream = begin_async("all_gather", lane, {send, recv});
    guarded_enqueue(lane, [&] { enqueue_all_gather(send, recv, stream); });
    return end_async(lane, {send, recv});
  }

  std::unique_ptr<CommWork> do_all_gather_v_async(
      const at::Tensor& send, const at::Tensor& recv,
      const std::vector<int64_t>& recv_counts) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(
        *watchdog_, "fsdp_muon::Communicator::all_gather_v_async", "ncclGroupEnd (ncclBroadcast)");
    constexpr detail::CommLane lane = detail::CommLane::kAllGather;
    const cudaStream_t stream = begin_async("all_gather_v", lane, {send, recv});
    guarded_enqueue(lane, [&] { enqueue_all_gather_v(send, recv, recv_counts, stream); });
    return end_async(lane, {send, recv});
  }

  std::unique_ptr<CommWork> do_reduce_scatter_mean_async(const at::Tensor& send,
                                                         const at::Tensor& recv) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(
        *watchdog_, "fsdp_muon::Communicator::reduce_scatter_mean_async", "ncclReduceScatter");
    constexpr detail::CommLane lane = detail::CommLane::kReduceScatter;
    const cudaStream_t stream = begin_async("reduce_scatter_mean", lane, {send, recv});
    guarded_enqueue(lane, [&] { enqueue_reduce_scatter_mean(send, recv, stream); });
    return end_async(lane, {send, recv});
  }

  std::unique_ptr<CommWork> do_all_reduce_async(const at::Tensor& tensor, ReduceOp op) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(
        *watchdog_, "fsdp_muon::Communicator::all_reduce_async", "ncclAllReduce");
    constexpr detail::CommLane lane = detail::CommLane::kAllReduce;
    const cudaStream_t stream = begin_async("all_reduce", lane, {tensor});
    guarded_enqueue(lane, [&] {
      if (tensor.numel() == 0) return;
      finish(
          ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                        to_nccl(tensor.scalar_type()), to_nccl(op), comm_, stream),
          "ncclAllReduce");
    });
    return end_async(lane, {tensor});
  }

  // A new communicator of the members, set up like this one (bounded, non-blocking set-up, a
  // blocking child for the collectives) from a unique id under the split's own store prefix.
  // Not ncclCommSplit: this communicator's set-up communicator shares its resources with its
  // children (config.splitShare), and NCCL forbids using a parent and such a child at once,
  // while a mesh uses its world, shard and replicate communicators with collectives of each in
  // flight together (docs/DESIGN.md §5, Meshes).
  std::shared_ptr<Communicator> do_split(const std::vector<int>& members, int new_rank,
                                         const std::string& tag) override {
    check_usable("split");
    return std::make_shared<NcclCommunicator>(c10::make_intrusive<c10d::PrefixStore>(tag, store_),
                                              new_rank, static_cast<int>(members.size()),
                                              device_index_, timeout_);
  }

  void enqueue_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                            const at::Tensor& recv, const std::vector<int64_t>& recv_counts,
                            cudaStream_t stream) {
    const size_t elem = send.element_size();
    const auto* src = static_cast<const char*>(send.data_ptr());
    auto* dst = static_cast<char*>(recv.data_ptr());
    std::vector<size_t> send_offsets(size()), recv_offsets(size());
    for (int p = 1; p < size(); ++p) {
      send_offsets[p] = send_offsets[p - 1] + static_cast<size_t>(send_counts[p - 1]) * elem;
      recv_offsets[p] = recv_offsets[p - 1] + static_cast<size_t>(recv_counts[p - 1]) * elem;
    }
    // The block a rank keeps never leaves the device.
    if (send_counts[rank()] > 0) {
      FSDP_MUON_CHECK_CUDA(cudaMemcpyAsync(dst + recv_offsets[rank()], src + send_offsets[rank()],
                                           static_cast<size_t>(send_counts[rank()]) * elem,
                                           cudaMemcpyDeviceToDevice, stream));
    }
    // The sends and receives only queue; ncclGroupEnd launches them (and, the first time a peer
    // is used, connects to it).
    const ncclResult_t started = ncclGroupStart();
    if (started != ncclSuccess) {
      fail(std::string("ncclGroupStart failed: ") + ncclGetErrorString(started));
    }
    // A call that fails inside the group must still end it before anything throws: NCCL keeps
    // group state per thread, and an open group would swallow this thread's next NCCL calls.
    std::string failed_call;
    ncclResult_t failure = ncclSuccess;
    const auto ok = [&](ncclResult_t result, const char* call, int peer) {
      if (result == ncclSuccess || result == ncclInProgress) {
        return true;
      }
      failure = result;
      failed_call = std::string(call) + " with rank " + std::to_string(peer);
      return false;
    };
    for (int p = 0; p < size(); ++p) {
      if (p == rank()) {
        continue;
      }
      if (send_counts[p] > 0 &&
          !ok(ncclSend(src + send_offsets[p], static_cast<size_t>(send_counts[p]) * elem, ncclInt8,
                       p, comm_, stream),
              "ncclSend", p)) {
        break;
      }
      if (recv_counts[p] > 0 &&
          !ok(ncclRecv(dst + recv_offsets[p], static_cast<size_t>(recv_counts[p]) * elem, ncclInt8,
                       p, comm_, stream),
              "ncclRecv", p)) {
        break;
      }
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (failure != ncclSuccess) {
      // NCCL records an error inside a group and its ncclGroupEnd launches nothing of it; fail()
      // then aborts the communicator.
      fail(failed_call + " failed: " + ncclGetErrorString(failure) + " (" +
           ncclGetLastError(comm_) + ")");
    }
    finish(ended, "all_to_all_v (ncclGroupEnd)");
  }

  void enqueue_all_gather(const at::Tensor& send, const at::Tensor& recv, cudaStream_t stream) {
    if (send.numel() == 0) {
      return;  // the same on every rank; NCCL may reject the null pointers of empty tensors
    }
    finish(ncclAllGather(send.data_ptr(), recv.data_ptr(), bytes_of(send), ncclInt8, comm_, stream),
           "ncclAllGather");
  }

  // One ncclBroadcast per rank with a block, grouped into one launch: each block reaches the
  // (size - 1) other ranks once, (size - 1) * sum(recv_counts) on the wire in all, the minimum.
  // A padded ncclAllGather (every block padded to the largest, then a compaction copy) would put
  // (size - 1) * size * the largest block on the wire and need a staging buffer of size * the
  // largest: more bytes whenever the blocks are uneven, which is why this collective exists.
  // The price is one operation per non-empty block in the group. The root's own broadcast
  // copies its block into place, so nothing else runs on the stream. The ranks issue the same
  // broadcasts only when their counts agree (the caller's contract); NCCL cannot tell otherwise.
  void enqueue_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                            const std::vector<int64_t>& recv_counts, cudaStream_t stream) {
    if (recv.numel() == 0) {
      return;  // the same on every rank; NCCL may reject the null pointers of empty tensors
    }
    const size_t elem = recv.element_size();
    auto* dst = static_cast<char*>(recv.data_ptr());
    std::vector<size_t> offsets(size());
    for (int p = 1; p < size(); ++p) {
      offsets[p] = offsets[p - 1] + static_cast<size_t>(recv_counts[p - 1]) * elem;
    }
    // The broadcasts only queue; ncclGroupEnd launches them together.
    const ncclResult_t started = ncclGroupStart();
    if (started != ncclSuccess) {
      fail(std::string("ncclGroupStart failed: ") + ncclGetErrorString(started));
    }
    // A call that fails inside the group must still end it before anything throws: NCCL keeps
    // group state per thread, and an open group would swallow this thread's next NCCL calls.
    std::string failed_call;
    ncclResult_t failure = ncclSuccess;
    for (int root = 0; root < size(); ++root) {
      if (recv_counts[root] == 0) {
        continue;  // skipped on every rank alike
      }
      // Only the root's send buffer is read; the others pass their receive slot.
      const void* src = root == rank() ? send.data_ptr() : dst + offsets[root];
      const ncclResult_t result =
          ncclBroadcast(src, dst + offsets[root], static_cast<size_t>(recv_counts[root]) * elem,
                        ncclInt8, root, comm_, stream);
      if (result != ncclSuccess && result != ncclInProgress) {
        failure = result;
        failed_call = "ncclBroadcast from root " + std::to_string(root);
        break;
      }
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (failure != ncclSuccess) {
      // NCCL records an error inside a group and its ncclGroupEnd launches nothing of it; fail()
      // then aborts the communicator.
      fail(failed_call + " failed: " + ncclGetErrorString(failure) + " (" +
           ncclGetLastError(comm_) + ")");
    }
    finish(ended, "all_gather_v (ncclGroupEnd)");
  }

  void enqueue_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv,
                                   cudaStream_t stream) {
    if (recv.numel() == 0) {
      return;
    }
    const ncclDataType_t dtype = to_nccl(send.scalar_type());
    finish(ncclReduceScatter(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(recv.numel()),
                             dtype, ncclAvg, comm_, stream),
           "ncclReduceScatter");
  }

  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(*watchdog_, "fsdp_muon::Communicator::all_reduce",
                                              "ncclAllReduce");
    const cudaStream_t stream = begin("all_reduce");
    if (tensor.numel() == 0) {
      return;
    }
    const ncclDataType_t dtype = to_nccl(tensor.scalar_type());
    finish(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                         dtype, to_nccl(op), comm_, stream),
           "ncclAllReduce");
    end(stream);
  }

  void do_broadcast(const at::Tensor& tensor, int root) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const detail::CallWatchdog::Scope watched(*watchdog_, "fsdp_muon::Communicator::broadcast",
                                              "ncclBroadcast");
    const cudaStream_t stream = begin("broadcast");
    if (tensor.numel() == 0) {
      return;
    }
    finish(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), bytes_of(tensor), ncclInt8, root,
                         comm_, stream),
           "ncclBroadcast");
    end(stream);
  }

  void do_barrier() override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    cudaStream_t stream = nullptr;
    {
      const detail::CallWatchdog::Scope watched(*watchdog_, "fsdp_muon::Communicator::barrier",
                                                "ncclAllReduce");
      stream = begin("barrier");
      if (!barrier_buffer_.defined()) {
        barrier_buffer_ = at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(device()));
      }
      finish(ncclAllReduce(barrier_buffer_.data_ptr(), barrier_buffer_.data_ptr(), 1, ncclFloat32,
                           ncclSum, comm_, stream),
             "barrier (ncclAllReduce)");
      end(stream);
    }
    // The host waits too, so that a peer that never arrives becomes an error (outside the
    // watchdog: this wait has its own timeout and throws).
    wait_on_host(stream, "barrier");
  }

  at::Tensor do_to_host(const at::Tensor& tensor) override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    // Errors name the collective whose result the caller waits for: the one enqueued last.
    if (api_ == kFactoryApi) {
      api_ = "fsdp_muon::Communicator::to_host";
    }
    FSDP_MUON_CHECK(!failed_, "the nccl communicator (rank ", rank(), " of ", size(),
                    ") was aborted by an earlier error", first_failure_note());
    check_async_error("to_host");
    const cudaStream_t stream =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)).stream();
    const at::Tensor source = tensor.contiguous();
    at::Tensor host =
        at::empty(source.sizes(), source.options().device(c10::kCPU).pinned_memory(true));
    // Pinned and non-blocking: the copy is enqueued on the current stream behind the collective
    // and the host is free to poll. copy_ tells the pinned allocator about the pending copy, so
    // the block is not handed out again while an aborted stream may still write it.
    host.copy_(source, /*non_blocking=*/true);
    wait_on_host(stream, "to_host (waiting for the result on the host)");
    return host;
  }

 private:
  // Checks that earlier work has not failed; returns the caller's stream on our device. From
  // here on errors name the collective `what` (a Communicator member).
  cudaStream_t check_usable(const char* what) {
    api_ = std::string("fsdp_muon::Communicator::") + what;
    TORCH_CHECK(!failed_, api_, ": the nccl communicator (rank ", rank(), " of ", size(),
                ") was aborted by an earlier error", first_failure_note());
    check_async_error(what);
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)).stream();
  }

  // check_usable() for a synchronous collective, which runs on the caller's stream.
  cudaStream_t begin(const char* what) {
    const cudaStream_t caller = check_usable(what);
    // Collectives run in the order they were started (docs/DESIGN.md §5): a synchronous one
    // waits for the asynchronous ones started before it, this communicator's and any other's on
    // the device.
    DeviceOrder& order = device_order(device_index_);
    std::lock_guard<std::mutex> lock(order.mutex);
    for (const std::shared_ptr<MarkerEvent>& last : order.last_async) {
      if (last) FSDP_MUON_CHECK_CUDA(cudaStreamWaitEvent(caller, last->get(), 0));
    }
    return caller;
  }

  // Marks the end of the synchronous collective just enqueued on `stream`, for the destructor.
  void end(cudaStream_t stream) {
    if (!last_sync_) {
      last_sync_ = std::make_shared<MarkerEvent>();
    }
    FSDP_MUON_CHECK_CUDA(cudaEventRecord(last_sync_->get(), stream));
  }

  // check_usable() for an asynchronous collective: returns the lane's stream, made to
  // wait for everything enqueued so far on the caller's current stream (which produced the send
  // buffer and ran the synchronous collectives started earlier). The caller's stream does not
  // wait for anything: that is the overlap.
  cudaStream_t begin_async(const char* what, detail::CommLane lane,
                           std::initializer_list<at::Tensor> buffers) {
    check_usable(what);
    const c10::cuda::CUDAStream caller =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_));
    calling_stream_ = caller.stream();
    DeviceOrder& order = device_order(device_index_);
    std::lock_guard<std::mutex> lock(order.mutex);
    const c10::cuda::CUDAStream& communication = lane_stream(order, device_index_, lane);
    const MarkerEvent ready;
    FSDP_MUON_CHECK_CUDA(cudaEventRecord(ready.get(), caller.stream()));
    FSDP_MUON_CHECK_CUDA(cudaStreamWaitEvent(communication.stream(), ready.get(), 0));
    if (const int64_t cycles = async_collective_delay().load(); cycles > 0) {
      const c10::cuda::CUDAStreamGuard on_communication(communication);
      at::cuda::sleep(cycles);
    }
    // No record_stream on the lane: that would keep each block from the
    // allocator until the lane passed the point where the block was freed,
    // behind later gathers and reductions (about a group of weights and one of gradients more
    // than the library counts). The work's wait() orders the calling stream after the
    // collective before the buffers are released, so blocks allocated on the calling stream
    // are safe to reuse there in stream order. A buffer allocated on another stream is
    // recorded on the calling stream (a no-op for blocks of the calling stream itself), so the
    // allocator waits for that stream, which wait() has ordered after the collective.
    for (const at::Tensor& t : buffers) {
      if (t.defined() && t.numel() > 0) t.record_stream(caller);
    }
    return communication.stream();
  }

  // Runs an asynchronous collective's enqueue; when it throws (the communicator is then
  // aborted), the calling stream is made to wait for whatever the lane still
  // holds (a queued local copy, an aborted kernel) before the caller frees the buffers.
  template <typename Enqueue>
  void guarded_enqueue(detail::CommLane lane, const Enqueue& enqueue) {
    try {
      enqueue();
    } catch (...) {
      DeviceOrder& order = device_order(device_index_);
      std::lock_guard<std::mutex> lock(order.mutex);
      const MarkerEvent drained;
      if (cudaEventRecord(drained.get(), lane_stream(order, device_index_, lane).stream()) ==
          cudaSuccess) {
        (void)cudaStreamWaitEvent(calling_stream_, drained.get(), 0);
      }
      throw;
    }
  }

  // Marks the end of the collective just enqueued on its lane: what the next synchronous
  // collective waits for.
  std::unique_ptr<CommWork> end_async(detail::CommLane lane, std::vector<at::Tensor> buffers) {
    DeviceOrder& order = device_order(device_index_);
    std::lock_guard<std::mutex> lock(order.mutex);
    auto done = std::make_shared<MarkerEvent>();
    FSDP_MUON_CHECK_CUDA(
        cudaEventRecord(done->get(), lane_stream(order, device_index_, lane).stream()));
    order.last_async[lane_slot(lane)] = done;
    last_async_[lane_slot(lane)] = done;
    return std::make_unique<NcclWork>(std::move(done), device_index_, calling_stream_, aborted_,
                                      api_, std::move(buffers));
  }

  // A blocking communicator returns once the collective is enqueued: ncclSuccess, or an error.
  // ncclInProgress would mean it is not blocking (NCCL_COMM_BLOCKING=0 from an NCCL config file,
  // which the constructor's check of the environment cannot see): an error, not a poll.
  void finish(ncclResult_t result, const char* what) {
    if (result == ncclInProgress) {
      fail(std::string(what) +
           " returned ncclInProgress: the collectives' communicator is not "
           "blocking (NCCL_COMM_BLOCKING set in an NCCL config file, e.g. ~/.nccl.conf or "
           "/etc/nccl.conf?); remove it");
    }
    if (result != ncclSuccess) {
      fail(std::string(what) + " failed: " + ncclGetErrorString(result) + " (" +
           ncclGetLastError(comm_) + ")");
    }
  }

  // Polls a non-blocking call on `comm` (set-up, split) until it completes, bounded by the
  // timeout.
  void wait_until_ready(ncclComm_t comm, const char* what) {
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
      if (query != ncclSuccess) {
        fail(std::string(what) + ": ncclCommGetAsyncError failed: " + ncclGetErrorString(query));
      }
      if (state == ncclSuccess) {
        return;
      }
      if (state != ncclInProgress) {
        fail(std::string(what) + " failed: " + ncclGetErrorString(state) + " (" +
             ncclGetLastError(comm) + ")");
      }
      if (Clock::now() > deadline) {
        fail(std::string(what) + " did not complete within " + std::to_string(timeout_.count()) +
             " ms (a rank missing or stuck?)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // wait_until_ready() for the destructor: never throws, returns the final state (ncclInProgress
  // when the timeout passed first).
  ncclResult_t poll_quietly(ncclComm_t comm) {
    const auto deadline = Clock::now() + timeout_;
    ncclResult_t state = ncclInProgress;
    while (Clock::now() < deadline) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return ncclInternalError;
      if (state != ncclInProgress) return state;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return state;
  }

  // For the destructor: whether every collective enqueued so far has run, waiting at most the
  // timeout: the last end on each lane and the last synchronous one. Not the last alone: a call
  // that launched no kernel (empty buffers, a world of one) is tied to no earlier kernel on
  // another lane, and ncclCommFinalize would wait for a stuck one on the host.
  bool drained() {
    std::vector<cudaEvent_t> ends;
    for (const std::shared_ptr<MarkerEvent>& end : last_async_) {
      if (end) ends.push_back(end->get());
    }
    if (last_sync_) ends.push_back(last_sync_->get());
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      cudaError_t status = cudaSuccess;
      for (const cudaEvent_t end : ends) {
        status = cudaEventQuery(end);
        if (status != cudaSuccess) break;
      }
      if (status == cudaSuccess) return true;
      if (status != cudaErrorNotReady) return false;
      (void)cudaGetLastError();
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess ||
          (state != ncclSuccess && state != ncclInProgress)) {
        return false;
      }
      if (Clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // Polls until everything enqueued on `stream` so far has run; a timeout or an NCCL error aborts
  // the communicator and throws. `what` says what the host was waiting for.
  void wait_on_host(cudaStream_t stream, const std::string& what) {
    const MarkerEvent done;
    FSDP_MUON_CHECK_CUDA(cudaEventRecord(done.get(), stream));
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      const cudaError_t status = cudaEventQuery(done.get());
      if (status == cudaSuccess) {
        return;
      }
      if (status != cudaErrorNotReady) {
        fail(what + ": CUDA error " + cudaGetErrorString(status));
      }
      // "Not ready" is no error; clear it so that later CUDA checks do not report it.
      (void)cudaGetLastError();
      check_async_error(what.c_str());
      if (Clock::now() > deadline) {
        fail(what + " did not complete within " + std::to_string(timeout_.count()) +
             " ms (a rank missing or stuck?)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // The collectives' communicator reports the asynchronous errors (its proxy thread is the
  // parent's, shared under splitShare); before the split, the parent does.
  void check_async_error(const char* what) {
    const ncclComm_t comm = comm_ != nullptr ? comm_ : control_;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    if (query != ncclSuccess) {
      fail(std::string(what) + ": ncclCommGetAsyncError failed: " + ncclGetErrorString(query));
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      fail(std::string("NCCL reported an asynchronous error (seen at ") + what +
           "): " + ncclGetErrorString(state) + " (" + ncclGetLastError(comm) + ")");
    }
  }

  // Aborts both communicators, on this thread. While the split is still running in NCCL's
  // thread the parent goes first: its abort raises the child's abort flag and joins that thread
  // (init.cc, ncclCommAbort -> ncclCommEnsureReady -> ncclGroupJobAbort), after which comm_ holds
  // whatever the split produced. Otherwise the child goes first, since it is the one in use.
  // `what`: the watchdog's name for it if an abort does not return (a string literal).
  void abort_all(const char* what) {
    if (split_pending_ && control_ != nullptr) {
      abort_watched(control_, what, "ncclCommAbort (set-up)");
      control_ = nullptr;
    }
    if (comm_ != nullptr) {
      abort_watched(comm_, what, "ncclCommAbort (collectives)");
      comm_ = nullptr;
    }
    if (control_ != nullptr) {
      abort_watched(control_, what, "ncclCommAbort (set-up)");
      control_ = nullptr;
    }
  }

  // Inside a collective's own watched call (fail() from a launch), this scope replaces that
  // watch and its end clears it: the abort, and FailureDomain::fail's join after it, are then
  // bounded by this watch and by the other members' own watchdogs.
  // An abort synchronizes NCCL's internal stream (init.cc, commDestroySync), which waits on the
  // user stream, so it can hang behind a kernel of another communicator on the device that waits
  // for a dead peer: the watchdog bounds it, ending the process with the call named rather than
  // hanging (docs/DESIGN.md §5). fail() runs after the NCCL call that failed has returned, so
  // this scope never hides a call still running.
  void abort_watched(ncclComm_t comm, const char* what, const char* call) {
    std::optional<detail::CallWatchdog::Scope> watched;
    if (watchdog_) watched.emplace(*watchdog_, what, kAbortCall);
    warn_unless_success(ncclCommAbort(comm), call);
  }

  // Teardown cannot throw; what fails there is reported, with the rank and the device.
  void warn_unless_success(ncclResult_t result, const char* call) const {
    if (result != ncclSuccess) {
      FSDP_MUON_API_SCOPE("Communicator");  // teardown runs under no call of the user's
      FSDP_MUON_WARN("nccl on rank ", rank(), " of ", size(), " (cuda:", device_index_, "): ", call,
                     " returned ", ncclGetErrorString(result), " (", ncclGetLastError(nullptr),
                     ")");
    }
  }

  // Aborting frees the peers' kernels from waiting on us and makes the failure final.
  // The message is made first: should the abort itself not return, the watchdog prints it.
  [[noreturn]] void fail(const std::string& message) {
    const std::string error = c10::str(api_, ": nccl on rank ", rank(), " of ", size(),
                                       " (cuda:", device_index_, "): ", message);
    if (!failed_.exchange(true)) {
      aborted_->store(true);
      abort_cause_ = error;
      // The first failure on the device aborts every other communicator on it, each on its own
      // thread, while this one aborts here: its abort can wait behind another's stuck kernel,
      // which only that one's abort ends. A failure that comes after another's names that one.
      const auto abort_self = [this] { abort_all(kAbortApi); };
      if (domain_) {
        domain_->fail(domain_id_, error, abort_self);
      } else {
        abort_self();
      }
    }
    TORCH_CHECK(false, error, "; the communicator has been aborted", first_failure_note(error));
  }

  // Another communicator on this device failed first (FailureDomain): abort this one, on the
  // domain's thread. Its later calls fail naming that failure. The library calls a device's
  // communicators from one thread at a time, so this abort does not race a watched call of its
  // own (the watchdog watches one call at a time).
  void abort_for_domain(const std::string& cause) noexcept {
    if (failed_.exchange(true)) return;  // it failed, or is failing, by itself
    aborted_->store(true);
    if (watchdog_ && watchdog_->busy()) {
      // Another thread is inside a call of this communicator, which NCCL cannot abort under it
      // (and whose watch an abort's would overwrite): end the process, naming both.
      detail::terminate_with(c10::str(
          "fsdp_muon: nccl on rank ", rank(), " of ", size(), " (cuda:", device_index_,
          "): another communicator on the device failed (", cause,
          ") while a thread was inside a call of this one, which NCCL cannot abort under it; "
          "drive a device's communicators from one thread at a time"));
    }
    try {
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      abort_cause_ = "another communicator on cuda:" + std::to_string(device_index_) +
                     " failed first (" + cause + ")";
      abort_all(kAbortApi);
    } catch (...) {
      // Nothing to report to: the abort is best effort, the failure itself is already known.
    }
  }

  // "; the first failure on this device: ..." when one is known and is not `own` itself.
  std::string first_failure_note(const std::string& own = "") const {
    const std::optional<std::string> first = domain_ ? domain_->first_failure() : std::nullopt;
    if (!first || (!own.empty() && first->size() >= own.size() &&
                   first->compare(first->size() - own.size(), own.size(), own) == 0)) {
      return std::string();
    }
    return "; the first failure on this device: " + *first;
  }

  c10::intrusive_ptr<c10d::Store> store_;  // split() sets up its children through it
  int device_index_;
  std::chrono::milliseconds timeout_;
  ncclComm_t control_ = nullptr;  // non-blocking: set-up and the split
  ncclComm_t comm_ = nullptr;     // blocking, split from control_: the collectives
  bool split_pending_ = false;
  // Set once, by this communicator's failure or by the device's (abort_for_domain, another thread).
  std::atomic<bool> failed_{false};
  cudaStream_t calling_stream_ = nullptr;  // the current stream of the async call in progress
  at::Tensor barrier_buffer_;
  // The end of this communicator's last asynchronous collective on each lane, and of its last
  // synchronous one (an event they reuse).
  std::array<std::shared_ptr<MarkerEvent>, detail::kCommLanes> last_async_;
  std::shared_ptr<MarkerEvent> last_sync_;
  // Set by fail(), read by the works this communicator handed out.
  std::shared_ptr<std::atomic<bool>> aborted_ = std::make_shared<std::atomic<bool>>(false);
  // The public call errors are reported under: the factory until the first collective.
  std::string api_ = kFactoryApi;
  // The error an abort is for, for the watchdog's message should the abort not return.
  std::string abort_cause_;
  void leave_domain() {
    if (domain_) domain_->leave(domain_id_);
    domain_.reset();
  }

  // The device's failure domain and this communicator's place in it (joined once set up).
  std::shared_ptr<detail::FailureDomain> domain_;
  int64_t domain_id_ = -1;
  // Last, so that it is destroyed first: its thread is joined before the members its handler
  // reads (abort_cause_) go.
  std::unique_ptr<detail::CallWatchdog> watchdog_;
};

}  // namespace

namespace detail {
void set_async_collective_delay_for_testing(int64_t cycles) { async_collective_delay() = cycles; }

c10::cuda::CUDAStream nccl_lane_stream(int device_index, CommLane lane) {
  DeviceOrder& order = device_order(device_index);
  std::lock_guard<std::mutex> lock(order.mutex);
  return lane_stream(order, device_index, lane);
}

bool nccl_lanes_separate() { return launch_order().separate_lanes; }

bool nccl_launch_order_set_by_library() { return kLaunchOrderAtLoad.decided.set_variable; }

LaunchOrder decide_launch_order(int nccl_version, const char* variable, int cuda_version) {
  if (nccl_version < 22600) {
    return {false, false,
            c10::str("NCCL ", version_string(nccl_version),
                     " does not start different communicators' kernels in launch order "
                     "(NCCL_LAUNCH_ORDER_IMPLICIT needs NCCL 2.26 or newer)")};
  }
  if (cuda_version < 12030) {
    // NCCL would order launches by completion: safe, but the lanes would never overlap, and the
    // variable would serialize the process's other NCCL users too.
    return {false, false,
            c10::str("CUDA ", cuda_version / 1000, ".", cuda_version % 1000 / 10,
                     " (the older of driver and runtime) has no launch-completion events, so "
                     "NCCL_LAUNCH_ORDER_IMPLICIT would order the lanes by completion; CUDA 12.3 "
                     "or newer lets them overlap")};
  }
  if (variable == nullptr || *variable == '\0') {
    return {true, true, "fsdp_muon set NCCL_LAUNCH_ORDER_IMPLICIT=1"};
  }
  // NCCL's own reading (param.cc, ncclLoadParam): strtoll with base 0, the default 0 on error.
  errno = 0;
  const long long value = std::strtoll(variable, nullptr, 0);
  if (errno != 0 || value == 0) {
    return {false, false,
            c10::str("NCCL_LAUNCH_ORDER_IMPLICIT=", variable,
                     " is set, so NCCL starts different communicators' kernels in no fixed "
                     "order; unset it (fsdp_muon then sets it to 1) for one stream per kind of "
                     "collective")};
  }
  return {true, false, c10::str("NCCL_LAUNCH_ORDER_IMPLICIT=", variable, " is set")};
}

std::string cuda_pci_bus_id(int device) {
  char id[64] = {0};
  FSDP_MUON_CHECK_CUDA(cudaDeviceGetPCIBusId(id, sizeof(id) - 1, device));
  return id;
}
}  // namespace detail

std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::Store> store,
                                                     int rank, int size, int device_index,
                                                     std::chrono::milliseconds timeout) {
  FSDP_MUON_API_SCOPE("make_nccl_communicator");
  return std::make_shared<NcclCommunicator>(store, rank, size, device_index, timeout);
}

}  // namespace fsdp_muon
