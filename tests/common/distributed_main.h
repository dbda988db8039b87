#pragma once
// The world of a distributed test, in one of two modes (docs/DESIGN.md §10, Tests):
//
//   launched   a launcher (torchrun, mpirun, srun) started this process as one rank; world() is
//              the process's communicator from init_from_env(), and every test body runs once.
//   in-process no launcher: this process plays every rank of worlds of the sizes given by
//              --world-sizes=1,2,3,4 (default 1,2,3,4), each rank a thread with its own Gloo
//              communicator on one in-memory store. Every FSDP_MUON_WORLD_TEST body runs once per
//              world size, on all of that world's ranks at once; world() is the calling rank's
//              communicator. Failures name the world size and rank.
//
// Link the test-support library (fsdp_muon_distributed_main) into the executable; it supplies
// main().

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon::testing {

// The calling rank's communicator (in-process: the rank thread's; launched: the process's).
Communicator& world();
std::shared_ptr<Communicator> world_ptr();

// Whether this process plays every rank (no launcher started it).
bool in_process();

// The communicators' timeout: FSDP_MUON_TEST_TIMEOUT_SECONDS, 60 by default. A test that makes a
// rank miss a collective on purpose runs in a CTest entry of its own with a short one.
int timeout_seconds();

// The world sizes this run covers: --world-sizes in-process, the launcher's one size otherwise.
const std::vector<int>& world_sizes();

// Runs `body` on every rank of every world size this run covers (launched: once, here).
// In-process, a failure, skip or exception on a rank is reported on the calling thread,
// prefixed with "W=<size> rank <r>: "; the test is skipped only when every world size skipped.
void on_every_world(const std::function<void()>& body);

// Runs `body` on every rank of an in-process world of `size` (reported as on_every_world does).
// Launched, `size` must be the launcher's world size, and `body` runs once, here.
void on_world_of(int size, const std::function<void()>& body);

// ---- for harnesses of other in-process worlds (tests/common/in_process_cuda_communicator.h) ----

// The in-process Gloo world of `size` that on_world_of() runs (made on first use, kept until a
// rank of it fails): rank r's communicator is the r-th. Call it on the test's thread.
const std::vector<std::shared_ptr<Communicator>>& in_process_gloo_world(int size);

// RankThreadHooks::leave's outcome when the body returned with no failure and no skip.
inline constexpr const char* kRankBodyReturned = "its body returned";

// What a harness adds around each rank's body; either may be empty.
struct RankThreadHooks {
  // First, on rank r's thread (its CUDA stream, say).
  std::function<void(int rank)> enter;
  // Last, on rank r's thread once its body has ended, however it ended: `outcome` says how
  // (kRankBodyReturned, or "its body threw: ...", "its body failed at file:line: ...", "its body
  // skipped: ..."), so that the harness can tell the ranks that still wait for r in a collective
  // that it will not come, rather than let them wait out the timeout.
  std::function<void(int rank, const std::string& outcome)> leave;
};

// Runs `body` on one thread per communicator of `comms`, rank r's with comms[r] as its world(),
// and reports every rank's failures, skips and exceptions on the calling thread as on_world_of()
// does ("W=<size> rank <r>: "). After a failure the in-process Gloo world of that size is
// dropped too (a body may have used it, and its ranks may have stopped mid-collective). Returns
// whether every rank skipped.
bool run_on_rank_threads(const std::vector<std::shared_ptr<Communicator>>& comms,
                         const std::function<void()>& body, const RankThreadHooks& hooks = {});

// Random numbers that are the same on every rank: the global CPU generator, seeded with `seed`
// and held by this scope alone (in-process, rank threads share that generator, so each rank's
// draw happens under a process-wide lock). Draw everything inside the scope and run no
// collective in it: another rank may be waiting for the lock.
class SeededRandom {
 public:
  explicit SeededRandom(uint64_t seed);
  SeededRandom(const SeededRandom&) = delete;
  SeededRandom& operator=(const SeededRandom&) = delete;

 private:
  std::unique_lock<std::recursive_mutex> lock_;
};

}  // namespace fsdp_muon::testing

// A test of every world size: TEST whose body on_every_world() runs (GTEST_SKIP, ASSERT_* and
// EXPECT_* work in it as in a TEST body, per rank).
#define FSDP_MUON_WORLD_TEST(suite, name)                                                          \
  static void FsdpMuonWorldBody_##suite##_##name();                                                \
  TEST(suite, name) { ::fsdp_muon::testing::on_every_world(&FsdpMuonWorldBody_##suite##_##name); } \
  static void FsdpMuonWorldBody_##suite##_##name()
