#include "comm/agreement.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "common/check.h"

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
  comm.all_gather(comm.to_device(mine), all);
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

std::vector<int64_t> agree_on_sum(Communicator& comm, size_t contribution_size,
                                  const std::function<void(std::vector<int64_t>&)>& local) {
  return agree_on_sum(comm, contribution_size, 0, [&](std::vector<int64_t>& mine) {
    local(mine);
    return at::Tensor();
  });
}

std::vector<int64_t> agree_on_sum(Communicator& comm, size_t host_size, size_t device_size,
                                  const std::function<at::Tensor(std::vector<int64_t>&)>& local) {
  const std::string what = api_name();
  std::vector<int64_t> contribution(host_size, 0);
  at::Tensor on_device;
  std::string error;
  bool failed = false;
  try {
    on_device = local(contribution);
    TORCH_CHECK(!on_device.defined() || (on_device.dim() == 1 &&
                                         on_device.numel() == static_cast<int64_t>(device_size) &&
                                         on_device.device() == comm.device()),
                "internal error: ", what, "'s device part has shape ", on_device.sizes(), " on ",
                on_device.device(), " where ", device_size, " values on ", comm.device(),
                " were expected");
  } catch (...) {
    error = current_exception_message();
    failed = true;
    on_device = at::Tensor();
  }
  const auto long_on_device = at::TensorOptions().dtype(at::kLong).device(comm.device());
  if (device_size > 0 && !on_device.defined())
    on_device = at::zeros({int64_t(device_size)}, long_on_device);
  if (comm.size() == 1) {
    TORCH_CHECK(!failed, error);
    if (device_size > 0) {
      const at::Tensor host = comm.to_host(on_device.to(at::kLong)).contiguous();
      contribution.insert(contribution.end(), host.data_ptr<int64_t>(),
                          host.data_ptr<int64_t>() + device_size);
    }
    return contribution;
  }
  std::vector<int64_t> flags(host_size + 1, 0);
  flags[0] = failed ? 1 : 0;
  std::copy(contribution.begin(), contribution.end(), flags.begin() + 1);
  at::Tensor summed = comm.to_device(at::tensor(flags, at::TensorOptions().dtype(at::kLong)));
  if (device_size > 0) summed = at::cat({summed, on_device.to(at::kLong)});
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
  const at::Tensor host = comm.to_host(summed).contiguous();
  const int64_t* sums = host.data_ptr<int64_t>();
  if (sums[0] != 0) throw_agreed_failure(comm, what, sums[0], error, failed);
  return std::vector<int64_t>(sums + 1, sums + 1 + host_size + device_size);
}

void run_agreed(Communicator& comm, const std::function<void()>& fn) {
  agree_on_sum(comm, 0, [&](std::vector<int64_t>&) { fn(); });
}

int64_t mix40(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<int64_t>(x >> 24);
}

