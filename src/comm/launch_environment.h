#pragma once
// Reading the launcher's variables (docs/DESIGN.md §5, Launch). Internal header: the public
// read_launch_environment() and init_from_env() are built on these.

#include <optional>
#include <string>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon::detail {

// The variable's value; an empty variable counts as unset (`export RANK=` is how shells clear
// one).
std::optional<std::string> env_variable(const char* name);

// read_launch_environment(), its errors naming the public call that read the environment:
// `api` is "fsdp_muon::init_from_env" or "fsdp_muon::read_launch_environment".
LaunchEnvironment read_launch_environment_for(const char* api);

// The job id the launcher gives its ranks (the same on every rank of one job, different for
// another job), or nullopt when it gives none.
std::optional<std::string> launcher_job_id(const std::string& launcher);

// The variable that holds the world size for this launcher, for messages.
const char* world_size_variable(const std::string& launcher);

}  // namespace fsdp_muon::detail
