#include <fsdp_muon/comm/communicator.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <tuple>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "comm/single_rank_communicator.h"
#include "common/check.h"

namespace fsdp_muon {
namespace {

// Errors name the collective the caller called (its ApiScope), e.g.
// "fsdp_muon::Communicator::all_gather: ...".
void check_flat(const at::Tensor& t, const char* what, const c10::Device& device) {
  FSDP_MUON_CHECK(t.defined(), what, " is undefined");
  FSDP_MUON_CHECK(t.dim() == 1 && t.is_contiguous(), what,
                  " must be a flat contiguous 1-D tensor, got shape ", t.sizes());
  FSDP_MUON_CHECK(t.device() == device, what, " is on ", t.device(),
                  " but the communicator moves tensors on ", device);
}

// `what` names the argument the counts are.
void check_counts(const std::vector<int64_t>& counts, int size, int64_t numel, const char* what) {
  FSDP_MUON_CHECK(static_cast<int>(counts.size()) == size, what, " has ", counts.size(),
                  " entries; it needs one per rank (", size, ")");
  for (size_t r = 0; r < counts.size(); ++r) {
    FSDP_MUON_CHECK(counts[r] >= 0, "negative count in ", what, " (entry ", r, " is ", counts[r],
                    "); counts are elements, zero or more");
  }
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  FSDP_MUON_CHECK(total == numel, what, " sum to ", total, " elements but the buffer holds ",
                  numel);
}

}  // namespace

Communicator::Communicator(int rank, int size) : rank_(rank), size_(size) {
  FSDP_MUON_API_SCOPE("Communicator");
  FSDP_MUON_CHECK(size >= 1, "world size must be at least 1, got ", size);
  FSDP_MUON_CHECK(rank >= 0 && rank < size, "rank ", rank, " is outside [0, ", size, ")");
}

Communicator::~Communicator() = default;

namespace {

// A work whose collective completed when it was started.
class FinishedWork final : public CommWork {
 protected:
  void do_wait() override {}
};

}  // namespace

CommWork::~CommWork() = default;

void CommWork::wait() {
  if (waited_) return;
  // Marked first: a failed wait must not be retried against a backend that has given up.
  waited_ = true;
  do_wait();
}

void Communicator::check_all_to_all_v(const at::Tensor& send,
                                      const std::vector<int64_t>& send_counts,
                                      const at::Tensor& recv,
                                      const std::vector<int64_t>& recv_counts) {
  check_flat(send, "send buffer", device());
  check_flat(recv, "receive buffer", device());
  FSDP_MUON_CHECK(send.scalar_type() == recv.scalar_type(), "send and receive dtypes differ (",
                  send.scalar_type(), " vs ", recv.scalar_type(), ")");
  check_counts(send_counts, size_, send.numel(), "send_counts");
  check_counts(recv_counts, size_, recv.numel(), "recv_counts");
  FSDP_MUON_CHECK(send_counts[rank_] == recv_counts[rank_], "this rank sends itself ",
                  send_counts[rank_], " elements but expects ", recv_counts[rank_]);
  const int64_t sent = send.numel() - send_counts[rank_];
  stats_.all_to_all_v_bytes += sent * static_cast<int64_t>(send.element_size());
  ++stats_.calls;
}

void Communicator::check_all_gather(const at::Tensor& send, const at::Tensor& recv) {
  check_flat(send, "send buffer", device());
  check_flat(recv, "receive buffer", device());
  FSDP_MUON_CHECK(send.scalar_type() == recv.scalar_type(), "dtypes differ");
  FSDP_MUON_CHECK(recv.numel() == send.numel() * size_, "receive buffer holds ", recv.numel(),
                  " elements, needs world size x send = ", send.numel() * size_);
  stats_.all_gather_bytes += (size_ - 1) * send.numel() * static_cast<int64_t>(send.element_size());
  ++stats_.calls;
}

void Communicator::check_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                                      const std::vector<int64_t>& recv_counts) {
  check_flat(send, "send buffer", device());
  check_flat(recv, "receive buffer", device());
  FSDP_MUON_CHECK(send.scalar_type() == recv.scalar_type(), "send and receive dtypes differ (",
                  send.scalar_type(), " vs ", recv.scalar_type(), ")");
  check_counts(recv_counts, size_, recv.numel(), "recv_counts");
  FSDP_MUON_CHECK(send.numel() == recv_counts[rank_], "the send buffer holds ", send.numel(),
                  " elements but recv_counts[", rank_, "] (this rank's block) is ",
                  recv_counts[rank_],
                  "; recv_counts must hold every rank's send size, this rank's at index rank()");
  // Each block is written by its own copy (NCCL: a broadcast per block in one group), so a send
  // buffer inside recv must be exactly this rank's block, or another block's copy overwrites
  // what this one's still reads.
  const int64_t element = static_cast<int64_t>(send.element_size());
  const int64_t own = std::accumulate(recv_counts.begin(), recv_counts.begin() + rank_, int64_t{0});
  const auto* s = static_cast<const char*>(send.data_ptr());
  const auto* r = static_cast<const char*>(recv.data_ptr());
  const bool overlaps =
      send.numel() > 0 && s < r + recv.numel() * element && r < s + send.numel() * element;
  FSDP_MUON_CHECK(!overlaps || s == r + own * element,
                  "the send buffer overlaps the receive buffer other than as this rank's block "
                  "(elements [",
                  own, ", ", own + send.numel(),
                  ") of it); pass a separate send buffer, or exactly that slice of recv");
  stats_.all_gather_v_bytes +=
      (size_ - 1) * send.numel() * static_cast<int64_t>(send.element_size());
  ++stats_.calls;
}

