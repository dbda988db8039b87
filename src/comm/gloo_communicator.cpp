#include <fsdp_muon/comm/gloo_communicator.h>

#include <cstdlib>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/util/Exception.h>
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
      : Communicator(rank, size) {
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
    // One Gloo worker thread: every call waits for its work, so more would only compete with
    // the intra-op threads for cores.
    opts->threads = 1;
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  }

  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::string backend_name() const override { return "gloo"; }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                       const at::Tensor& recv, const std::vector<int64_t>& recv_counts) override {
    // c10d takes everything by non-const reference; the handles share storage with the caller's.
    at::Tensor in = send;
    at::Tensor out = recv;
    std::vector<int64_t> in_counts = send_counts;
    std::vector<int64_t> out_counts = recv_counts;
    wait("all_to_all_v", [&] { return pg_->alltoall_base(out, in, out_counts, in_counts); });
  }

  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override {
    at::Tensor in = send;
    at::Tensor out = recv;
    wait("all_gather", [&] { return pg_->_allgather_base(out, in); });
  }

  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    // Gloo's own reduce-scatter all-reduces the whole buffer (twice the traffic). An all-to-all
    // that hands every rank the world's copies of its block, then a local sum, moves exactly
    // (size - 1) blocks per rank, the minimum.
    const int64_t n = recv.numel();
    at::Tensor in = send;
    at::Tensor blocks = at::empty({send.numel()}, send.options());
    std::vector<int64_t> counts(size(), n);
    std::vector<int64_t> counts_out = counts;
    wait("reduce_scatter_mean", [&] { return pg_->alltoall_base(blocks, in, counts_out, counts); });
    at::Tensor out = recv;
    const int64_t rank_dim = 0;
    at::sum_out(out, blocks.view({size(), n}), at::IntArrayRef(rank_dim));
    if (c10::isIntegralType(out.scalar_type(), /*includeBool=*/true)) {
      out.div_(size(), "trunc");
    } else {
      out.div_(size());
    }
  }

  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    wait("all_reduce", [&] { return pg_->allreduce(tensors, opts); });
  }

  void do_broadcast(const at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    wait("broadcast", [&] { return pg_->broadcast(tensors, opts); });
  }

  void do_barrier() override {
    wait("barrier", [&] { return pg_->barrier(); });
  }

 private:
  // Runs one c10d call to completion; its errors (a peer gone, a timeout) name the collective
  // the caller called (`what`, a Communicator member), the backend and the rank.
  template <typename Start>
  void wait(const char* what, Start&& start) {
    try {
      start()->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(
          false, "fsdp_muon::Communicator::", what, ": gloo failed on rank ", rank(), " of ",
          size(),
          " (a rank stopped, timed out, or called collectives in another order): ", e.what());
    }
  }

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
