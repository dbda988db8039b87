// Launcher bootstrap: who am I (rank, world size, local rank), where do we meet (a c10d Store),
// and which communicator (NCCL or Gloo). Every inconsistency is reported here, naming the
// variable, rather than surfacing later as a hang.

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/gloo_communicator.h>
#include <fsdp_muon/comm/nccl_communicator.h>
#include <fsdp_muon/config.h>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/cuda.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace fsdp_muon {
namespace {

// An empty variable counts as unset (`export RANK=` is how shells clear one).
std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    return std::nullopt;
  }
  return std::string(value);
}

// Errors name the public call that read the environment: `api` is "fsdp_muon::init_from_env" or
// "fsdp_muon::read_launch_environment".
int parse_int(const char* api, const char* name, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const long parsed = std::strtol(value.c_str(), &end, 10);
  TORCH_CHECK(end != value.c_str() && *end == '\0' && errno == 0 && parsed >= INT_MIN &&
                  parsed <= INT_MAX && !std::isspace(static_cast<unsigned char>(value[0])),
              api, ": ", name, "='", value, "' is not an integer");
  return static_cast<int>(parsed);
}

// What one launcher's variables say about this process.
struct Reading {
  const char* launcher = "";
  const char* rank_var = "";
  const char* size_var = "";
  const char* local_var = "";
  int rank = 0;
  int size = 1;
  std::optional<int> local_rank;
};

// nullopt when the launcher's variables are absent. `rank_marks_presence`: only the rank
// variable shows the launcher started us (Slurm sets SLURM_NTASKS in a plain allocation too).
std::optional<Reading> read_launcher(const char* api, const char* launcher, const char* rank_var,
                                     const char* size_var, const char* local_var,
                                     bool rank_marks_presence) {
  const auto rank = env(rank_var);
  const auto size = env(size_var);
  if (!rank && (rank_marks_presence || !size)) {
    return std::nullopt;
  }
  TORCH_CHECK(rank, api, ": ", size_var, " is set but ", rank_var, " is not; a ", launcher,
              " launch sets both");
  TORCH_CHECK(size, api, ": ", rank_var, " is set but ", size_var, " is not; a ", launcher,
              " launch sets both");
  Reading r;
  r.launcher = launcher;
  r.rank_var = rank_var;
  r.size_var = size_var;
  r.local_var = local_var;
  r.size = parse_int(api, size_var, *size);
  r.rank = parse_int(api, rank_var, *rank);
  TORCH_CHECK(r.size >= 1, api, ": ", size_var, "=", r.size, " must be at least 1");
  TORCH_CHECK(r.rank >= 0 && r.rank < r.size, api, ": ", rank_var, "=", r.rank,
              " is outside the world of ", size_var, "=", r.size, " ranks [0, ", r.size, ")");
  if (const auto local = env(local_var)) {
    r.local_rank = parse_int(api, local_var, *local);
    TORCH_CHECK(*r.local_rank >= 0 && *r.local_rank < r.size, api, ": ", local_var, "=",
                *r.local_rank, " is outside [0, ", size_var, "=", r.size, ")");
  }
  return r;
}

void check_agree(const char* api, const Reading& a, const Reading& b) {
  const char* fix = "; unset the variables of the launcher that did not start this process";
  TORCH_CHECK(a.size == b.size, api, ": contradictory world sizes: ", a.size_var, "=", a.size, " (",
              a.launcher, ") but ", b.size_var, "=", b.size, " (", b.launcher, ")", fix);
  TORCH_CHECK(a.rank == b.rank, api, ": contradictory ranks: ", a.rank_var, "=", a.rank, " (",
              a.launcher, ") but ", b.rank_var, "=", b.rank, " (", b.launcher, ")", fix);
  if (a.local_rank && b.local_rank) {
    TORCH_CHECK(*a.local_rank == *b.local_rank, api, ": contradictory local ranks: ", a.local_var,
                "=", *a.local_rank, " (", a.launcher, ") but ", b.local_var, "=", *b.local_rank,
                " (", b.launcher, ")", fix);
  }
}

