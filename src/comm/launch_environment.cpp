// Reading the launcher's variables (docs/DESIGN.md §5, Launch): who this process is (rank,
// world size, local rank), where the ranks meet (MASTER_ADDR/MASTER_PORT) and the launcher's job
// id. Every inconsistency is reported here, naming the variable, rather than surfacing later as
// a hang.

#include "comm/launch_environment.h"

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon {
namespace detail {

std::optional<std::string> env_variable(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    return std::nullopt;
  }
  return std::string(value);
}

const char* world_size_variable(const std::string& launcher) {
  if (launcher == "mpirun") return "OMPI_COMM_WORLD_SIZE";
  if (launcher == "srun") return "SLURM_NTASKS";
  if (launcher == "pmi") return "PMI_SIZE";
  return "WORLD_SIZE";
}

// The job id the launcher gives its ranks (the same on every rank of one job, different for
// another job), or nullopt when it gives none.
std::optional<std::string> launcher_job_id(const std::string& launcher) {
  std::optional<std::string> id;
  if (launcher == "torchrun") {
    id = env_variable("TORCHELASTIC_RUN_ID");
  } else if (launcher == "mpirun") {
    id = env_variable("OMPI_MCA_ess_base_jobid");
    if (!id) {
      id = env_variable("PMIX_NAMESPACE");
    }
  } else if (launcher == "srun") {
    if ((id = env_variable("SLURM_JOB_ID"))) {
      if (const auto step = env_variable("SLURM_STEP_ID")) {
        *id += "." + *step;
      }
    }
  } else if (launcher == "pmi") {
    id = env_variable("PMIX_NAMESPACE");
  }
  return id;
}

namespace {

// Errors name the public call that read the environment: `api` is "fsdp_muon::init_from_env" or
// "fsdp_muon::read_launch_environment".
int parse_int(const char* name, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const long parsed = std::strtol(value.c_str(), &end, 10);
  FSDP_MUON_CHECK(end != value.c_str() && *end == '\0' && errno == 0 && parsed >= INT_MIN &&
                      parsed <= INT_MAX && !std::isspace(static_cast<unsigned char>(value[0])),
                  name, "='", value, "' is not an integer");
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
std::optional<Reading> read_launcher(const char* launcher, const char* rank_var,
                                     const char* size_var, const char* local_var,
                                     bool rank_marks_presence) {
  const auto rank = env_variable(rank_var);
  const auto size = env_variable(size_var);
  if (!rank && (rank_marks_presence || !size)) {
    return std::nullopt;
  }
  FSDP_MUON_CHECK(rank, size_var, " is set but ", rank_var, " is not; a ", launcher,
                  " launch sets both");
  FSDP_MUON_CHECK(size, rank_var, " is set but ", size_var, " is not; a ", launcher,
                  " launch sets both");
  Reading r;
  r.launcher = launcher;
  r.rank_var = rank_var;
  r.size_var = size_var;
  r.local_var = local_var;
  r.size = parse_int(size_var, *size);
  r.rank = parse_int(rank_var, *rank);
  FSDP_MUON_CHECK(r.size >= 1, size_var, "=", r.size, " must be at least 1");
  FSDP_MUON_CHECK(r.rank >= 0 && r.rank < r.size, rank_var, "=", r.rank,
                  " is outside the world of ", size_var, "=", r.size, " ranks [0, ", r.size, ")");
  if (const auto local = env_variable(local_var)) {
    r.local_rank = parse_int(local_var, *local);
    FSDP_MUON_CHECK(*r.local_rank >= 0 && *r.local_rank < r.size, local_var, "=", *r.local_rank,
                    " is outside [0, ", size_var, "=", r.size, ")");
  }
  return r;
}

void check_agree(const Reading& a, const Reading& b) {
  const char* fix = "; unset the variables of the launcher that did not start this process";
  FSDP_MUON_CHECK(a.size == b.size, "contradictory world sizes: ", a.size_var, "=", a.size, " (",
                  a.launcher, ") but ", b.size_var, "=", b.size, " (", b.launcher, ")", fix);
  FSDP_MUON_CHECK(a.rank == b.rank, "contradictory ranks: ", a.rank_var, "=", a.rank, " (",
                  a.launcher, ") but ", b.rank_var, "=", b.rank, " (", b.launcher, ")", fix);
  if (a.local_rank && b.local_rank) {
    FSDP_MUON_CHECK(*a.local_rank == *b.local_rank, "contradictory local ranks: ", a.local_var, "=",
                    *a.local_rank, " (", a.launcher, ") but ", b.local_var, "=", *b.local_rank,
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

std::string job_id_for(const std::string& launcher) {
  const auto id = launcher_job_id(launcher);
  return launcher + "-" + (id ? *id : parent_process_key());
}

// With no address the rendezvous is a file every rank can see, which only works on one node.
void check_single_node(const LaunchEnvironment& e) {
  auto spans_nodes = [&](const char* local_size_var) {
    const auto local_size = env_variable(local_size_var);
    return local_size && parse_int(local_size_var, *local_size) != e.world_size;
  };
  const char* fix =
      " but MASTER_ADDR is not set; export MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free "
      "port> to every rank";
  if (e.launcher == "torchrun") {
    FSDP_MUON_CHECK(false, "RANK/WORLD_SIZE describe a world of ", e.world_size, " ranks", fix,
                    " (torchrun sets them itself)");
  } else if (e.launcher == "mpirun") {
    FSDP_MUON_CHECK(!spans_nodes("OMPI_COMM_WORLD_LOCAL_SIZE"), "this mpirun job ",
                    "spans several nodes (OMPI_COMM_WORLD_LOCAL_SIZE differs from ",
                    "OMPI_COMM_WORLD_SIZE)", fix, " (mpirun -x MASTER_ADDR -x MASTER_PORT)");
  } else if (e.launcher == "srun") {
    const char* nodes_var =
        env_variable("SLURM_STEP_NUM_NODES") ? "SLURM_STEP_NUM_NODES" : "SLURM_NNODES";
    const auto nodes = env_variable(nodes_var);
    FSDP_MUON_CHECK(!nodes || parse_int(nodes_var, *nodes) <= 1, "this srun step ", "spans ",
                    nodes_var, "=", nodes.value_or("?"), " nodes", fix);
  } else if (e.launcher == "pmi") {
    FSDP_MUON_CHECK(!spans_nodes("MPI_LOCALNRANKS"), "this PMI job spans several ",
                    "nodes (MPI_LOCALNRANKS differs from PMI_SIZE)", fix);
  }
}

// Slurm's per-node task counts look like "4(x2),3": usable only when every node has as many.
std::optional<int> uniform_slurm_tasks(const char* variable, const std::string& value) {
  const auto paren = value.find('(');
  const std::string count = value.substr(0, paren);
  if (count.empty() || value.find(',') != std::string::npos) return std::nullopt;
  return parse_int(variable, count);
}

void read_local_world_size(LaunchEnvironment& e) {
  const auto take = [&](const char* variable, int value) {
    FSDP_MUON_CHECK(value >= 1 && value <= e.world_size, variable, "=", value, " is outside [1, ",
                    e.world_size, "] (the world size)");
    e.local_world_size = value;
    e.local_world_size_variable = variable;
  };
  const auto plain = [&](const char* variable) {
    if (const auto v = env_variable(variable)) take(variable, parse_int(variable, *v));
  };
  if (e.launcher == "torchrun") {
    plain("LOCAL_WORLD_SIZE");
  } else if (e.launcher == "mpirun") {
    plain("OMPI_COMM_WORLD_LOCAL_SIZE");
  } else if (e.launcher == "pmi") {
    plain("MPI_LOCALNRANKS");
  } else if (e.launcher == "srun") {
    for (const char* variable : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      if (const auto v = env_variable(variable)) {
        if (const auto tasks = uniform_slurm_tasks(variable, *v)) take(variable, *tasks);
        break;
      }
    }
  } else if (e.launcher == "single") {
    e.local_world_size = e.world_size;
    e.local_world_size_variable = "(a single process)";
  }
}

}  // namespace

LaunchEnvironment read_launch_environment_here() {
  const auto torch = read_launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", false);
  const auto ompi = read_launcher("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                  "OMPI_COMM_WORLD_LOCAL_RANK", false);
  const auto slurm = read_launcher("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", true);
  const auto pmi = read_launcher("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", true);

  std::vector<Reading> active;
  if (torch && env_variable("TORCHELASTIC_RUN_ID")) {
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
    check_agree(active[0], active[i]);
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

  read_local_world_size(e);

  const auto addr = env_variable("MASTER_ADDR");
  const auto port = env_variable("MASTER_PORT");
  FSDP_MUON_CHECK(!addr || port, "MASTER_ADDR=", addr.value_or(""),
                  " is set but MASTER_PORT is not; set both or neither");
  FSDP_MUON_CHECK(addr || !port, "MASTER_PORT=", port.value_or(""),
                  " is set but MASTER_ADDR is not; set both or neither");
  e.use_agent_store =
      e.launcher == "torchrun" && env_variable("TORCHELASTIC_USE_AGENT_STORE") == "True";
  if (addr) {
    e.master_addr = *addr;
    e.master_port = parse_int("MASTER_PORT", *port);
    FSDP_MUON_CHECK(e.master_port >= 0 && e.master_port <= 65535, "MASTER_PORT=", e.master_port,
                    " is not a TCP port (0-65535)");
    // Port 0 lets the OS choose, which only a world of one can use: nobody else could find it.
    FSDP_MUON_CHECK(e.master_port != 0 || (e.world_size == 1 && !e.use_agent_store),
                    "MASTER_PORT=0 only works for a single process; give the "
                    "port rank 0 listens on");
  } else if (e.world_size > 1) {
    check_single_node(e);
  }
  e.job_id = job_id_for(e.launcher);
  return e;
}

LaunchEnvironment read_launch_environment() {
  FSDP_MUON_API_SCOPE("read_launch_environment");
  return read_launch_environment_here();
}

}  // namespace detail

}  // namespace fsdp_muon
