#pragma once
// A Communicator without any transport, for single-process unit tests: by default a world of
// one, where every collective is a copy (or nothing). Given a rank and a size it plays that rank
// of a world in which every rank holds this rank's data: an all-gather (and an all_gather_v of
// equal counts) repeats the input in every block, a reduce-scatter (the mean of equal inputs)
// keeps this rank's block.

#include <c10/util/Exception.h>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon {
namespace testing {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator() : Communicator(/*rank=*/0, /*size=*/1) {}
  LocalCommunicator(int rank, int size) : Communicator(rank, size) {}
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::string backend_name() const override { return "local"; }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>&, const at::Tensor& recv,
                       const std::vector<int64_t>&) override {
    // Every rank's blocks differ in an exchange: only a world of one can play it alone.
    TORCH_CHECK(size() == 1, "LocalCommunicator: all_to_all_v needs a world of one");
    recv.copy_(send);
  }
  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override {
    for (int r = 0; r < size(); ++r) recv.narrow(0, r * send.numel(), send.numel()).copy_(send);
  }
  void do_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                       const std::vector<int64_t>& recv_counts) override {
    // Every rank holds this rank's data, so every block is this rank's size.
    for (int64_t c : recv_counts) {
      TORCH_CHECK(c == send.numel(), "LocalCommunicator: all_gather_v needs every count equal");
    }
    do_all_gather(send, recv);
  }
  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    recv.copy_(send.narrow(0, static_cast<int64_t>(rank()) * recv.numel(), recv.numel()));
  }
  void do_all_reduce(const at::Tensor&, ReduceOp) override {}
  void do_broadcast(const at::Tensor&, int) override {}
  void do_barrier() override {}
};

}  // namespace testing
}  // namespace fsdp_muon
