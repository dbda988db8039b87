#pragma once
// A world-size-1 Communicator without any transport, for single-process unit tests of the
// sharded group: every collective on one rank is a copy (or nothing).

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon {
namespace testing {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator() : Communicator(/*rank=*/0, /*size=*/1) {}
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::string backend_name() const override { return "local"; }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>&, const at::Tensor& recv,
                       const std::vector<int64_t>&) override {
    recv.copy_(send);
  }
  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override { recv.copy_(send); }
  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    recv.copy_(send);
  }
  void do_all_reduce(const at::Tensor&, ReduceOp) override {}
  void do_broadcast(const at::Tensor&, int) override {}
  void do_barrier() override {}
};

}  // namespace testing
}  // namespace fsdp_muon