void Communicator::check_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) {
  check_flat(send, "send buffer", device());
  check_flat(recv, "receive buffer", device());
  FSDP_MUON_CHECK(send.scalar_type() == recv.scalar_type(), "dtypes differ");
  FSDP_MUON_CHECK(send.numel() == recv.numel() * size_, "send buffer ", "holds ", send.numel(),
                  " elements, needs world size x receive = ", recv.numel() * size_);
  stats_.reduce_scatter_bytes +=
      (size_ - 1) * recv.numel() * static_cast<int64_t>(recv.element_size());
  ++stats_.calls;
}

void Communicator::all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                                const at::Tensor& recv, const std::vector<int64_t>& recv_counts) {
  FSDP_MUON_API_SCOPE("Communicator::all_to_all_v");
  check_all_to_all_v(send, send_counts, recv, recv_counts);
  do_all_to_all_v(send, send_counts, recv, recv_counts);
}

void Communicator::all_gather(const at::Tensor& send, const at::Tensor& recv) {
  FSDP_MUON_API_SCOPE("Communicator::all_gather");
  check_all_gather(send, recv);
  do_all_gather(send, recv);
}

void Communicator::all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                                const std::vector<int64_t>& recv_counts) {
  FSDP_MUON_API_SCOPE("Communicator::all_gather_v");
  check_all_gather_v(send, recv, recv_counts);
  do_all_gather_v(send, recv, recv_counts);
}

void Communicator::reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) {
  FSDP_MUON_API_SCOPE("Communicator::reduce_scatter_mean");
  check_reduce_scatter_mean(send, recv);
  do_reduce_scatter_mean(send, recv);
}

std::unique_ptr<CommWork> Communicator::all_to_all_v_async(
    const at::Tensor& send, const std::vector<int64_t>& send_counts, const at::Tensor& recv,
    const std::vector<int64_t>& recv_counts) {
  FSDP_MUON_API_SCOPE("Communicator::all_to_all_v");
  check_all_to_all_v(send, send_counts, recv, recv_counts);
  return do_all_to_all_v_async(send, send_counts, recv, recv_counts);
}

std::unique_ptr<CommWork> Communicator::all_gather_async(const at::Tensor& send,
                                                         const at::Tensor& recv) {
  FSDP_MUON_API_SCOPE("Communicator::all_gather");
  check_all_gather(send, recv);
  return do_all_gather_async(send, recv);
}

std::unique_ptr<CommWork> Communicator::all_gather_v_async(
    const at::Tensor& send, const at::Tensor& recv, const std::vector<int64_t>& recv_counts) {
  FSDP_MUON_API_SCOPE("Communicator::all_gather_v");
  check_all_gather_v(send, recv, recv_counts);
  return do_all_gather_v_async(send, recv, recv_counts);
}

std::unique_ptr<CommWork> Communicator::reduce_scatter_mean_async(const at::Tensor& send,
                                                                  const at::Tensor& recv) {
  FSDP_MUON_API_SCOPE("Communicator::reduce_scatter_mean");
  check_reduce_scatter_mean(send, recv);
  return do_reduce_scatter_mean_async(send, recv);
}

std::unique_ptr<CommWork> Communicator::do_all_to_all_v_async(
    const at::Tensor& send, const std::vector<int64_t>& send_counts, const at::Tensor& recv,
    const std::vector<int64_t>& recv_counts) {
  do_all_to_all_v(send, send_counts, recv, recv_counts);
  return std::make_unique<FinishedWork>();
}

std::unique_ptr<CommWork> Communicator::do_all_gather_async(const at::Tensor& send,
                                                            const at::Tensor& recv) {
  do_all_gather(send, recv);
  return std::make_unique<FinishedWork>();
}

std::unique_ptr<CommWork> Communicator::do_all_gather_v_async(
    const at::Tensor& send, const at::Tensor& recv, const std::vector<int64_t>& recv_counts) {
  do_all_gather_v(send, recv, recv_counts);
  return std::make_unique<FinishedWork>();
}

std::unique_ptr<CommWork> Communicator::do_reduce_scatter_mean_async(const at::Tensor& send,
                                                                     const at::Tensor& recv) {
  do_reduce_scatter_mean(send, recv);
  return std::make_unique<FinishedWork>();
}