std::vector<int> ranks_that_differ(Communicator& comm, const std::string& description) {
  const int world = comm.size();
  if (world == 1) return {};
  at::Tensor mine = at::full({1}, static_cast<int64_t>(stable_hash(description)),
                             at::TensorOptions().dtype(at::kLong));
  at::Tensor all = at::empty({world}, mine.options().device(comm.device()));
  comm.all_gather(comm.to_device(mine), all);
  const at::Tensor host = comm.to_host(all);
  const int64_t* hashes = host.data_ptr<int64_t>();
  std::vector<int> differ;
  for (int r = 1; r < world; ++r) {
    if (hashes[r] != hashes[0]) differ.push_back(r);
  }
  return differ;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += line + "\n";
  return text;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Every rank's description, through two all-gathers (lengths, then the padded texts). Only
// called once every rank knows that some rank differs, so the bytes travel on failure only.
std::vector<std::string> gather_descriptions(Communicator& comm, const std::string& mine) {
  const int world = comm.size();
  const auto on_device = at::TensorOptions().device(comm.device());
  at::Tensor lengths = at::empty({world}, on_device.dtype(at::kLong));
  comm.all_gather(at::full({1}, static_cast<int64_t>(mine.size()), on_device.dtype(at::kLong)),
                  lengths);
  const at::Tensor host_lengths = comm.to_host(lengths);
  const int64_t* length = host_lengths.data_ptr<int64_t>();
  const int64_t slot = std::max<int64_t>(1, *std::max_element(length, length + world));
  at::Tensor padded = at::zeros({slot}, at::kByte);
  std::copy(mine.begin(), mine.end(), padded.data_ptr<uint8_t>());
  at::Tensor all = at::empty({slot * world}, on_device.dtype(at::kByte));
  comm.all_gather(comm.to_device(padded), all);
  const at::Tensor host = comm.to_host(all);
  const char* bytes = reinterpret_cast<const char*>(host.data_ptr<uint8_t>());
  std::vector<std::string> texts;
  for (int r = 0; r < world; ++r) texts.emplace_back(bytes + r * slot, length[r]);
  return texts;
}

std::string first_different_entry(const std::vector<std::string>& zero,
                                  const std::vector<std::string>& other, int r) {
  const std::string theirs = "rank " + std::to_string(r);
  for (size_t i = 0; i < std::max(zero.size(), other.size()); ++i) {
    const std::string a = i < zero.size() ? zero[i] : "";
    const std::string b = i < other.size() ? other[i] : "";
    if (a == b) continue;
    const std::string sep = " = ";
    const size_t ka = a.find(sep);
    const size_t kb = b.find(sep);
    if (ka != std::string::npos && kb != std::string::npos && a.compare(0, ka, b, 0, kb) == 0) {
      return a.substr(0, ka) + ": rank 0 has " + a.substr(ka + sep.size()) + ", " + theirs +
             " has " + b.substr(kb + sep.size());
    }
    const auto quoted = [](const std::string& line) {
      return line.empty() ? std::string("nothing") : "'" + line + "'";
    };
    return "line " + std::to_string(i + 1) + ": rank 0 has " + quoted(a) + ", " + theirs + " has " +
           quoted(b);
  }
  return "the descriptions differ only in their hash";
}

void agree_on_arguments(Communicator& comm, const std::string& subject, const std::string& rule,
                        const std::function<std::vector<std::string>()>& describe) {
  const std::string what = api_name();
  std::vector<std::string> lines;
  std::string error;
  bool failed = false;
  try {
    lines = describe();
  } catch (...) {
    error = current_exception_message();
    failed = true;
  }
  const int world = comm.size();
  if (world == 1) {
    TORCH_CHECK(!failed, error);
    return;
  }
  const std::string text = join_lines(lines);
  at::Tensor mine = at::tensor(
      std::vector<int64_t>{failed ? 1 : 0, static_cast<int64_t>(stable_hash(text))}, at::kLong);
  at::Tensor all = at::empty({2 * world}, mine.options().device(comm.device()));
  try {
    comm.all_gather(comm.to_device(mine), all);
  } catch (...) {
    TORCH_CHECK(!failed, error, " (then ", current_exception_message(), ")");
    throw;
  }
  const at::Tensor host = comm.to_host(all);
  const int64_t* entry = host.data_ptr<int64_t>();
  int64_t failed_ranks = 0;
  std::vector<int> differ;
  for (int r = 0; r < world; ++r) {
    failed_ranks += entry[2 * r];
    if (r > 0 && entry[2 * r + 1] != entry[1]) differ.push_back(r);
  }
  // A rank that could not even check its arguments is the root cause: its message comes first.
  if (failed_ranks != 0) throw_agreed_failure(comm, what, failed_ranks, error, failed);
  if (differ.empty()) return;
  const std::vector<std::string> texts = gather_descriptions(comm, text);
  std::string ranks;
  for (const int r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  const int r = differ.front();
  TORCH_CHECK(false, what, ": the ranks disagree on ", subject, " (rank(s) ", ranks,
              " differ from rank 0; this is rank ", comm.rank(), " of ", world,
              "); first difference, ",
              first_different_entry(split_lines(texts[0]), split_lines(texts[r]), r), ". ", rule);
}

std::string exact_text(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}

}  // namespace fsdp_muon::detail
