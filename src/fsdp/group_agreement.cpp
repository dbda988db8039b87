#include "fsdp/group_agreement.h"

#include <algorithm>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "common/check.h"

namespace fsdp_muon::fsdp {

// What a rank built, one line per item: "ok", the options with the mesh shape (replicas x shard
// size), then each parameter in order; or
// "error" and this rank's own validation message. Every rank must build the same group
// (docs/DESIGN.md §2), and comparing these lines across ranks is how they agree before the
// group's first collective. Devices are left out: NCCL ranks each use their own GPU.
std::vector<std::string> describe_group(
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const FsdpParameterGroupOptions& o, const std::string& mesh_shape) {
  auto dtype = [](const std::optional<c10::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("default");
  };
  std::ostringstream opts;
  opts << "options: name '" << o.name() << "', compute_dtype " << dtype(o.compute_dtype())
       << ", main_dtype " << c10::toString(o.main_dtype()) << ", reduce_dtype "
       << dtype(o.reduce_dtype()) << ", alignment_bytes " << o.alignment_bytes()
       << ", broadcast_from_rank0 " << (o.broadcast_from_rank0() ? "true" : "false")
       << ", sharding_strategy " << to_string(o.sharding_strategy()) << ", prefetch "
       << (o.prefetch() ? "true" : "false") << ", mesh " << mesh_shape;
  std::vector<std::string> lines{"ok", opts.str()};
  for (const auto& [name, t] : params) {
    std::ostringstream line;
    line << "'" << name << "' " << t.sizes() << " " << t.scalar_type();
    lines.push_back(line.str());
  }
  return lines;
}

// "rank 0 has <a>, rank r has <b>" for the first line where rank r's description differs from
// rank 0's.
std::string first_difference(const std::vector<std::string>& zero,
                             const std::vector<std::string>& other, int r) {
  const std::string theirs = "rank " + std::to_string(r);
  if (zero.empty() || zero[0] != "ok" || other.empty() || other[0] != "ok") {
    for (const auto& [who, lines] :
         {std::pair<std::string, const std::vector<std::string>*>{"rank 0", &zero},
          {theirs, &other}}) {
      if (!lines->empty() && (*lines)[0] == "error") {
        return who + " could not build its group: " + (lines->size() > 1 ? (*lines)[1] : "");
      }
    }
    return "the ranks' descriptions are unreadable";
  }
  if (zero[1] != other[1]) {
    return "rank 0 has " + zero[1] + "; " + theirs + " has " + other[1];
  }
  const size_t n0 = zero.size() - 2;
  const size_t n1 = other.size() - 2;
  for (size_t i = 0; i < std::max(n0, n1); ++i) {
    const std::string a = i < n0 ? zero[i + 2] : "no parameter";
    const std::string b = i < n1 ? other[i + 2] : "no parameter";
    if (a != b) {
      return "parameter #" + std::to_string(i) + ": rank 0 has " + a + ", " + theirs + " has " + b +
             " (rank 0 has " + std::to_string(n0) + " parameters, " + theirs + " " +
             std::to_string(n1) + ")";
    }
  }
  return "the descriptions differ only in their hash";
}

void agree_on_group(Communicator& comm, const std::vector<std::string>& description,
                    const std::string& who) {
  const std::string text = detail::join_lines(description);
  const std::vector<int> differ = detail::ranks_that_differ(comm, text);
  if (!differ.empty()) {
    const std::vector<std::string> texts = detail::gather_descriptions(comm, text);
    std::string ranks;
    for (const int r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    const int r = differ.front();
    FSDP_MUON_CHECK(
        false, who, "the ranks built different groups (rank", differ.size() > 1 ? "s " : " ", ranks,
        " differ", differ.size() > 1 ? "" : "s", " from rank 0; this is rank ", comm.rank(), " of ",
        comm.size(), "); first difference, ",
        first_difference(detail::split_lines(texts[0]), detail::split_lines(texts[r]), r),
        ". Every rank must build the same group: the same parameters, names, shapes and "
        "dtypes in the same order, and the same options");
  }
  // Every rank failed alike (or this is a world of one): the local message is the error.
  TORCH_CHECK(description[0] == "ok", description[1]);
}

}  // namespace fsdp_muon::fsdp
