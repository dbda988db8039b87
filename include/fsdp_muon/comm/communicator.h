#pragma once
// The handful of collectives fsdp_muon needs (docs/DESIGN.md §5). Every call takes flat 1-D
// contiguous tensors on the communicator's device; on CUDA each is enqueued on the caller's current
// stream, on CPU it has completed when the call returns. The *_async calls start the same
// collectives without waiting and return a CommWork to wait on, so communication can overlap
// compute. Every call counts the bytes this rank sends to other ranks, so tests and benchmarks can
// compare traffic with the minimum.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <fsdp_muon/config.h>

namespace fsdp_muon {

enum class ReduceOp { kSum, kMax, kMin };

// Bytes this rank sent to other ranks, per kind of collective, since the last reset.
struct FSDP_MUON_API CommStats {
  int64_t all_to_all_v_bytes = 0;
  int64_t all_gather_bytes = 0;
  int64_t all_gather_v_bytes = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t all_reduce_bytes = 0;
  int64_t broadcast_bytes = 0;
  int64_t calls = 0;
  int64_t total_bytes() const {
    return all_to_all_v_bytes + all_gather_bytes + all_gather_v_bytes + reduce_scatter_bytes +
           all_reduce_bytes + broadcast_bytes;
  }
};

// A collective started by one of Communicator's *_async calls. Until wait() returns, the send
// buffer must not be written and the receive buffer neither read nor written; the work keeps both
// alive. wait() is what makes the result visible: on the CPU it blocks until the collective has
// completed (bounded by the communicator's timeout; a failure throws, naming the collective); on
// CUDA it makes the caller's current stream wait for the collective (the host does not wait). A
// second wait() does nothing, also after a wait() that threw. A work destroyed without wait()
// lets its collective finish: the Gloo work waits for it (swallowing errors), the NCCL work leaves
// it running and makes the calling stream wait for it before its buffers go, so an exception
// between start and wait() neither corrupts memory nor leaves the collective half-issued.
class FSDP_MUON_API CommWork {
 public:
  virtual ~CommWork();
  CommWork(const CommWork&) = delete;
  CommWork& operator=(const CommWork&) = delete;
  void wait();
  bool waited() const { return waited_; }

 protected:
  CommWork() = default;
  virtual void do_wait() = 0;

 private:
  bool waited_ = false;
};

class FSDP_MUON_API Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Device of the tensors this communicator moves (CPU for Gloo, cuda:<local rank> for NCCL).
  virtual c10::Device device() const = 0;
  virtual std::string backend_name() const = 0;

