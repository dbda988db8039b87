// The rendezvous store every rank of a communicator meets in (docs/DESIGN.md §5, Launch): a
// TCPStore at MASTER_ADDR:MASTER_PORT, a FileStore on one node without an address, a HashStore
// for a world of one.

#include "comm/rendezvous_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/launch_environment.h"
#include "common/check.h"

namespace fsdp_muon::detail {
namespace {

std::string sanitize(const std::string& s) {
  std::string out = s;
  for (char& c : out) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      c = '_';
    }
  }
  return out;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string file_store_path(const LaunchEnvironment& e) {
  std::string dir = "/tmp";
  if (const auto chosen = env_variable("FSDP_MUON_STORE_DIR")) {
    dir = *chosen;
    FSDP_MUON_CHECK(is_directory(dir), "FSDP_MUON_STORE_DIR=", dir, " is not a directory");
  } else if (const auto session = env_variable("OMPI_MCA_orte_jobfam_session_dir");
             session && e.launcher == "mpirun" && is_directory(*session)) {
    // mpirun removes its session directory when the job ends, even after a crash, so no stale
    // store can confuse a later job.
    dir = *session;
  }
  return dir + "/fsdp_muon-" + std::to_string(getuid()) + "-" + sanitize(e.job_id) + ".store";
}

// A TCPStore client that connects to a program which accepts but never answers waits for the
// store's handshake far beyond its own timeout. The connection is therefore made on a helper
// thread, and this rank stops waiting at the deadline; the thread is left to finish or block on
// its own (it owns everything it touches).
c10::intrusive_ptr<c10d::Store> connect_within(const std::string& host,
                                               const c10d::TCPStoreOptions& opts,
                                               std::chrono::milliseconds timeout) {
  struct Outcome {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    c10::intrusive_ptr<c10d::Store> store;
    std::exception_ptr error;
  };
  auto outcome = std::make_shared<Outcome>();
  std::thread([outcome, host, opts] {
    c10::intrusive_ptr<c10d::Store> store;
    std::exception_ptr error;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(host, opts);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(outcome->mutex);
    outcome->store = std::move(store);
    outcome->error = error;
    outcome->done = true;
    outcome->done_cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(outcome->mutex);
  TORCH_CHECK(outcome->done_cv.wait_for(lock, timeout, [&] { return outcome->done; }),
              "no rendezvous store answered (nothing accepted the connection, or a program that "
              "is not a c10d store holds the port)");
  if (outcome->error) {
    std::rethrow_exception(outcome->error);
  }
  return outcome->store;
}

c10::intrusive_ptr<c10d::Store> make_base_store(const LaunchEnvironment& e,
                                                std::chrono::milliseconds timeout) {
  if (!e.master_addr.empty()) {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(e.master_port);
    opts.isServer = !e.use_agent_store && e.rank == 0;
    opts.numWorkers = e.world_size;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    opts.multiTenant = true;
    try {
      if (opts.isServer) {
        // Binding and listening do not wait for anyone.
        return c10::make_intrusive<c10d::TCPStore>(e.master_addr, opts);
      }
      return connect_within(e.master_addr, opts, timeout);
    } catch (const std::exception& ex) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&ex);
      FSDP_MUON_CHECK(false, "could not ", opts.isServer ? "serve" : "reach",
                      " the rendezvous store at MASTER_ADDR=", e.master_addr,
                      " MASTER_PORT=", e.master_port, " within ", timeout.count() / 1000.0, " s (",
                      e.launcher, " rank ", e.rank, " of ", e.world_size,
                      "): ", c10_error ? c10_error->what_without_backtrace() : ex.what());
    }
  }
  if (e.world_size == 1) {
    return c10::make_intrusive<c10d::HashStore>();
  }
  auto store = c10::make_intrusive<c10d::FileStore>(file_store_path(e), e.world_size);
  store->setTimeout(timeout);
  return store;
}

}  // namespace

// The stores are destroyed at exit, before LibTorch's own statics.
c10::intrusive_ptr<c10d::Store> base_store(const LaunchEnvironment& e,
                                           std::chrono::milliseconds timeout) {
  static std::mutex mutex;
  static std::map<std::string, c10::intrusive_ptr<c10d::Store>> stores;
  const std::string key = e.master_addr + ":" + std::to_string(e.master_port) + "/" + e.job_id +
                          "/" + std::to_string(e.world_size) + "/" + std::to_string(e.rank);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = stores.find(key);
  if (it == stores.end()) {
    it = stores.emplace(key, make_base_store(e, timeout)).first;
  }
  return it->second;
}

std::string store_place(const LaunchEnvironment& e) {
  if (!e.master_addr.empty()) {
    return "at MASTER_ADDR=" + e.master_addr + " MASTER_PORT=" + std::to_string(e.master_port);
  }
  return e.world_size == 1 ? "in this process" : "in " + file_store_path(e);
}

}  // namespace fsdp_muon::detail
