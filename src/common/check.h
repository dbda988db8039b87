#pragma once
// The library's checks (docs/DESIGN.md §8, "Errors"). Every message starts with the public call
// it failed under, "fsdp_muon::load_checkpoint: ...", without an `api` argument threaded through
// the helpers: a public entry point opens an ApiScope naming itself, and FSDP_MUON_CHECK reads
// the innermost scope of its thread. A helper shared by two entry points thus names whichever
// the user called. Checks outside any scope (a test calling a helper directly) say "fsdp_muon: ".

#include <ostream>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp_muon::detail {

// Names the public call this thread is in, e.g. "FsdpMuon::step", for as long as it lives.
// `api` must outlive the scope (a string literal).
class ApiScope {
 public:
  explicit ApiScope(const char* api) noexcept : outer_(innermost()) { innermost() = api; }
  ~ApiScope() { innermost() = outer_; }
  ApiScope(const ApiScope&) = delete;
  ApiScope& operator=(const ApiScope&) = delete;

  // The innermost scope's name on this thread; nullptr outside any.
  static const char* current() noexcept { return innermost(); }

 private:
  static const char*& innermost() noexcept {
    static thread_local const char* api = nullptr;
    return api;
  }
  const char* outer_;
};

// "fsdp_muon::<api>: " (or "fsdp_muon: " outside any scope) when streamed into a message.
struct ApiPrefix {};
inline std::ostream& operator<<(std::ostream& out, ApiPrefix) {
  const char* api = ApiScope::current();
  return api ? out << "fsdp_muon::" << api << ": " : out << "fsdp_muon: ";
}

// "fsdp_muon::<api>" (or "fsdp_muon"): the calling API as a name, for messages built elsewhere
// (a watchdog's scope, an agreement's `what`).
inline std::string api_name() {
  const char* api = ApiScope::current();
  return api ? std::string("fsdp_muon::") + api : std::string("fsdp_muon");
}

}  // namespace fsdp_muon::detail

#define FSDP_MUON_API_SCOPE_CONCAT_(a, b) a##b
#define FSDP_MUON_API_SCOPE_NAME_(line) FSDP_MUON_API_SCOPE_CONCAT_(fsdp_muon_api_scope_, line)
// Opens the scope of a public call until the end of the enclosing block:
//   FSDP_MUON_API_SCOPE("load_checkpoint");
#define FSDP_MUON_API_SCOPE(api) \
  const ::fsdp_muon::detail::ApiScope FSDP_MUON_API_SCOPE_NAME_(__LINE__)(api)

// TORCH_CHECK with the calling API's prefix: FSDP_MUON_CHECK(n > 0, "n must be > 0, got ", n).
#define FSDP_MUON_CHECK(cond, ...) TORCH_CHECK(cond, ::fsdp_muon::detail::ApiPrefix{}, __VA_ARGS__)
// TORCH_WARN with the same prefix.
#define FSDP_MUON_WARN(...) TORCH_WARN(::fsdp_muon::detail::ApiPrefix{}, __VA_ARGS__)