  // send holds sum(send_counts) elements, the block for peer p at offset sum(send_counts[:p]);
  // recv receives sum(recv_counts) elements likewise. Counts are in elements, one per rank,
  // zero allowed. Bytes counted: everything sent except the block to this rank itself.
  void all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                    const at::Tensor& recv, const std::vector<int64_t>& recv_counts);
  // recv.numel() == size() * send.numel(); rank r's block lands at offset r * send.numel().
  // Bytes counted: (size() - 1) * send bytes.
  void all_gather(const at::Tensor& send, const at::Tensor& recv);
  // The all-gather of blocks of different sizes: recv_counts holds every rank's send.numel()
  // (elements, in rank order, zero allowed), the same vector on every rank, and
  // recv.numel() == sum(recv_counts); rank r's block lands at offset sum(recv_counts[:r]).
  // No rank can check alone that the others passed the same counts. On Gloo, counts that differ
  // are an error: where a block is longer than a receiver expects, Gloo's own check ends that
  // process; any other difference throws at wait() on every rank. On NCCL they are undefined (a
  // hang or a wrong result), as mismatched all_to_all_v counts are. Bytes counted:
  // (size() - 1) * send bytes.
  void all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                    const std::vector<int64_t>& recv_counts);
  // send.numel() == size() * recv.numel(); recv = mean over ranks of their block for this
  // rank. Bytes counted: (size() - 1) * recv bytes.
  void reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv);
  // In place. Bytes counted: 2 * (size() - 1) / size() * bytes (the ring minimum).
  void all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // In place from root. Bytes counted on the root: (size() - 1) * bytes.
  void broadcast(const at::Tensor& tensor, int root = 0);
  void barrier();

  // ---- asynchronous collectives ----
  // The same collectives, checked and counted the same way, with the same results bit for bit,
  // started without waiting. Every rank must start the same collectives in the same order,
  // synchronous ones included (waiting may be in any order). On the CPU (Gloo) they run on the
  // backend's own thread while the caller computes; on CUDA (NCCL) on a library stream per kind
  // of collective (docs/DESIGN.md §5), which first waits for everything already enqueued on the
  // caller's current stream (so the send buffer may be produced there). Kinds may run side by
  // side: a collective that reads another's result, or writes a buffer another still uses, is
  // started after that one's wait(). The work holds the buffers until then.
  std::unique_ptr<CommWork> all_to_all_v_async(const at::Tensor& send,
                                               const std::vector<int64_t>& send_counts,
                                               const at::Tensor& recv,
                                               const std::vector<int64_t>& recv_counts);
  std::unique_ptr<CommWork> all_gather_async(const at::Tensor& send, const at::Tensor& recv);
  std::unique_ptr<CommWork> all_gather_v_async(const at::Tensor& send, const at::Tensor& recv,
                                               const std::vector<int64_t>& recv_counts);
  std::unique_ptr<CommWork> reduce_scatter_mean_async(const at::Tensor& send,
                                                      const at::Tensor& recv);
  std::unique_ptr<CommWork> all_reduce_async(const at::Tensor& tensor,
                                             ReduceOp op = ReduceOp::kSum);

  // ---- sub-communicators (docs/DESIGN.md §5, Meshes) ----
  // Collective over this communicator: the ranks that pass the same `color` (>= 0) form a new
  // communicator, ranked by `key` (ties by their rank here). It has this one's backend, device
  // and timeout, and its own CommStats; its errors say which communicator failed the same way.
  // A color that only one rank passes gives that rank a communicator of one, which moves
  // nothing (its collectives are local copies). A negative color on any rank is an error on
  // every rank. Every rank must call it equally often and in the same order as its collectives.
  // Gloo and NCCL make the new communicator from this one's store under a prefix unique to the
  // split (see DESIGN for why NCCL does not use ncclCommSplit).
  std::shared_ptr<Communicator> split(int color, int key);

  // `tensor` on the host, for library code that reads a collective's result (docs/DESIGN.md §5).
  // A CPU tensor comes back as it is: a CPU collective has completed when it returns. A tensor on
  // the communicator's CUDA device is copied to pinned host memory behind everything enqueued on
  // the current stream, and the host waits for it at most the communicator's timeout: a peer that
  // never arrives, or an asynchronous NCCL error, aborts the communicator and throws, naming the
  // collective enqueued last, this rank, the world size and the timeout. Not a collective: no
  // peer takes part, and nothing is counted.
  at::Tensor to_host(const at::Tensor& tensor);
  // `host` (a small CPU tensor: flags, counts, a hash) on the communicator's device, for library
  // code that feeds it to a collective, without a host wait (docs/DESIGN.md §5): on CUDA through
  // pinned memory with a non-blocking copy, ordered on the current stream. A pageable copy
  // (tensor.to(device)) would synchronize that stream, waiting for everything enqueued on it —
  // a collective stuck on a dead peer included — with no bound. On the CPU, `host` itself; a
  // `host` already pinned is copied from directly, so leave it unchanged until the copy has run.
  at::Tensor to_device(const at::Tensor& host) const;

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }

 protected:
  Communicator(int rank, int size);

  virtual void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                               const at::Tensor& recv, const std::vector<int64_t>& recv_counts) = 0;
  virtual void do_all_gather(const at::Tensor& send, const at::Tensor& recv) = 0;
  virtual void do_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                               const std::vector<int64_t>& recv_counts) = 0;
  virtual void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) = 0;
  virtual void do_all_reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  virtual void do_broadcast(const at::Tensor& tensor, int root) = 0;
  virtual void do_barrier() = 0;
  // A tensor on device(), which is not the CPU. This default copies with tensor.cpu(), which is
  // right only where a collective has completed when it returns.
  virtual at::Tensor do_to_host(const at::Tensor& tensor);
  // Asynchronous counterparts; the defaults run the synchronous call and return a finished work,
  // which is right for a backend whose collectives complete on return and have no thread.
  virtual std::unique_ptr<CommWork> do_all_to_all_v_async(const at::Tensor& send,
                                                          const std::vector<int64_t>& send_counts,
                                                          const at::Tensor& recv,
                                                          const std::vector<int64_t>& recv_counts);
  virtual std::unique_ptr<CommWork> do_all_gather_async(const at::Tensor& send,
                                                        const at::Tensor& recv);
  virtual std::unique_ptr<CommWork> do_all_gather_v_async(const at::Tensor& send,
                                                          const at::Tensor& recv,
                                                          const std::vector<int64_t>& recv_counts);
  virtual std::unique_ptr<CommWork> do_reduce_scatter_mean_async(const at::Tensor& send,
                                                                 const at::Tensor& recv);
  virtual std::unique_ptr<CommWork> do_all_reduce_async(const at::Tensor& tensor, ReduceOp op);
  // This rank's communicator of `members` (ranks here, in the new rank order; more than one),
  // where it is `new_rank`. `tag` is unique to this split and color among this communicator's
  // splits, the same on every member: a store prefix. The default: the backend cannot split.
  virtual std::shared_ptr<Communicator> do_split(const std::vector<int>& members, int new_rank,
                                                 const std::string& tag);

 private:
  // Validate the buffers and count the bytes, for the call and its *_async twin alike.
  void check_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>& send_counts,
                          const at::Tensor& recv, const std::vector<int64_t>& recv_counts);
  void check_all_gather(const at::Tensor& send, const at::Tensor& recv);
  void check_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                          const std::vector<int64_t>& recv_counts);
  void check_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv);
  void check_all_reduce(const at::Tensor& tensor);

  int rank_;
  int size_;
  CommStats stats_;
  int64_t splits_ = 0;  // split() calls so far: numbers each split's store prefix
};

