#pragma once
// "Every rank runs this, all learn whether any failed, all throw": the one way fsdp_muon turns a
// failure on some ranks into the same error on every rank instead of a hang (docs/DESIGN.md,
// "Agreement"). Internal header.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon::detail {

// The message of the exception being handled: c10::Error without its backtrace, any
// std::exception's what(), or "unknown exception". Call it only inside a catch block.
std::string current_exception_message();

// Every rank of `comm` calls this with the same `what` and the same `contribution_size`.
// `local` runs here and fills this rank's `contribution` (zeros on entry); any exception it
// throws is caught. One all-reduce then sums [failed, contribution...] over the ranks. When no
// rank failed it returns the summed contributions. Otherwise a second collective (only then)
// fetches the messages, and every rank throws: a rank that failed with its own message (noting
// how many others failed too), the others with "<what> failed on rank R of W: <message>" for
// the lowest failing rank R. With one rank there is no collective at all.
std::vector<int64_t> agree_on_sum(Communicator& comm, const std::string& what,
                                  size_t contribution_size,
                                  const std::function<void(std::vector<int64_t>&)>& local);

// agree_on_sum with nothing to sum: runs `fn` everywhere and fails everywhere if it failed
// anywhere.
void run_agreed(Communicator& comm, const std::string& what, const std::function<void()>& fn);

// The ranks whose `description` differs from rank 0's (empty when all agree), through one
// all-gather of a stable 64-bit hash of it. For checking that every rank built the same thing.
std::vector<int> ranks_that_differ(Communicator& comm, const std::string& description);

}  // namespace fsdp_muon::detail
