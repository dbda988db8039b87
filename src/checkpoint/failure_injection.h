#pragma once
// A test hook that makes one checkpoint file write stop half-way and throw, leaving what a crash
// would leave: tests use it to show that an interrupted save keeps the previous checkpoint
// loadable. Internal header: not part of the public API (tests have src/ on their include path).

#include <cstdint>

namespace fsdp_muon {
namespace detail {

// This process completes `files` more checkpoint file writes, then the next one writes half its
// bytes to its temporary file and throws. Negative disarms. The environment variable
// FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES arms it too (read once, at the first write); a call
// here wins over it.
void set_checkpoint_failure_injection(int64_t files);

}  // namespace detail

namespace checkpoint {

// Called by every checkpoint file write as it starts: true when this write must fail half-way
// (which disarms the hook). `api` names the public function in errors.
bool take_injected_failure(const char* api);

}  // namespace checkpoint
}  // namespace fsdp_muon