// The parent's pid and start time: the same for every rank a launcher forks on this node, and
// never reused by a later job (a pid alone may be).
std::string parent_process_key() {
  const pid_t parent = getppid();
  std::string start = "0";
  std::ifstream stat("/proc/" + std::to_string(parent) + "/stat");
  std::string line;
  if (std::getline(stat, line)) {
    const auto paren = line.rfind(')');
    if (paren != std::string::npos) {
      std::istringstream fields(line.substr(paren + 2));
      std::string field;
      // Field 22 (starttime); fields 3.. follow the command name.
      for (int i = 3; i <= 22 && (fields >> field); ++i) {
        if (i == 22) {
          start = field;
        }
      }
    }
  }
  return "ppid" + std::to_string(parent) + "-" + start;
}

// The job id the launcher gives its ranks (the same on every rank of one job, different for
// another job), or nullopt when it gives none.
std::optional<std::string> launcher_job_id(const std::string& launcher) {
  std::optional<std::string> id;
  if (launcher == "torchrun") {
    id = env("TORCHELASTIC_RUN_ID");
  } else if (launcher == "mpirun") {
    id = env("OMPI_MCA_ess_base_jobid");
    if (!id) {
      id = env("PMIX_NAMESPACE");
    }
  } else if (launcher == "srun") {
    if ((id = env("SLURM_JOB_ID"))) {
      if (const auto step = env("SLURM_STEP_ID")) {
        *id += "." + *step;
      }
    }
  } else if (launcher == "pmi") {
    id = env("PMIX_NAMESPACE");
  }
  return id;
}

std::string job_id_for(const std::string& launcher) {
  const auto id = launcher_job_id(launcher);
  return launcher + "-" + (id ? *id : parent_process_key());
}