// The transports init_from_env() can set up. kAuto: NCCL when CUDA is available, else Gloo.
enum class CommBackend { kAuto, kNccl, kGloo };

// "auto", "nccl", "gloo": the names InitOptions::backend and FSDP_MUON_BACKEND accept.
FSDP_MUON_API const char* to_string(CommBackend backend);

// The backend of that name (as to_string spells it); nullopt for any other string.
FSDP_MUON_API std::optional<CommBackend> parse_comm_backend(std::string_view name);

struct FSDP_MUON_API InitOptions {
  // A CommBackend by name (to_string(CommBackend::kGloo) or "gloo"): "auto" (NCCL when CUDA is
  // available, else Gloo), "nccl" or "gloo". With "auto", the environment variable
  // FSDP_MUON_BACKEND, when set, chooses instead. init_from_env() parses it once and rejects any
  // other name.
  std::string backend = "auto";
  // Bounds every blocking step of init_from_env() (reaching or serving the rendezvous store,
  // waiting for the other ranks, setting up the backend) and every collective of the
  // communicator it returns. The environment variable FSDP_MUON_TIMEOUT (seconds, a positive
  // number such as 30 or 2.5), when set, replaces this value; init_from_env() rejects any other
  // value of it, and a timeout that is not positive and finite.
  double timeout_seconds = 300.0;
};

// Creates the communicator for this process from the launcher environment. Rendezvous through
// MASTER_ADDR/MASTER_PORT (TCPStore), or a FileStore when a single-node launcher gives no
// address (in FSDP_MUON_STORE_DIR, else Open MPI's session directory, else /tmp). NCCL on
// cuda:<local rank> when CUDA is available, Gloo otherwise. With NCCL it also makes
// cuda:<local rank> this process's current CUDA device, so tensors created with kCUDA land on the
// rank's own GPU; in a world of more than one rank NCCL then needs the local rank from the
// launcher (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID or MPI_LOCALRANKID) and is an
// error without it, rather than every rank sharing device 0. Rank 0 records its job (the
// launcher's job id and its world size) in the store and every other rank checks it before it
// joins, so ranks of two jobs on one MASTER_PORT, or ranks that disagree on the world size,
// refuse each other with an error on each side. Every call makes a new communicator (its own
// store prefix), so all ranks must call it equally often.
FSDP_MUON_API std::shared_ptr<Communicator> init_from_env(const InitOptions& options = {});

}  // namespace fsdp_muon
