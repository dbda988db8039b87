#pragma once
// That the ranks meeting in one store belong to one job (docs/DESIGN.md §5, Launch). Internal
// header.

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon::detail {

// Every rank calls this once per communicator, on that communicator's store, before the
// backend's own rendezvous: rank 0 claims the store for its job, the others check that claim
// against their own launcher's view and claim their rank. A store of another job, a world size
// that differs, or a rank claimed twice throws on every rank involved. `waiting` starts the
// message of a timeout, which means some rank never came.
void agree_on_job(c10d::Store& store, const LaunchEnvironment& e, std::chrono::milliseconds timeout,
                  const std::string& waiting);

}  // namespace fsdp_muon::detail
