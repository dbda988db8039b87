#pragma once
// Helpers every test may use: expect_error for the errors fsdp_muon must raise, and
// FSDP_MUON_REQUIRE_GPU for the tests that need a CUDA device.

#include <functional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <fsdp_muon/config.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

namespace fsdp_muon::testing {

// Starts every failure message of this thread ("rank 1: " in a launched distributed test,
// "W=3 rank 1: " on an in-process world's rank thread, which distributed_main sets), so a
// failure on one rank of a job says which.
inline std::string& failure_prefix() {
  thread_local std::string prefix;
  return prefix;
}

// Runs `fn`, which must throw a c10::Error whose message (without the backtrace) contains every
// one of `needles`. `what`, when given, names the case in the failure messages.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles,
                         const std::string& what = "") {
  const std::string who = failure_prefix() + (what.empty() ? "" : what + ": ");
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << who << "the error message lacks '" << needle << "': " << message;
    }
    return;
  }
  ADD_FAILURE() << who << "no error; expected one mentioning '"
                << (needles.empty() ? "" : needles[0]) << "'";
}

// Whether this build has CUDA and this process sees a device.
inline bool gpu_usable() { return FSDP_MUON_WITH_CUDA && torch::cuda::is_available(); }

}  // namespace fsdp_muon::testing

// First statement of a test that needs a GPU: without one the test is skipped, saying why (and
// `reason`, what the test checks on a GPU machine).
#define FSDP_MUON_REQUIRE_GPU(reason) \
  if (!::fsdp_muon::testing::gpu_usable()) GTEST_SKIP() << "no CUDA device (" << (reason) << ")"
