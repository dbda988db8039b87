#include <fsdp_muon/comm/communicator.h>

#include <numeric>

#include <c10/util/Exception.h>

namespace fsdp_muon {
namespace {

void check_flat(const at::Tensor& t, const char* what, const c10::Device& device) {
  TORCH_CHECK(t.defined(), "fsdp_muon collective: ", what, " is undefined");
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "fsdp_muon collective: ", what,
              " must be a flat contiguous 1-D tensor, got shape ", t.sizes());
  TORCH_CHECK(t.device() == device, "fsdp_muon collective: ", what, " is on ", t.device(),
              " but the communicator moves tensors on ", device);
}

void check_counts(const std::vector<int64_t>& counts, int size, int64_t numel, const char* what) {
  TORCH_CHECK(static_cast<int>(counts.size()) == size, "fsdp_muon all_to_all_v: ", what, " has ",
              counts.size(), " entries; it needs one per rank (", size, ")");
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "fsdp_muon all_to_all_v: negative count in ", what);
  }
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  TORCH_CHECK(total == numel, "fsdp_muon all_to_all_v: ", what, " sum to ", total,
              " elements but the buffer holds ", numel);
}

}  // namespace

Communicator::Communicator(int rank, int size) : rank_(rank), size_(size) {
  TORCH_CHECK(size >= 1, "Communicator: world size must be at least 1, got ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "Communicator: rank ", rank, " is outside [0, ", size, ")");
}

Communicator::~Communicator() = default;

void Communicator::all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                                const at::Tensor& recv, const std::vector<int64_t>& recv_counts) {
  check_flat(send, "send buffer", device());
  check_flat(recv, "receive buffer", device());
  TORCH_CHECK(send.scalar_type() == recv.scalar_type(),
              "fsdp_muon all_to_all_v: send and receive dtypes differ (", send.scalar_type(),
              " vs ", recv.scalar_type(), ")");
  check_counts(send_counts, size_, send.numel(), "send_counts");
  check_counts(recv_counts, size_, recv.numel(), "recv_counts");
  TORCH_CHECK(send_counts[rank_] == recv_counts[rank_],
              "fsdp_muon all_to_all_v: this rank sends itself ", send_counts[rank_],
              " elements but expects ", recv_counts[rank_]);
  const int64_t sent = send.numel() - send_counts[rank_];
  stats_.all_to_all_v_bytes += sent * static_cast<int64_t>(send.element_size());
  ++stats_.calls;
  do_all_to_all_v(send, send_counts, recv, recv_counts);
}

void Communicator::all_gather(const at::Tensor& send, const at::Tensor& recv) {
  check_flat(send, "send buffer", device());
  check_flat(recv, "receive buffer", device());
  TORCH_CHECK(send.scalar_type() == recv.scalar_type(), "fsdp_muon all_gather: dtypes differ");
  TORCH_CHECK(recv.numel() == send.numel() * size_, "fsdp_muon all_gather: receive buffer holds ",
              recv.numel(), " elements, needs world size x send = ", send.numel() * size_);
  stats_.all_gather_bytes += (size_ - 1) * send.numel() * static_cast<int64_t>(send.element_size());
  ++stats_.calls;
  do_all_gather(send, recv);
}

void Communicator::reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) {
  check_flat(send, "send buffer", device());
  check_flat(recv, "receive buffer", device());
  TORCH_CHECK(send.scalar_type() == recv.scalar_type(),
              "fsdp_muon reduce_scatter_mean: dtypes differ");
  TORCH_CHECK(send.numel() == recv.numel() * size_, "fsdp_muon reduce_scatter_mean: send buffer ",
              "holds ", send.numel(),
              " elements, needs world size x receive = ", recv.numel() * size_);
  stats_.reduce_scatter_bytes +=
      (size_ - 1) * recv.numel() * static_cast<int64_t>(recv.element_size());
  ++stats_.calls;
  do_reduce_scatter_mean(send, recv);
}

void Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_flat(tensor, "tensor", device());
  stats_.all_reduce_bytes +=
      2 * (size_ - 1) * tensor.numel() * static_cast<int64_t>(tensor.element_size()) / size_;
  ++stats_.calls;
  do_all_reduce(tensor, op);
}

void Communicator::broadcast(const at::Tensor& tensor, int root) {
  check_flat(tensor, "tensor", device());
  TORCH_CHECK(root >= 0 && root < size_, "fsdp_muon broadcast: root ", root, " is outside [0, ",
              size_, ")");
  if (rank_ == root) {
    stats_.broadcast_bytes +=
        (size_ - 1) * tensor.numel() * static_cast<int64_t>(tensor.element_size());
  }
  ++stats_.calls;
  do_broadcast(tensor, root);
}

void Communicator::barrier() {
  ++stats_.calls;
  do_barrier();
}

}  // namespace fsdp_muon