// With no address the rendezvous is a file every rank can see, which only works on one node.
void check_single_node(const char* api, const LaunchEnvironment& e) {
  auto spans_nodes = [&](const char* local_size_var) {
    const auto local_size = env(local_size_var);
    return local_size && parse_int(api, local_size_var, *local_size) != e.world_size;
  };
  const char* fix =
      " but MASTER_ADDR is not set; export MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free "
      "port> to every rank";
  if (e.launcher == "torchrun") {
    TORCH_CHECK(false, api, ": RANK/WORLD_SIZE describe a world of ", e.world_size, " ranks", fix,
                " (torchrun sets them itself)");
  } else if (e.launcher == "mpirun") {
    TORCH_CHECK(!spans_nodes("OMPI_COMM_WORLD_LOCAL_SIZE"), api, ": this mpirun job ",
                "spans several nodes (OMPI_COMM_WORLD_LOCAL_SIZE differs from ",
                "OMPI_COMM_WORLD_SIZE)", fix, " (mpirun -x MASTER_ADDR -x MASTER_PORT)");
  } else if (e.launcher == "srun") {
    const char* nodes_var = env("SLURM_STEP_NUM_NODES") ? "SLURM_STEP_NUM_NODES" : "SLURM_NNODES";
    const auto nodes = env(nodes_var);
    TORCH_CHECK(!nodes || parse_int(api, nodes_var, *nodes) <= 1, api, ": this srun step ",
                "spans ", nodes_var, "=", nodes.value_or("?"), " nodes", fix);
  } else if (e.launcher == "pmi") {
    TORCH_CHECK(!spans_nodes("MPI_LOCALNRANKS"), api, ": this PMI job spans several ",
                "nodes (MPI_LOCALNRANKS differs from PMI_SIZE)", fix);
  }
}

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
  if (const auto chosen = env("FSDP_MUON_STORE_DIR")) {
    dir = *chosen;
    TORCH_CHECK(is_directory(dir), "fsdp_muon::init_from_env: FSDP_MUON_STORE_DIR=", dir,
                " is not a directory");
  } else if (const auto session = env("OMPI_MCA_orte_jobfam_session_dir");
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
      TORCH_CHECK(false, "fsdp_muon::init_from_env: could not ", opts.isServer ? "serve" : "reach",
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

// One base store per process and rendezvous (a TCPStore server must outlive every client, and
// a FileStore deletes its file once world-size instances are gone). Destroyed at exit, before
// LibTorch's own statics.
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

// ---- job identity (docs/DESIGN.md §5, Launch) ----
// Two jobs pointed at one MASTER_PORT would otherwise merge: a rank of one joins the other's
// store and both train on garbage. Rank 0 writes a record of its job; every other rank compares
// it with its own view before claiming its rank, and reports a mismatch back, so both sides stop
// with an error instead of merging or hanging.

// The variable that holds the world size for this launcher, for messages.
const char* world_size_variable(const std::string& launcher) {
  if (launcher == "mpirun") return "OMPI_COMM_WORLD_SIZE";
  if (launcher == "srun") return "SLURM_NTASKS";
  if (launcher == "pmi") return "PMI_SIZE";
  return "WORLD_SIZE";
}

std::string host_name() {
  char name[256] = {};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? std::string(name) : std::string("?");
}

// What a rank says about itself: the same fields for rank 0's record and for a refusal.
struct JobRecord {
  std::string token;   // random per process: tells this process's writes from anyone else's
  int world_size = 0;  // this rank's view of the world size
  std::string job;     // "<launcher>-<launcher's job id>", or "" when the launcher gives none
  std::string who;     // "<launcher> rank R on host H (pid P)"
  std::string reason;  // in a refusal: why this rank refused the job

  std::string encode() const {
    return token + "\n" + std::to_string(world_size) + "\n" + job + "\n" + who + "\n" + reason;
  }
  static JobRecord decode(const std::vector<uint8_t>& bytes) {
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    JobRecord r;
    std::string size;
    std::getline(in, r.token);
    std::getline(in, size);
    std::getline(in, r.job);
    std::getline(in, r.who);
    std::getline(in, r.reason);
    r.world_size = std::atoi(size.c_str());
    return r;
  }
  std::string describe(const std::string& launcher) const {
    return who + ", " + world_size_variable(launcher) + "=" + std::to_string(world_size) + ", " +
           (job.empty() ? std::string("no launcher job id") : "job '" + job + "'");
  }
};

JobRecord own_record(const LaunchEnvironment& e) {
  std::random_device device;
  std::ostringstream token;
  token << std::hex << device() << device() << device() << device();
  JobRecord r;
  r.token = token.str();
  r.world_size = e.world_size;
  if (const auto id = launcher_job_id(e.launcher)) r.job = e.launcher + "-" + *id;
  r.who = e.launcher + " rank " + std::to_string(e.rank) + " on host " + host_name() + " (pid " +
          std::to_string(::getpid()) + ")";
  return r;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

std::string store_place(const LaunchEnvironment& e) {
  if (!e.master_addr.empty()) {
    return "at MASTER_ADDR=" + e.master_addr + " MASTER_PORT=" + std::to_string(e.master_port);
  }
  return e.world_size == 1 ? "in this process" : "in " + file_store_path(e);
}

// Every rank calls this once per communicator, before the backend's own rendezvous. `waiting`
// starts the message of a timeout, which means some rank never came.
void agree_on_job(c10d::Store& store, const LaunchEnvironment& e, std::chrono::milliseconds timeout,
                  const std::string& waiting) {
  const std::string api = "fsdp_muon::init_from_env: ";
  const JobRecord mine = own_record(e);
  const std::string place = store_place(e);
  const std::string fix =
      "; give every job its own MASTER_PORT (and every rank the same "
      "launcher variables)";
  if (e.rank == 0) {
    const std::string record = mine.encode();
    const auto held = store.compareSet("job", {}, bytes_of(record));
    if (held != bytes_of(record)) {
      const JobRecord other = JobRecord::decode(held);
      store.set("verdict",
                bytes_of("another rank 0 (" + mine.describe(e.launcher) + ") uses this store too"));
      TORCH_CHECK(false, api, "the rendezvous store ", place,
                  " already belongs to another job: ", "its rank 0 is ", other.describe(e.launcher),
                  "; this rank is ", mine.describe(e.launcher), fix);
    }
    std::vector<std::string> joined;
    for (int r = 1; r < e.world_size; ++r) joined.push_back("joined/" + std::to_string(r));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (store.check({"refused/1"})) {
        const JobRecord other = JobRecord::decode(store.get("refused/1"));
        const std::string error = "a process reached this job's rendezvous store " + place +
                                  " and refused to join: " + other.describe(e.launcher) +
                                  " (it said: " + other.reason + "); this job's rank 0 is " +
                                  mine.describe(e.launcher);
        store.set("verdict", bytes_of(error));
        TORCH_CHECK(false, api, error, fix);
      }
      if (joined.empty() || store.check(joined)) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string missing;
        for (int r = 1; r < e.world_size; ++r) {
          if (!store.check({joined[r - 1]})) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          }
        }
        TORCH_CHECK(false, waiting, "rank(s) ", missing, " did not reach the rendezvous store ",
                    place, " within ", timeout.count() / 1000.0, " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    store.set("verdict", bytes_of("ok"));
    return;
  }

  std::vector<uint8_t> held;
  try {
    held = store.get("job");
  } catch (const c10::Error& ex) {
    TORCH_CHECK(false, waiting, "rank 0 did not describe its job in the rendezvous store ", place,
                " within ", timeout.count() / 1000.0, " s: ", ex.what_without_backtrace());
  }
  const JobRecord zero = JobRecord::decode(held);
  std::string error;
  if (!zero.job.empty() && !mine.job.empty() && zero.job != mine.job) {
    error = "the rendezvous store " + place + " belongs to another job: its rank 0 is " +
            zero.describe(e.launcher) + "; this rank is " + mine.describe(e.launcher);
  } else if (zero.world_size != e.world_size) {
    error = std::string("the ranks disagree on the world size: this rank has ") +
            world_size_variable(e.launcher) + "=" + std::to_string(e.world_size) +
            " but rank 0 has " + world_size_variable(e.launcher) + "=" +
            std::to_string(zero.world_size) + " (this rank is " + mine.describe(e.launcher) +
            "; rank 0 is " + zero.describe(e.launcher) + ")";
  } else {
    const std::string key = "joined/" + std::to_string(e.rank);
    const auto claimed = store.compareSet(key, {}, bytes_of(mine.encode()));
    if (claimed != bytes_of(mine.encode())) {
      error = "rank " + std::to_string(e.rank) + " of this job has already joined the " +
              "rendezvous store " + place + " (as " + JobRecord::decode(claimed).who +
              "): two processes have the same rank, or a rank of another job shares the port";
    }
  }
  if (!error.empty()) {
    // Rank 0 learns of the first refusal and reports it too.
    JobRecord refusal = mine;
    refusal.reason = error;
    const int64_t n = store.add("refusals", 1);
    store.set("refused/" + std::to_string(n), bytes_of(refusal.encode()));
    TORCH_CHECK(false, api, error, fix);
  }
  std::vector<uint8_t> verdict;
  try {
    verdict = store.get("verdict");
  } catch (const c10::Error& ex) {
    TORCH_CHECK(false, waiting, "rank 0 did not confirm the job in the rendezvous store ", place,
                " within ", timeout.count() / 1000.0, " s: ", ex.what_without_backtrace());
  }
  const std::string text(verdict.begin(), verdict.end());
  TORCH_CHECK(text == "ok", api, "rank 0 refused the job: ", text);
}

struct BackendName {
  CommBackend backend;
  const char* name;
};

// Every CommBackend and its name, in enumerator order.
constexpr BackendName kBackendNames[] = {
    {CommBackend::kAuto, "auto"},
    {CommBackend::kNccl, "nccl"},
    {CommBackend::kGloo, "gloo"},
};

// "auto, nccl, gloo", for error messages.
std::string backend_names() {
  std::string names;
  for (const auto& entry : kBackendNames) {
    names += (names.empty() ? "" : ", ") + std::string(entry.name);
  }
  return names;
}

// NCCL drives cuda:<local rank>. Without the local rank every rank of a node would share device
// 0 (and NCCL fails, or worse, runs slowly); checked before CUDA itself so the launch mistake is
// reported as such on any machine.
void check_local_rank_for_nccl(const LaunchEnvironment& e, const std::string& why) {
  TORCH_CHECK(e.world_size == 1 || !e.local_rank_variable.empty(),
              "fsdp_muon::init_from_env: NCCL (", why, ") in a world of ", e.world_size,
              " ranks needs this rank's local rank to choose its GPU, but none of LOCAL_RANK, ",
              "OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID is set (", e.launcher,
              " rank ", e.rank, "); export LOCAL_RANK=<index of this process on its node>, or ",
              "start the job with torchrun, mpirun or srun, which set it");
}

// The backend to set up: never kAuto.
CommBackend choose_backend(const InitOptions& options, const LaunchEnvironment& e) {
  std::string name = options.backend;
  const char* source = "InitOptions::backend";
  if (name == to_string(CommBackend::kAuto)) {
    if (const auto chosen = env("FSDP_MUON_BACKEND")) {
      name = *chosen;
      source = "FSDP_MUON_BACKEND";
    }
  }
  const std::optional<CommBackend> parsed = parse_comm_backend(name);
  TORCH_CHECK(parsed, "fsdp_muon::init_from_env: ", source, "='", name, "' is not one of ",
              backend_names());
  const bool cuda = FSDP_MUON_WITH_CUDA && torch::cuda::is_available();
  CommBackend backend = *parsed;
  if (backend == CommBackend::kAuto) {
    backend = cuda ? CommBackend::kNccl : CommBackend::kGloo;
    if (backend == CommBackend::kNccl) {
      check_local_rank_for_nccl(e, "chosen by backend auto: CUDA is available");
    }
  } else if (backend == CommBackend::kNccl) {
    check_local_rank_for_nccl(e, std::string("asked for by ") + source);
  }
  switch (backend) {
    case CommBackend::kNccl:
      TORCH_CHECK(FSDP_MUON_WITH_CUDA, "fsdp_muon::init_from_env: ", source,
                  " asks for NCCL but this build of fsdp_muon has no CUDA (LibTorch without CUDA)");
      TORCH_CHECK(cuda, "fsdp_muon::init_from_env: ", source,
                  " asks for NCCL but no CUDA device is available to this process");
      break;
    case CommBackend::kGloo:
      TORCH_CHECK(FSDP_MUON_WITH_GLOO, "fsdp_muon::init_from_env: ", source,
                  " asks for Gloo but this build of ",
                  "fsdp_muon has none (configured with FSDP_MUON_WITH_GLOO=OFF)");
      break;
    case CommBackend::kAuto:
      break;  // resolved above
  }
  return backend;
}

}  // namespace

const char* to_string(CommBackend backend) {
  for (const auto& entry : kBackendNames) {
    if (entry.backend == backend) return entry.name;
  }
  return "unknown";
}

std::optional<CommBackend> parse_comm_backend(std::string_view name) {
  for (const auto& entry : kBackendNames) {
    if (name == entry.name) return entry.backend;
  }
  return std::nullopt;
}

namespace {

LaunchEnvironment read_launch_environment_for(const char* api) {
  const auto torch = read_launcher(api, "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", false);
  const auto ompi = read_launcher(api, "mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                  "OMPI_COMM_WORLD_LOCAL_RANK", false);
  const auto slurm =
      read_launcher(api, "srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", true);
  const auto pmi = read_launcher(api, "pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", true);

  std::vector<Reading> active;
  if (torch && env("TORCHELASTIC_RUN_ID")) {
    active.push_back(*torch);  // torchrun's workers; an outer launcher started the agent
  } else {
    // The launcher named is the first present; RANK/WORLD_SIZE set by hand come last, since a
    // job script often copies them from the launcher's own.
    for (const auto* r : {&ompi, &pmi}) {
      if (*r) {
        active.push_back(**r);
      }
    }
    // mpirun and PMI launchers start their daemons with srun inside an allocation; the Slurm
    // variables then describe the daemon, not this rank.
    if (slurm && !ompi && !pmi) {
      active.push_back(*slurm);
    }
    if (torch) {
      active.push_back(*torch);
    }
  }
  for (size_t i = 1; i < active.size(); ++i) {
    check_agree(api, active[0], active[i]);
  }

  LaunchEnvironment e;
  e.launcher = "single";
  if (!active.empty()) {
    const Reading& r = active[0];
    e.launcher = r.launcher;
    e.rank = r.rank;
    e.world_size = r.size;
    for (const auto& a : active) {
      if (a.local_rank) {
        e.local_rank = *a.local_rank;
        e.local_rank_variable = a.local_var;
        break;
      }
    }
  }

  const auto addr = env("MASTER_ADDR");
  const auto port = env("MASTER_PORT");
  TORCH_CHECK(!addr || port, api, ": MASTER_ADDR=", addr.value_or(""),
              " is set but MASTER_PORT is not; set both or neither");
  TORCH_CHECK(addr || !port, api, ": MASTER_PORT=", port.value_or(""),
              " is set but MASTER_ADDR is not; set both or neither");
  e.use_agent_store = e.launcher == "torchrun" && env("TORCHELASTIC_USE_AGENT_STORE") == "True";
  if (addr) {
    e.master_addr = *addr;
    e.master_port = parse_int(api, "MASTER_PORT", *port);
    TORCH_CHECK(e.master_port >= 0 && e.master_port <= 65535, api, ": MASTER_PORT=", e.master_port,
                " is not a TCP port (0-65535)");
    // Port 0 lets the OS choose, which only a world of one can use: nobody else could find it.
    TORCH_CHECK(e.master_port != 0 || (e.world_size == 1 && !e.use_agent_store), api,
                ": MASTER_PORT=0 only works for a single process; give the "
                "port rank 0 listens on");
  } else if (e.world_size > 1) {
    check_single_node(api, e);
  }
  e.job_id = job_id_for(e.launcher);
  return e;
}

}  // namespace

LaunchEnvironment read_launch_environment() {
  return read_launch_environment_for("fsdp_muon::read_launch_environment");
}

namespace {

// Longest timeout accepted: far beyond any job, and still exact in milliseconds.
constexpr double kMaxTimeoutSeconds = 1e9;

// InitOptions::timeout_seconds, or FSDP_MUON_TIMEOUT when that is set.
double timeout_seconds(const InitOptions& options) {
  if (const auto text = env("FSDP_MUON_TIMEOUT")) {
    errno = 0;
    char* end = nullptr;
    const double parsed = std::strtod(text->c_str(), &end);
    TORCH_CHECK(end != text->c_str() && *end == '\0' && errno == 0 && std::isfinite(parsed) &&
                    parsed > 0 && parsed <= kMaxTimeoutSeconds &&
                    !std::isspace(static_cast<unsigned char>((*text)[0])),
                "fsdp_muon::init_from_env: FSDP_MUON_TIMEOUT='", *text,
                "' is not a timeout in seconds; give a positive number such as 30 or 2.5 (at most ",
                kMaxTimeoutSeconds, "), or unset it to use InitOptions::timeout_seconds");
    return parsed;
  }
  TORCH_CHECK(std::isfinite(options.timeout_seconds) && options.timeout_seconds > 0 &&
                  options.timeout_seconds <= kMaxTimeoutSeconds,
              "fsdp_muon::init_from_env: InitOptions::timeout_seconds=", options.timeout_seconds,
              " must be positive and finite (at most ", kMaxTimeoutSeconds, " s)");
  return options.timeout_seconds;
}

}  // namespace

std::shared_ptr<Communicator> init_from_env(const InitOptions& options) {
  const double seconds = timeout_seconds(options);
  const LaunchEnvironment e = read_launch_environment_for("fsdp_muon::init_from_env");
  const CommBackend backend = choose_backend(options, e);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));

  // Each communicator gets its own key space, numbered in call order (the same on every rank).
  static std::atomic<int> instances{0};
  const int instance = instances++;
  // torchrun restarts its workers against the same agent store: each attempt gets fresh keys.
  const std::string attempt =
      e.launcher == "torchrun" ? env("TORCHELASTIC_RESTART_COUNT").value_or("0") : "0";
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "fsdp_muon/attempt_" + attempt + "/communicator_" + std::to_string(instance),
      base_store(e, timeout));
  std::ostringstream waiting;
  waiting << "fsdp_muon::init_from_env: setting up " << to_string(backend) << " for " << e.launcher
          << " rank " << e.rank << " of " << e.world_size << " failed (are all " << e.world_size
          << " processes started and reachable within " << seconds << " s?): ";
  agree_on_job(*store, e, timeout, waiting.str());

  try {
    switch (backend) {
      case CommBackend::kNccl: {
        const int devices = torch::cuda::device_count();
        TORCH_CHECK(e.local_rank < devices, "fsdp_muon::init_from_env: local rank ", e.local_rank,
                    " has no CUDA device (", devices,
                    " visible); start at most one process per GPU on each node or check "
                    "CUDA_VISIBLE_DEVICES");
        // The rank's own GPU becomes the current device, so user code that says kCUDA (and
        // LibTorch's default stream) lands there, not on device 0. The guard interface needs
        // no CUDA headers.
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
            ->setDevice(
                c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(e.local_rank)));
        return make_nccl_communicator(store, e.rank, e.world_size, e.local_rank, timeout);
      }
      case CommBackend::kGloo: {
        // Without an address every rank is on this node, and loopback always connects there.
        const bool local = e.master_addr.empty() || e.master_addr == "localhost" ||
                           e.master_addr.rfind("127.", 0) == 0;
        return make_gloo_communicator(store, e.rank, e.world_size, timeout,
                                      local ? "127.0.0.1" : "");
      }
      case CommBackend::kAuto:
        break;  // choose_backend never returns it
    }
    TORCH_CHECK(false, "fsdp_muon::init_from_env: no communicator for backend ",
                to_string(backend));
  } catch (const c10::Error& ex) {
    TORCH_CHECK(false, "fsdp_muon::init_from_env: setting up ", to_string(backend), " for ",
                e.launcher, " rank ", e.rank, " of ", e.world_size, " failed (are all ",
                e.world_size, " processes started and reachable within ", seconds,
                " s?): ", ex.what_without_backtrace());
  }
}

#if !FSDP_MUON_WITH_CUDA
std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::Store>, int, int, int,
                                                     std::chrono::milliseconds) {
  TORCH_CHECK(false, "fsdp_muon::make_nccl_communicator: this build of fsdp_muon has no CUDA");
}
#endif

#if !FSDP_MUON_WITH_GLOO
std::shared_ptr<Communicator> make_gloo_communicator(c10::intrusive_ptr<c10d::Store>, int, int,
                                                     std::chrono::milliseconds,
                                                     const std::string&) {
  TORCH_CHECK(false, "fsdp_muon::make_gloo_communicator: this build of fsdp_muon has no Gloo");
}
#endif

}  // namespace fsdp_muon
