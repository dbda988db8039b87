#include <fsdp_muon/comm/gloo_communicator.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace fsdp_muon {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  TORCH_CHECK(false, "fsdp_muon::Communicator::all_reduce: unknown ReduceOp ",
              static_cast<int>(op));
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout, const std::string& hostname)
      : Communicator(rank, size), store_(store), timeout_(timeout), hostname_(hostname) {
    TORCH_CHECK(store, "fsdp_muon::make_gloo_communicator: store is null");
    auto opts = c10d::ProcessGroupGloo::Options::create();
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (!hostname.empty()) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    opts->timeout = timeout;
    // One Gloo worker thread: collectives then run in the order they were started on every rank
    // (docs/DESIGN.md §5), and the asynchronous ones overlap the caller's compute without taking
    // more cores from its intra-op threads.
    opts->threads = 1;
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  }

  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::string backend_name() const override { return "gloo"; }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                       const at::Tensor& recv, const std::vector<int64_t>& recv_counts) override {
    do_all_to_all_v_async(send, send_counts, recv, recv_counts)->wait();
  }

  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override {
    do_all_gather_async(send, recv)->wait();
  }

  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    do_reduce_scatter_mean_async(send, recv)->wait();
  }

  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    GlooWork("all_reduce", *this, pg_->allreduce(tensors, opts)).wait();
  }

  void do_broadcast(const at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    GlooWork("broadcast", *this, pg_->broadcast(tensors, opts)).wait();
  }

  void do_barrier() override { GlooWork("barrier", *this, pg_->barrier()).wait(); }

  std::unique_ptr<CommWork> do_all_reduce_async(const at::Tensor& tensor, ReduceOp op) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    return std::make_unique<GlooWork>("all_reduce", *this, pg_->allreduce(tensors, opts));
  }

  // A new process group of the members over this one's store, under the split's own prefix:
  // only the members connect to each other, with this communicator's device choice and timeout.
  std::shared_ptr<Communicator> do_split(const std::vector<int>& members, int new_rank,
                                         const std::string& tag) override {
    try {
      return std::make_shared<GlooCommunicator>(c10::make_intrusive<c10d::PrefixStore>(tag, store_),
                                                new_rank, static_cast<int>(members.size()),
                                                timeout_, hostname_);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "fsdp_muon::Communicator::split: setting up gloo for rank ", new_rank,
                  " of ", members.size(), " (rank ", rank(), " of ", size(),
                  " here) failed (did every rank call split() alike?): ", e.what());
    }
  }

  std::unique_ptr<CommWork> do_all_to_all_v_async(
      const at::Tensor& send, const std::vector<int64_t>& send_counts, const at::Tensor& recv,
      const std::vector<int64_t>& recv_counts) override {
    // c10d takes everything by non-const reference; the handles share storage with the caller's.
    at::Tensor in = send;
    at::Tensor out = recv;
    std::vector<int64_t> in_counts = send_counts;
    std::vector<int64_t> out_counts = recv_counts;
    return std::make_unique<GlooWork>("all_to_all_v", *this,
                                      pg_->alltoall_base(out, in, out_counts, in_counts));
  }

  std::unique_ptr<CommWork> do_all_gather_async(const at::Tensor& send,
                                                const at::Tensor& recv) override {
    at::Tensor in = send;
    at::Tensor out = recv;
    return std::make_unique<GlooWork>("all_gather", *this, pg_->_allgather_base(out, in));
  }

  std::unique_ptr<CommWork> do_reduce_scatter_mean_async(const at::Tensor& send,
                                                         const at::Tensor& recv) override {
    // Gloo's own reduce-scatter all-reduces the whole buffer (twice the traffic). An all-to-all
    // that hands every rank the world's copies of its block, then a local sum at wait(), moves
    // exactly (size - 1) blocks per rank, the minimum.
    const int64_t n = recv.numel();
    const int world = size();
    at::Tensor in = send;
    at::Tensor blocks = at::empty({send.numel()}, send.options());
    std::vector<int64_t> counts(world, n);
    std::vector<int64_t> counts_out = counts;
    auto work = pg_->alltoall_base(blocks, in, counts_out, counts);
    at::Tensor out = recv;
    return std::make_unique<GlooWork>(
        "reduce_scatter_mean", *this, std::move(work), [blocks, out, world, n]() mutable {
          const int64_t rank_dim = 0;
          at::sum_out(out, blocks.view({world, n}), at::IntArrayRef(rank_dim));
          if (c10::isIntegralType(out.scalar_type(),
                                  /*includeBool=*/true)) {
            out.div_(world, "trunc");
          } else {
            out.div_(world);
          }
        });
  }

 private:
  // One c10d work. Its errors (a peer gone, a timeout) name the collective the caller called
  // (`what`, a Communicator member), the backend and the rank. `finish` runs on the caller's
  // thread once the collective has completed.
  class GlooWork final : public CommWork {
   public:
    GlooWork(const char* what, const GlooCommunicator& comm, c10::intrusive_ptr<c10d::Work> work,
             std::function<void()> finish = nullptr)
        : what_(what),
          rank_(comm.rank()),
          size_(comm.size()),
          work_(std::move(work)),
          finish_(std::move(finish)) {}

    ~GlooWork() override {
      if (waited()) return;
      // Gloo's thread still reads and writes the buffers: let it finish before they may go.
      try {
        work_->wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
      }
    }

   protected:
    void do_wait() override {
      try {
        work_->wait();
      } catch (const std::exception& e) {
        TORCH_CHECK(
            false, "fsdp_muon::Communicator::", what_, ": gloo failed on rank ", rank_, " of ",
            size_,
            " (a rank stopped, timed out, or called collectives in another order): ", e.what());
      }
      if (finish_) finish_();
    }

   private:
    const char* what_;
    int rank_;
    int size_;
    c10::intrusive_ptr<c10d::Work> work_;
    std::function<void()> finish_;
  };

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::string hostname_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

}  // namespace

std::shared_ptr<Communicator> make_gloo_communicator(c10::intrusive_ptr<c10d::Store> store,
                                                     int rank, int size,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& hostname) {
  return std::make_shared<GlooCommunicator>(std::move(store), rank, size, timeout, hostname);
}

}  // namespace fsdp_muon
