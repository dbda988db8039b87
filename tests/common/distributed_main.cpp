#include "common/distributed_main.h"

#include <string>

#include <cstdio>
#include <exception>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "common/test_util.h"

namespace fsdp_muon::testing {
namespace {
std::shared_ptr<Communicator>& slot() {
  static std::shared_ptr<Communicator> comm;
  return comm;
}
}  // namespace

Communicator& world() { return *slot(); }
std::shared_ptr<Communicator> world_ptr() { return slot(); }

}  // namespace fsdp_muon::testing

int main(int argc, char** argv) {
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  try {
    fsdp_muon::InitOptions options;
    // A rank that fails should bring the others down in a minute, not at CTest's timeout.
    options.timeout_seconds = 60;
    // The tests build CPU tensors: on a CUDA machine "auto" would pick NCCL, which moves only
    // CUDA tensors. Ask for Gloo by name so the suites pass on GPU machines too.
    options.backend = fsdp_muon::to_string(fsdp_muon::CommBackend::kGloo);
    fsdp_muon::testing::slot() = fsdp_muon::init_from_env(options);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "init_from_env failed: %s\n", e.what_without_backtrace());
    return 2;
  }
  auto& comm = fsdp_muon::testing::world();
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
  fsdp_muon::testing::slot().reset();
  return rc;
}