void Communicator::check_all_reduce(const at::Tensor& tensor) {
  check_flat(tensor, "tensor", device());
  stats_.all_reduce_bytes +=
      2 * (size_ - 1) * tensor.numel() * static_cast<int64_t>(tensor.element_size()) / size_;
  ++stats_.calls;
}

void Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  FSDP_MUON_API_SCOPE("Communicator::all_reduce");
  check_all_reduce(tensor);
  do_all_reduce(tensor, op);
}

std::unique_ptr<CommWork> Communicator::all_reduce_async(const at::Tensor& tensor, ReduceOp op) {
  FSDP_MUON_API_SCOPE("Communicator::all_reduce");
  check_all_reduce(tensor);
  return do_all_reduce_async(tensor, op);
}

std::unique_ptr<CommWork> Communicator::do_all_reduce_async(const at::Tensor& tensor, ReduceOp op) {
  do_all_reduce(tensor, op);
  return std::make_unique<FinishedWork>();
}

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  FSDP_MUON_API_SCOPE("Communicator::split");
  // Every rank learns every rank's (color, key), so each can check them all and derive its
  // group alone: a bad color is the same error everywhere instead of a hang in the set-up.
  at::Tensor mine = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  mine.data_ptr<int64_t>()[0] = color;
  mine.data_ptr<int64_t>()[1] = key;
  mine = to_device(mine);
  const at::Tensor all = at::empty({2 * static_cast<int64_t>(size_)}, mine.options());
  all_gather(mine, all);
  const at::Tensor host = to_host(all).contiguous();
  const int64_t* entries = host.data_ptr<int64_t>();
  for (int r = 0; r < size_; ++r) {
    FSDP_MUON_CHECK(entries[2 * r] >= 0, "rank ", r, " of ", size_, " passed color ",
                    entries[2 * r],
                    "; colors must be >= 0 (every rank passes one, the same for "
                    "the ranks that form one communicator)");
  }
  std::vector<std::tuple<int64_t, int>> group;  // (key, rank) of the ranks with this color
  for (int r = 0; r < size_; ++r) {
    if (entries[2 * r] == color) group.emplace_back(entries[2 * r + 1], r);
  }
  std::sort(group.begin(), group.end());
  std::vector<int> members;
  int new_rank = 0;
  for (const auto& [k, r] : group) {
    if (r == rank_) new_rank = static_cast<int>(members.size());
    members.push_back(r);
  }
  const std::string tag = "split_" + std::to_string(splits_++) + "/color_" + std::to_string(color);
  if (members.size() == 1) {
    return detail::make_single_rank_communicator(device(), backend_name());
  }
  return do_split(members, new_rank, tag);
}

std::shared_ptr<Communicator> Communicator::do_split(const std::vector<int>&, int,
                                                     const std::string&) {
  FSDP_MUON_CHECK(false, "the ", backend_name(), " communicator cannot be split");
}

void Communicator::broadcast(const at::Tensor& tensor, int root) {
  FSDP_MUON_API_SCOPE("Communicator::broadcast");
  check_flat(tensor, "tensor", device());
  FSDP_MUON_CHECK(root >= 0 && root < size_, "root ", root, " is outside [0, ", size_, ")");
  if (rank_ == root) {
    stats_.broadcast_bytes +=
        (size_ - 1) * tensor.numel() * static_cast<int64_t>(tensor.element_size());
  }
  ++stats_.calls;
  do_broadcast(tensor, root);
}

void Communicator::barrier() {
  FSDP_MUON_API_SCOPE("Communicator::barrier");
  ++stats_.calls;
  do_barrier();
}

at::Tensor Communicator::to_host(const at::Tensor& tensor) {
  FSDP_MUON_API_SCOPE("Communicator::to_host");
  FSDP_MUON_CHECK(tensor.defined(), "tensor is undefined");
  if (tensor.is_cpu()) return tensor;
  FSDP_MUON_CHECK(tensor.device() == device(), "tensor is on ", tensor.device(),
                  " but the communicator moves tensors on ", device());
  return do_to_host(tensor);
}

at::Tensor Communicator::do_to_host(const at::Tensor& tensor) { return tensor.cpu(); }

at::Tensor Communicator::to_device(const at::Tensor& host) const {
  FSDP_MUON_API_SCOPE("Communicator::to_device");
  FSDP_MUON_CHECK(host.defined() && host.is_cpu(),
                  "expects a "
                  "defined CPU tensor, got ",
                  host.defined() ? host.device().str() : "undefined");
  if (device().is_cpu()) return host;
  // The caching host allocator keeps the pinned block until the copy, recorded on the stream,
  // has run, so the temporary may go out of scope at once.
  return host.contiguous().pin_memory().to(device(), /*non_blocking=*/true);
}

}  // namespace fsdp_muon
