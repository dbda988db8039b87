#include "comm/agreement.h"

#include <algorithm>
#include <cstring>
#include <exception>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fsdp_muon::detail {

std::string current_exception_message() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

namespace {

// Bytes of each rank's message that travel: enough for any message this library writes.
constexpr int64_t kMessageSlot = 1024;

// Only after every rank knows that some rank failed: each sends its message (an empty slot
// where it did not fail), so every rank can name the lowest failing rank and its message.
[[noreturn]] void throw_agreed_failure(Communicator& comm, const std::string& what,
                                       int64_t failed_ranks, const std::string& own_error,
                                       bool failed_here) {
  at::Tensor mine = at::zeros({kMessageSlot}, at::kByte);
  if (failed_here) {
    auto* slot = mine.data_ptr<uint8_t>();
    slot[0] = 1;
    std::memcpy(slot + 1, own_error.data(), std::min<size_t>(own_error.size(), kMessageSlot - 2));
  }
  at::Tensor all = at::empty({kMessageSlot * comm.size()}, mine.options().device(comm.device()));
  comm.all_gather(mine.to(comm.device()), all);
  // A rank that failed reports its own message: the root cause reads best where it happened.
  TORCH_CHECK(!failed_here, own_error,
              failed_ranks > 1
                  ? " (and " + std::to_string(failed_ranks - 1) + " other rank(s) failed too)"
                  : std::string());
  const at::Tensor host = comm.to_host(all);
  const auto* bytes = host.data_ptr<uint8_t>();
  for (int r = 0; r < comm.size(); ++r) {
    const uint8_t* slot = bytes + r * kMessageSlot;
    if (slot[0] == 0) continue;
    const char* msg = reinterpret_cast<const char*>(slot + 1);
    TORCH_CHECK(false, what, " failed on rank ", r, " of ", comm.size(), ": ",
                std::string(msg, strnlen(msg, kMessageSlot - 1)));
  }
  TORCH_CHECK(false, what, " failed on ", failed_ranks, " rank(s) of ", comm.size());
}

}  // namespace

std::vector<int64_t> agree_on_sum(Communicator& comm, const std::string& what,
                                  size_t contribution_size,
                                  const std::function<void(std::vector<int64_t>&)>& local) {
  std::vector<int64_t> contribution(contribution_size, 0);
  std::string error;
  bool failed = false;
  try {
    local(contribution);
  } catch (...) {
    error = current_exception_message();
    failed = true;
  }
  if (comm.size() == 1) {
    TORCH_CHECK(!failed, error);
    return contribution;
  }
  std::vector<int64_t> flags(contribution_size + 1, 0);
  flags[0] = failed ? 1 : 0;
  std::copy(contribution.begin(), contribution.end(), flags.begin() + 1);
  at::Tensor summed = at::tensor(flags, at::TensorOptions().dtype(at::kLong)).to(comm.device());
  try {
    comm.all_reduce(summed, ReduceOp::kSum);
  } catch (...) {
    // A local failure that also broke the communicator (a host wait that timed out aborts it)
    // is the root cause; the collective's error comes second.
    TORCH_CHECK(!failed, error, " (then ", current_exception_message(), ")");
    throw;
  }
  // The host copy is the synchronization point: what follows depends on every rank's outcome.
  // Bounded by the communicator's timeout, so a rank that never arrives is an error, not a hang.
  const at::Tensor host = comm.to_host(summed);
  const int64_t* sums = host.data_ptr<int64_t>();
  if (sums[0] != 0) throw_agreed_failure(comm, what, sums[0], error, failed);
  return std::vector<int64_t>(sums + 1, sums + 1 + contribution_size);
}

void run_agreed(Communicator& comm, const std::string& what, const std::function<void()>& fn) {
  agree_on_sum(comm, what, 0, [&](std::vector<int64_t>&) { fn(); });
}

namespace {

// FNV-1a: stable across builds and processes, unlike std::hash.
int64_t stable_hash(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

}  // namespace

std::vector<int> ranks_that_differ(Communicator& comm, const std::string& description) {
  const int world = comm.size();
  if (world == 1) return {};
  at::Tensor mine = at::full({1}, stable_hash(description), at::TensorOptions().dtype(at::kLong));
  at::Tensor all = at::empty({world}, mine.options().device(comm.device()));
  comm.all_gather(mine.to(comm.device()), all);
  const at::Tensor host = comm.to_host(all);
  const int64_t* hashes = host.data_ptr<int64_t>();
  std::vector<int> differ;
  for (int r = 1; r < world; ++r) {
    if (hashes[r] != hashes[0]) differ.push_back(r);
  }
  return differ;
}

}  // namespace fsdp_muon::detail
