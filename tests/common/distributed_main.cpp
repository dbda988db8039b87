#include "common/distributed_main.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fsdp_muon/comm/gloo_communicator.h>

#include "comm/launch_environment.h"
#include "common/test_util.h"

namespace fsdp_muon::testing {
namespace {

// A rank that fails brings the others down within this bound, not at CTest's timeout.
constexpr int kDefaultTimeoutSeconds = 60;

std::shared_ptr<Communicator>& process_world() {
  static std::shared_ptr<Communicator> comm;
  return comm;
}

thread_local std::shared_ptr<Communicator> rank_world;

bool& in_process_flag() {
  static bool flag = false;
  return flag;
}

std::vector<int>& sizes() {
  static std::vector<int> s;
  return s;
}

// In-process worlds, made on first use and kept for the next test of the same size (as one
// launched job keeps its communicator for all its tests); a world in which a rank failed is
// dropped, since its ranks may have stopped mid-collective.
std::map<int, std::vector<std::shared_ptr<Communicator>>>& worlds() {
  static std::map<int, std::vector<std::shared_ptr<Communicator>>> w;
  return w;
}

const std::vector<std::shared_ptr<Communicator>>& world_of(int size) {
  auto it = worlds().find(size);
  if (it != worlds().end()) return it->second;
  // Gloo ranks connect to each other while they are constructed: construct them together.
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<Communicator>> comms(size);
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        comms[r] = make_gloo_communicator(store, r, size, std::chrono::seconds(timeout_seconds()),
                                          "127.0.0.1");
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK(errors[r].empty(), "in-process world of ", size, ": rank ", r,
                " failed to connect: ", errors[r]);
  }
  return worlds().emplace(size, std::move(comms)).first->second;
}

std::string rank_prefix(int size, int rank) {
  return "W=" + std::to_string(size) + " rank " + std::to_string(rank) + ": ";
}

// How a rank's body ended, for RankThreadHooks::leave: the exception, else the first failure
// gtest recorded on the rank's thread (where, too: the hook may print it long before gtest
// reports), else the skip, else kRankBodyReturned.
std::string outcome_of(const std::string& error, const ::testing::TestPartResultArray& results) {
  if (!error.empty()) return "its body threw: " + error;
  for (int i = 0; i < results.size(); ++i) {
    const ::testing::TestPartResult& part = results.GetTestPartResult(i);
    if (part.failed()) {
      return c10::str("its body failed at ", part.file_name() ? part.file_name() : "(unknown file)",
                      ":", part.line_number(), ": ", part.message());
    }
  }
  for (int i = 0; i < results.size(); ++i) {
    const ::testing::TestPartResult& part = results.GetTestPartResult(i);
    if (part.skipped()) return std::string("its body skipped: ") + part.message();
  }
  return kRankBodyReturned;
}

}  // namespace

bool run_on_rank_threads(const std::vector<std::shared_ptr<Communicator>>& given,
                         const std::function<void()>& body, const RankThreadHooks& hooks) {
  // A copy: a failure below drops the Gloo world `given` may belong to.
  const std::vector<std::shared_ptr<Communicator>> comms = given;
  const int size = static_cast<int>(comms.size());
  std::vector<::testing::TestPartResultArray> results(size);
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      rank_world = comms[r];
      failure_prefix() = rank_prefix(size, r);
      {
        // Collects this thread's results, so that a skip on one world size does not mark the
        // whole test skipped and every failure can be told by its world size and rank.
        ::testing::ScopedFakeTestPartResultReporter collect(
            ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD,
            &results[r]);
        try {
          if (hooks.enter) hooks.enter(r);
          body();
        } catch (const c10::Error& e) {
          errors[r] = e.what_without_backtrace();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        } catch (...) {
          errors[r] = "an exception that is not a std::exception";
        }
        if (hooks.leave) {
          try {
            hooks.leave(r, outcome_of(errors[r], results[r]));
          } catch (const std::exception& e) {
            if (errors[r].empty()) errors[r] = std::string("leaving the world: ") + e.what();
          }
        }
      }
      failure_prefix().clear();
      rank_world.reset();
    });
  }
  for (std::thread& t : threads) t.join();

  bool failed = false;
  int skipped_ranks = 0;
  std::string skip_reason;
  for (int r = 0; r < size; ++r) {
    bool skipped = false;
    for (int i = 0; i < results[r].size(); ++i) {
      const ::testing::TestPartResult& part = results[r].GetTestPartResult(i);
      if (part.skipped()) {
        skipped = true;
        if (skip_reason.empty()) skip_reason = part.message();
      } else if (part.failed()) {
        failed = true;
        ADD_FAILURE_AT(part.file_name() ? part.file_name() : "(unknown file)", part.line_number())
            << rank_prefix(size, r) << part.message();
      }
    }
    if (!errors[r].empty()) {
      failed = true;
      ADD_FAILURE() << rank_prefix(size, r) << "uncaught exception: " << errors[r];
    }
    skipped_ranks += skipped ? 1 : 0;
  }
  if (failed) worlds().erase(size);
  if (skipped_ranks > 0) {
    std::printf("[ SKIPPED  ] at W=%d on %d of %d ranks: %s\n", size, skipped_ranks, size,
                skip_reason.c_str());
  }
  return skipped_ranks == size;
}

