#pragma once
// Helpers shared by the Muon tests.

#include <functional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "common/test_util.h"

namespace fsdp_muon::test {

using testing::expect_error;

// Collects TORCH_WARN messages while alive.
class WarningCollector : public c10::WarningHandler {
 public:
  WarningCollector() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~WarningCollector() override { c10::WarningUtils::set_warning_handler(previous_); }
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;

 private:
  c10::WarningHandler* previous_;
};

}  // namespace fsdp_muon::test
