#include <fsdp_muon/comm/gloo_communicator.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "common/check.h"

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
  FSDP_MUON_CHECK(false, "unknown ReduceOp ", static_cast<int>(op));
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout, const std::string& hostname)
      : Communicator(rank, size), store_(store), timeout_(timeout), hostname_(hostname) {
    FSDP_MUON_CHECK(store, "store is null");
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

  void do_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                       const std::vector<int64_t>& recv_counts) override {
    do_all_gather_v_async(send, recv, recv_counts)->wait();
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
      FSDP_MUON_CHECK(false, "setting up gloo for rank ", new_rank, " of ", members.size(),
                      " (rank ", rank(), " of ", size(),
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

  // c10d's ProcessGroupGloo (torch 2.11) has no uneven all-gather: allgather, _allgather_base
  // and allgather_coalesced need every rank's block of one size (Gloo's own allgatherv serves
  // only its sparse all-reduce). alltoall_base takes a count per peer, so every rank sends its
  // block to every rank: (size - 1) blocks leave it, the minimum, in one collective.
  //
  // Each message starts with the sender's recv_counts, checked at wait() against this rank's:
  // counts that differ across ranks are then an error on every rank. Without it, a rank that
  // expects a longer block than its sender sends would finish with the rest of that block
  // unwritten (Gloo completes a short receive silently). A block longer than its receiver
  // expects Gloo refuses on its own I/O thread, which ends that process ("Received data size
  // doesn't match expected size"), and its peers' collectives then fail. Both directions are
  // thus loud, without an extra round trip; the price is the header (size() int64 per message,
  // not counted in CommStats) and a copy of the blocks out of the staging buffer.
  std::unique_ptr<CommWork> do_all_gather_v_async(
      const at::Tensor& send, const at::Tensor& recv,
      const std::vector<int64_t>& recv_counts) override {
    const int world = size();
    const int64_t header = world * static_cast<int64_t>(sizeof(int64_t));
    const int64_t elem = static_cast<int64_t>(send.element_size());
    const at::TensorOptions bytes = at::TensorOptions().dtype(at::kByte);
    // One message (header, then this rank's block), repeated for every peer.
    at::Tensor message = at::empty({header + send.numel() * elem}, bytes);
    std::memcpy(message.data_ptr(), recv_counts.data(), static_cast<size_t>(header));
    if (send.numel() > 0) {
      std::memcpy(static_cast<uint8_t*>(message.data_ptr()) + header, send.data_ptr(),
                  static_cast<size_t>(send.numel() * elem));
    }
    at::Tensor in = message.repeat({world});
    std::vector<int64_t> in_counts(world, message.numel());
    std::vector<int64_t> out_counts(world);
    for (int p = 0; p < world; ++p) out_counts[p] = header + recv_counts[p] * elem;
    at::Tensor staged = at::empty({recv.numel() * elem + world * header}, bytes);
    std::vector<int64_t> counts_out = out_counts;
    auto work = pg_->alltoall_base(staged, in, counts_out, in_counts);
    return std::make_unique<GlooWork>(
        "all_gather_v", *this, std::move(work),
        [staged, recv, recv_counts, out_counts, header, elem, rank = rank(), world]() {
          // Runs at wait(), under whatever call waits: name the collective.
          FSDP_MUON_API_SCOPE("Communicator::all_gather_v");
          const auto* from = static_cast<const uint8_t*>(staged.data_ptr());
          std::vector<int64_t> theirs(world);
          for (int p = 0; p < world; ++p) {
            std::memcpy(theirs.data(), from, static_cast<size_t>(header));
            FSDP_MUON_CHECK(theirs == recv_counts,
                            "the ranks passed different "
                            "recv_counts: rank ",
                            p, " passed ", c10::IntArrayRef(theirs), " but this rank (", rank,
                            " of ", world, ") passed ", c10::IntArrayRef(recv_counts),
                            "; every rank must pass the same recv_counts (each rank's send size, "
                            "in rank order); the receive buffer is undefined");
            from += out_counts[p];
          }
          from = static_cast<const uint8_t*>(staged.data_ptr());
          auto* to = static_cast<uint8_t*>(recv.data_ptr());
          for (int p = 0; p < world; ++p) {
            const int64_t n = recv_counts[p] * elem;
            if (n > 0) std::memcpy(to, from + header, static_cast<size_t>(n));
            to += n;
            from += out_counts[p];
          }
        });
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
  FSDP_MUON_API_SCOPE("make_gloo_communicator");
  return std::make_shared<GlooCommunicator>(std::move(store), rank, size, timeout, hostname);
}

}  // namespace fsdp_muon