namespace {

// Runs `body` on every rank of the in-process Gloo world of `size`. Returns true when every rank
// skipped.
bool run_in_process(int size, const std::function<void()>& body) {
  return run_on_rank_threads(world_of(size), body);
}

// --world-sizes=1,2,3 (removed from argv): the in-process world sizes.
std::vector<int> take_world_sizes(int& argc, char** argv) {
  std::vector<int> out;
  const std::string flag = "--world-sizes=";
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind(flag, 0) != 0) {
      argv[kept++] = argv[i];
      continue;
    }
    std::stringstream list(arg.substr(flag.size()));
    std::string item;
    while (std::getline(list, item, ',')) {
      char* end = nullptr;
      const long n = std::strtol(item.c_str(), &end, 10);
      TORCH_CHECK(!item.empty() && *end == '\0' && n >= 1 && n <= 64, "--world-sizes: '", item,
                  "' is not a world size from 1 to 64 (e.g. --world-sizes=1,2,3,4)");
      out.push_back(static_cast<int>(n));
    }
  }
  argc = kept;
  argv[argc] = nullptr;
  if (out.empty()) out = {1, 2, 3, 4};
  return out;
}

std::recursive_mutex& random_lock() {
  static std::recursive_mutex m;
  return m;
}

}  // namespace

Communicator& world() { return *world_ptr(); }

std::shared_ptr<Communicator> world_ptr() {
  if (rank_world) return rank_world;
  TORCH_CHECK(process_world(),
              "fsdp_muon::testing::world() called outside a rank: in-process, put the test "
              "body in FSDP_MUON_WORLD_TEST or on_every_world()");
  return process_world();
}

bool in_process() { return in_process_flag(); }

int timeout_seconds() {
  const char* text = std::getenv("FSDP_MUON_TEST_TIMEOUT_SECONDS");
  if (text == nullptr || *text == '\0') return kDefaultTimeoutSeconds;
  const int seconds = std::atoi(text);
  TORCH_CHECK(seconds > 0, "FSDP_MUON_TEST_TIMEOUT_SECONDS must be a positive number, got '", text,
              "'");
  return seconds;
}

const std::vector<int>& world_sizes() { return sizes(); }

const std::vector<std::shared_ptr<Communicator>>& in_process_gloo_world(int size) {
  TORCH_CHECK(in_process(), "in_process_gloo_world: this process is one rank of a launched job");
  return world_of(size);
}

void on_every_world(const std::function<void()>& body) {
  if (!in_process()) {
    body();
    return;
  }
  bool all_skipped = true;
  for (int size : sizes()) all_skipped = run_in_process(size, body) && all_skipped;
  if (all_skipped) GTEST_SKIP() << "skipped at every world size";
}

void on_world_of(int size, const std::function<void()>& body) {
  if (!in_process()) {
    if (world().size() != size) {
      GTEST_SKIP() << "runs at world size " << size << ", this job has " << world().size();
    }
    body();
    return;
  }
  if (run_in_process(size, body)) GTEST_SKIP() << "skipped at W=" << size;
}

SeededRandom::SeededRandom(uint64_t seed) : lock_(random_lock()) { at::manual_seed(seed); }

}  // namespace fsdp_muon::testing

int main(int argc, char** argv) {
  at::set_num_threads(1);
  std::vector<int> sizes;
  try {
    sizes = fsdp_muon::testing::take_world_sizes(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);

  std::string launcher;
  try {
    launcher = fsdp_muon::detail::read_launch_environment().launcher;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "reading the launcher's environment failed: %s\n",
                 e.what_without_backtrace());
    return 2;
  }
  if (launcher == "single") {
    // c10d's flight recorder is one per process, and its bookkeeping of process groups is not
    // safe when several groups record from several threads at once (a launched rank drives its
    // groups from one thread): in-process worlds crashed in its map inserts. It only records
    // for post-mortem dumps, which these tests do not take: off.
    ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);
    fsdp_muon::testing::in_process_flag() = true;
    fsdp_muon::testing::sizes() = sizes;
    std::string list;
    for (int s : sizes) list += (list.empty() ? "" : ",") + std::to_string(s);
    std::printf("in-process worlds of sizes %s, Gloo on an in-memory store\n", list.c_str());
    const int rc = RUN_ALL_TESTS();
    fsdp_muon::testing::worlds().clear();
    return rc;
  }

  try {
    fsdp_muon::InitOptions options;
    options.timeout_seconds = fsdp_muon::testing::timeout_seconds();
    // The tests build CPU tensors: on a CUDA machine "auto" would pick NCCL, which moves only
    // CUDA tensors. Ask for Gloo by name so the suites pass on GPU machines too.
    options.backend = fsdp_muon::to_string(fsdp_muon::CommBackend::kGloo);
    fsdp_muon::testing::process_world() = fsdp_muon::init_from_env(options);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "init_from_env failed: %s\n", e.what_without_backtrace());
    return 2;
  }
  auto& comm = fsdp_muon::testing::world();
  fsdp_muon::testing::sizes() = {comm.size()};
  fsdp_muon::testing::failure_prefix() = "rank " + std::to_string(comm.rank()) + ": ";
  std::printf("rank %d of %d, backend %s\n", comm.rank(), comm.size(), comm.backend_name().c_str());
  if (comm.rank() != 0) {
    GTEST_FLAG_SET(brief, true);  // rank 0 reports in full; the others only their failures
  }
  const int result = RUN_ALL_TESTS();
  int rc = result;
  try {
    comm.barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "final barrier failed: %s\n", e.what());
    rc = 3;
  }
  fsdp_muon::testing::process_world().reset();
  return rc;
}
