#pragma once
// A test-only Communicator whose ranks are threads of this process on one CUDA device
// (docs/DESIGN.md §10, Tests). Two NCCL ranks cannot share a GPU, and the GPU check machine has
// one, so without it the library's GPU code never runs at W > 1: FsdpMuon's all_to_all_v
// exchange, ZeRO-3's asynchronous gathers and reduce-scatters, HSDP's replica all-reduce and split
// meshes. Here each rank thread plays a device: its own current stream, its own lanes, so a
// stream wait the library forgets gives a wrong result, as it would across GPUs.
//
// Each collective is a host rendezvous of the world's ranks:
//   1. the rank records `ready` on the stream the collective runs on (the caller's for a
//      synchronous one, after every lane's last asynchronous one; its lane for an asynchronous
//      one, after the lane waited for the caller's stream), deposits its buffers and `ready`;
//   2. host barrier: every rank has deposited (every `ready` is recorded: a stream waiting on an
//      event not yet recorded would not wait at all);
//   3. the stream waits for every peer's `ready` and reads the peers' buffers with ATen ops into
//      a staging tensor, then records `read_done`; second host barrier;
//   4. the stream waits for every peer's `read_done` (so no rank overwrites a buffer a peer still
//      reads, in place all-reduces included); a synchronous collective then copies the staging
//      tensor into the result. An asynchronous one records `done` and defers that copy (below).
// The host waits are bounded by the timeout, and a rank whose test body ended is reported at once
// (leave_in_process_cuda_world): a rank that never arrives is an error naming it, not a hang. A
// rank that throws inside a collective fails it for its peers at once, naming itself; it first
// lets the device run every read of its buffers the peers enqueued, as its caller may free them.
// Peers' streams read a rank's buffers only before that rank's stream passes step 4, so blocks
// freed after the collective (ordered on the stream it ran on, or on the caller's stream by
// CommWork::wait()) are never reused under a peer's read, without record_stream.
//
// Deferred delivery, so that a read the library forgets to order after an asynchronous collective
// gives wrong bits every time, whatever the timing: on the caller's stream, before the lane waits
// for it, the receive buffer is poisoned (NaN for floating types, bytes 0x5A for integers; bool is
// left as it is) except where the caller's data is part of the result (all-reduce, in place; an
// all-gather whose send buffer is this rank's block of the receive buffer keeps that block; a
// receive buffer that overlaps the send buffer otherwise is left as it is); and the staged result
// reaches the receive buffer only when it is delivered, on a stream that first waits for `done`: by
// CommWork::wait() on the caller's current stream, by an unwaited work's destructor on the
// calling stream (the collective still finishes), or by the rank's next synchronous collective
// on its stream (every pending result of the rank, oldest first), whichever comes first. Before
// that the buffer holds the poison (or the caller's own data), never a stale block of the
// allocator that happens to equal the result.
//
// Results: the blocks in place, bit for bit; reduce_scatter_mean as GlooCommunicator computes it
// (per element a sum from zero in rank order in the accumulate type, float for bf16 and fp16, then
// rounded once and divided by W in the tensor's dtype); all_reduce sums in rank order in the
// tensor's dtype, which is Gloo's result where the order does not matter (W = 2, or values whose
// sums are exact): Gloo's ring does not add in rank order at W >= 3. Every rank computes the
// same sums, so every rank holds the same bits.
//
// Streams as NCCL's communicator has them (src/comm/nccl_communicator.cpp): asynchronous
// collectives run on one library-made, non-blocking stream per rank and lane (all-gather and
// all-gather-v, reduce-scatter, all-reduce, all-to-all), shared by every communicator of that rank
// (splits included), each first waiting for the caller's current stream. CommWork::wait() orders
// the caller's current stream and the calling stream after the collective's end and its delivery;
// the work holds its buffers (recorded on the calling stream) until then; destroyed unwaited, it
// delivers on the calling stream, which then waits. Synchronous collectives run on the caller's
// current stream after the last asynchronous collective of every lane of the rank.
//
// CUDA builds only (FSDP_MUON_WITH_CUDA); the test-support library compiles it there.

#include <fsdp_muon/config.h>

#if FSDP_MUON_WITH_CUDA

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon::testing {

// One communicator per rank of a new in-process world of `size` ranks on cuda:<device_index>
// (backend_name() "in_process_cuda"); hand the r-th to rank r's thread. Every host wait of a
// collective, to_host and barrier is bounded by `timeout`. split() makes child worlds of the
// members, one per split, shared by the members' threads.
std::vector<std::shared_ptr<Communicator>> make_in_process_cuda_world(
    int size, int device_index, std::chrono::milliseconds timeout);

// Rank comm.rank() of an in-process CUDA world (and of every world split from it) calls no more
// collectives: the ranks waiting for it in one fail at once, naming `why`. No-op for any other
// communicator.
void leave_in_process_cuda_world(const Communicator& comm, const std::string& why);

// Test-only, process-wide, like NCCL's detail::set_async_collective_delay_for_testing: every
// asynchronous collective started from now on first sleeps `cycles` GPU cycles
// (at::cuda::sleep) on its lane, after its wait for the caller's stream; 0 turns it off. A read
// of the result without CommWork::wait() gives wrong bits with or without it (deferred delivery,
// above). The delay is for the send side: the lane then reads the send buffers late, so a caller
// that overwrites or frees one before wait() most likely corrupts what the peers receive. That
// part is a matter of timing: the caller's write must run before the sleep ends.
// Set it on the test's thread, outside the rank threads.
void set_in_process_cuda_async_delay(int64_t cycles);

// Test-only, process-wide: the next collective that rank `root_rank` of an in-process CUDA world
// (and of the worlds split from it) joins throws on that rank once every rank has arrived, before
// it reads its peers, as an ATen error there would; -1 disarms it. What the peers then see is
// the test's. Set it on the test's thread, outside the rank threads.
void fail_next_in_process_cuda_collective(int root_rank);

// The delay for as long as it lives.
class InProcessCudaDelay {
 public:
  explicit InProcessCudaDelay(int64_t cycles) { set_in_process_cuda_async_delay(cycles); }
  ~InProcessCudaDelay() { set_in_process_cuda_async_delay(0); }
  InProcessCudaDelay(const InProcessCudaDelay&) = delete;
  InProcessCudaDelay& operator=(const InProcessCudaDelay&) = delete;
};

// Runs `body` on every rank of a new in-process CUDA world of `size` on cuda:0, as on_world_of()
// does for Gloo (tests/common/distributed_main.h: failures name "W=<size> rank <r>"); world() is
// the rank's CUDA communicator. Each rank thread gets its own current stream from the pool (a
// device's compute stream) and autograd's multithreading off: the engine runs CUDA backward
// nodes on one worker thread per device, shared by every thread of the process, where a hook of
// one rank waiting in a collective would wait for a rank queued behind it; off, each rank's
// backward runs on its own thread, on its own stream. The communicators' timeout is
// timeout_seconds(). An asynchronous collective whose work outlives the body is a failure (its
// result is delivered then). Call it on the test's thread, with a GPU (FSDP_MUON_REQUIRE_GPU
// first).
void on_cuda_world_of(int size, const std::function<void()>& body);

// Inside on_cuda_world_of's body: the rank's communicator of the in-process Gloo world of the
// same size (CPU), to compute what the CUDA world's collectives must equal, bit for bit.
Communicator& gloo_world();
std::shared_ptr<Communicator> gloo_world_ptr();

}  // namespace fsdp_muon::testing

#endif  // FSDP_MUON_WITH_CUDA
