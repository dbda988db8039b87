#include "comm/single_rank_communicator.h"

#include <utility>

namespace fsdp_muon::detail {
namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  SingleRankCommunicator(c10::Device device, std::string backend_name)
      : Communicator(0, 1), device_(device), backend_name_(std::move(backend_name)) {}

  c10::Device device() const override { return device_; }
  std::string backend_name() const override { return backend_name_; }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>&, const at::Tensor& recv,
                       const std::vector<int64_t>&) override {
    copy(send, recv);
  }
  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override { copy(send, recv); }
  void do_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                       const std::vector<int64_t>&) override {
    copy(send, recv);  // recv_counts == {send.numel()}
  }
  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    copy(send, recv);  // the mean of one block is the block
  }
  void do_all_reduce(const at::Tensor&, ReduceOp) override {}
  void do_broadcast(const at::Tensor&, int) override {}
  void do_barrier() override {}

 private:
  static void copy(const at::Tensor& send, const at::Tensor& recv) {
    if (send.numel() > 0 && !send.is_same(recv)) recv.copy_(send);
  }

  c10::Device device_;
  std::string backend_name_;
};

}  // namespace

std::shared_ptr<Communicator> make_single_rank_communicator(c10::Device device,
                                                            const std::string& backend_name) {
  return std::make_shared<SingleRankCommunicator>(device, backend_name);
}

}  // namespace fsdp_muon::detail
