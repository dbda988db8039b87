#pragma once
// Test hooks of checkpoints. One makes a checkpoint file write stop half-way and throw: as a
// crash (the half-written temporary file stays, as a killed process would leave it), or as a
// write error such as a full disk (the write cleans up after itself and throws, as a real error
// does). Tests use it to show that an interrupted save keeps the previous checkpoint loadable and
// that a retry succeeds. Another makes the fsync of a folder fail as with EIO, and a third runs
// a callback around the reading of `latest`, so that a test can move `latest` between two
// ranks' reads. Each hook is armed for the calling thread only (the thread a rank saves and
// loads on), so that a test playing several ranks as threads arms one rank's. Internal header: not
// part of the public API (tests have src/ on their include path).

#include <cstdint>
#include <functional>

namespace fsdp_muon {
enum class InjectedFailure { kNone, kCrash, kWriteError };

namespace detail {

// This thread completes `files` more checkpoint file writes, then the next one writes half its
// bytes to its temporary file and throws, as `kind` says. Negative disarms. The environment
// variable FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES arms it too, as a crash (read once, at the
// first write); a call here wins over it.
void set_checkpoint_failure_injection(int64_t files,
                                      InjectedFailure kind = InjectedFailure::kCrash);

// The chunk size of rank-file checksums (1 MiB by default; the file records it, so any size
// loads): tests make it small so that their small models span many chunks. 0 restores it.
void set_checkpoint_chunk_bytes(int64_t bytes);

// This thread completes `syncs` more fsyncs of checkpoint folders, then the next one fails
// with EIO (once). Negative disarms.
void set_checkpoint_folder_sync_failure(int64_t syncs);

// Called with false just before and with true just after this thread reads a checkpoint
// root's `latest` file; an empty function removes it.
void set_checkpoint_latest_read_hook(std::function<void(bool after)> hook);

}  // namespace detail

namespace checkpoint {

// The chunk size the next rank file is written with.
int64_t checkpoint_chunk_bytes();

// Called by every checkpoint file write as it starts: how this write must fail half-way
// (anything but kNone disarms the hook). `api` names the public function in errors.
InjectedFailure take_injected_failure();

// Called by every fsync of a checkpoint folder: true when it must fail (disarms the hook).
bool take_injected_folder_sync_failure();

// Runs the latest-read hook, if any.
void run_latest_read_hook(bool after);

}  // namespace checkpoint
}  // namespace fsdp_muon
