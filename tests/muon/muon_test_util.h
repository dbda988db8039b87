#pragma once
// Helpers shared by the Muon tests.

#include <functional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp_muon::test {

// Runs fn, expects a c10::Error whose message contains every one of `needles`.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "error message lacks '" << needle << "': " << message;
    }
    return;
  }
  ADD_FAILURE() << "expected an error mentioning '" << (needles.empty() ? "" : needles[0]) << "'";
}

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
