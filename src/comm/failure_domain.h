#pragma once
// Communicators that fail together (docs/DESIGN.md §5, "Streams and aborts"): the NCCL
// communicators of one CUDA device share its streams, so a collective stuck on a dead peer in one
// of them blocks the others' kernels behind it. When one member fails, every other member is
// aborted, each on a thread of its own (an abort can wait for the device; the members' own
// watchdogs bound each), and every later error of the domain can name the failure that came
// first: the member's name and its message. Backend-neutral, so that the CPU tests exercise it.

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace fsdp_muon::detail {

class FailureDomain {
 public:
  // Aborts a member because another failed: `cause` is the first failure, as first_failure()
  // words it. Must not throw; runs on a thread of the domain's.
  using Abort = std::function<void(const std::string& cause)>;

  // The domain of `key` (e.g. "cuda:0"), made on first use and shared while any holder keeps it.
  static std::shared_ptr<FailureDomain> of(const std::string& key);

  // Adds a member named `name` (e.g. "nccl communicator of 4 ranks, rank 1"); the id leaves it.
  // A member that joins after a failure is aborted at once, on this thread. leave() waits for an
  // abort of that member still running on a domain thread, so a member leaves, then dies.
  int64_t join(std::string name, Abort abort);
  void leave(int64_t id);

  // Member `id` failed with `error` and must abort itself with `own_abort` (which must not
  // throw). The first failure of the domain is recorded; every other member's abort starts on a
  // thread of its own before `own_abort` runs here, and this returns when all have returned: an
  // abort can wait for the device behind another member's stuck kernel, which only that
  // member's abort ends, so none may wait for another to finish first. A later failure runs
  // `own_abort` alone. Returns the first failure, "<name>: <error>".
  std::string fail(int64_t id, const std::string& error,
                   const std::function<void()>& own_abort = {});

  // "<name>: <error>" of the first failure; nullopt while none.
  std::optional<std::string> first_failure() const;

 private:
  struct Member {
    std::string name;
    Abort abort;
    int aborts_running = 0;
  };
  mutable std::mutex mutex_;
  std::condition_variable abort_done_;
  std::map<int64_t, Member> members_;
  int64_t next_id_ = 0;
  std::optional<std::string> first_failure_;
};

}  // namespace fsdp_muon::detail
