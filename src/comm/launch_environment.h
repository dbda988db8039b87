#pragma once
// Reading the launcher's variables (docs/DESIGN.md §5, Launch). Internal header: init_from_env()
// is built on it, and the tests read the environment through it.

#include <optional>
#include <string>

namespace fsdp_muon::detail {

// Which launcher environment a process was started from, as read by init_from_env().
struct LaunchEnvironment {
  // "torchrun" (also RANK/WORLD_SIZE set by hand), "mpirun" (Open MPI), "srun", "pmi", or
  // "single" (no launcher: a world of one).
  std::string launcher;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  // The variable local_rank came from (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID or
  // MPI_LOCALRANKID); empty when the launcher gave none, and local_rank is then 0.
  std::string local_rank_variable;
  // Ranks the launcher started on this node (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE,
  // SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE when every node has as many, or
  // MPI_LOCALNRANKS; a world of one without a launcher); 0 when the launcher gives none.
  int local_world_size = 0;
  std::string local_world_size_variable;  // where it came from; empty when 0
  std::string master_addr;                // empty when the launcher gives none
  int master_port = 0;
  // torchrun's agent hosts the TCPStore on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True):
  // every rank connects as a client. Otherwise rank 0 hosts it.
  bool use_agent_store = false;
  // Names this job on this node (from the launcher's job id), for the FileStore rendezvous.
  std::string job_id;
};

// Reads the launcher's variables (torchrun, Open MPI, Slurm, PMI). Missing or contradictory
// variables throw with a message naming the variable. A launcher nested in another wins:
// torchrun (TORCHELASTIC_RUN_ID set) over the rest, mpirun and PMI over Slurm (whose variables
// then describe the daemon mpirun started, not this rank); any other pair must agree.
// Errors are prefixed "fsdp_muon::read_launch_environment" (the tests' name for this call);
// init_from_env() reads through read_launch_environment_here() under its own name.
LaunchEnvironment read_launch_environment();

// The variable's value; an empty variable counts as unset (`export RANK=` is how shells clear
// one).
std::optional<std::string> env_variable(const char* name);

// read_launch_environment(), its errors naming the public call that reads the environment (the
// caller's ApiScope, common/check.h: init_from_env, init_mesh_from_env).
LaunchEnvironment read_launch_environment_here();

// The job id the launcher gives its ranks (the same on every rank of one job, different for
// another job), or nullopt when it gives none.
std::optional<std::string> launcher_job_id(const std::string& launcher);

// The variable that holds the world size for this launcher, for messages.
const char* world_size_variable(const std::string& launcher);

}  // namespace fsdp_muon::detail
