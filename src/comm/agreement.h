#pragma once
// "Every rank runs this, all learn whether any failed, all throw": the one way fsdp_muon turns a
// failure on some ranks into the same error on every rank instead of a hang (docs/DESIGN.md,
// "Agreement"). Internal header.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <fsdp_muon/comm/communicator.h>

#include "common/stable_hash.h"

namespace fsdp_muon::detail {

// The message of the exception being handled: c10::Error without its backtrace, any
// std::exception's what(), or "unknown exception". Call it only inside a catch block.
std::string current_exception_message();

// Every rank of `comm` calls this, in the same public call (its ApiScope, common/check.h, names
// it in errors as "<api>" below), with the same `contribution_size`.
// `local` runs here and fills this rank's `contribution` (zeros on entry); any exception it
// throws is caught. One all-reduce then sums [failed, contribution...] over the ranks. When no
// rank failed it returns the summed contributions. Otherwise a second collective (only then)
// fetches the messages, and every rank throws: a rank that failed with its own message (noting
// how many others failed too), the others with "<api> failed on rank R of W: <message>" for
// the lowest failing rank R. With one rank there is no collective at all.
std::vector<int64_t> agree_on_sum(Communicator& comm, size_t contribution_size,
                                  const std::function<void(std::vector<int64_t>&)>& local);

// agree_on_sum with a part already on comm.device(): `local` fills the host part as above and
// returns `device_size` int64 values on the device (undefined: zeros), summed after the host part
// by the same all-reduce and brought to the host by the same wait, so that a result computed on
// the device (FsdpMuon's non-finite flags) costs no wait of its own (docs/DESIGN.md §5).
std::vector<int64_t> agree_on_sum(Communicator& comm, size_t host_size, size_t device_size,
                                  const std::function<at::Tensor(std::vector<int64_t>&)>& local);

// agree_on_sum with nothing to sum: runs `fn` everywhere and fails everywhere if it failed
// anywhere.
void run_agreed(Communicator& comm, const std::function<void()>& fn);

// 40 well-mixed bits of a value (splitmix64's finalizer): summed over up to 2^23 ranks they stay
// below 2^63, so an agreement's int64 sum of them never overflows.
int64_t mix40(uint64_t x);

// The ranks whose `description` differs from rank 0's (empty when all agree), through one
// all-gather of a stable 64-bit hash of it. For checking that every rank built the same thing.
std::vector<int> ranks_that_differ(Communicator& comm, const std::string& description);

// Descriptions are lines of text; these join them into one string and split it again.
std::string join_lines(const std::vector<std::string>& lines);
std::vector<std::string> split_lines(const std::string& text);

// Every rank's text (two all-gathers; host waits bounded by the communicator's timeout).
std::vector<std::string> gather_descriptions(Communicator& comm, const std::string& mine);

// For descriptions written one "<key> = <value>" per line: the first line where rank r's
// description differs from rank 0's, as "<key>: rank 0 has <value>, rank r has <value>" (a line
// one rank lacks is "nothing"; lines with different keys are quoted whole).
std::string first_different_entry(const std::vector<std::string>& zero,
                                  const std::vector<std::string>& other, int r);

// How a collective API agrees its arguments before its first data collective (docs/DESIGN.md,
// "Agreement"). Every rank runs `describe`, which checks this rank's arguments (throwing a
// message that names the bad one) and returns them as "<name> = <value>" lines. One all-gather
// of [failed, hash of the lines] follows. When some rank failed, every rank throws as
// agree_on_sum does; when some rank's lines differ from rank 0's, every rank throws
// "<api>: the ranks disagree on <subject> (rank(s) R differ from rank 0; this is rank r of W);
// first difference, <name>: rank 0 has <a>, rank R has <b>. <rule>" (the lines themselves
// travel only then). With one rank there is no collective at all.
void agree_on_arguments(Communicator& comm, const std::string& subject, const std::string& rule,
                        const std::function<std::vector<std::string>()>& describe);

// A double as the shortest text that reads back to the same bits ("%.17g"), for descriptions:
// two ranks that print the same text passed the same value.
std::string exact_text(double value);

}  // namespace fsdp_muon::detail
