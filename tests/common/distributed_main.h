#pragma once
// Shared main() for distributed GoogleTest executables: one intra-op thread, one Gloo
// communicator from init_from_env() (whatever launcher started us; Gloo even where CUDA is
// available, because the tests build CPU tensors), torn down after the tests. Link
// distributed_main.cpp into the executable and call fsdp_muon::testing::world().

#include <memory>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon::testing {

// The communicator every test of this process shares.
Communicator& world();
std::shared_ptr<Communicator> world_ptr();

}  // namespace fsdp_muon::testing
