#include "optimizer/replica_check.h"

#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "common/check.h"

namespace fsdp_muon::detail {
namespace {

// The integer type of a dtype's bit pattern.
at::ScalarType bits_type(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1:
      return at::kByte;
    case 2:
      return at::kShort;
    case 4:
      return at::kInt;
    default:
      return at::kLong;
  }
}

}  // namespace

std::vector<std::vector<uint64_t>> shard_hashes(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups, Communicator& comm) {
  std::vector<at::Tensor> per_parameter;
  for (const auto& group : groups) {
    for (const at::Tensor& shard : group->sharded_parameters()) {
      const at::Tensor flat = shard.detach().contiguous().view(-1);
      if (flat.numel() == 0) {
        per_parameter.push_back(at::zeros({}, flat.options().dtype(at::kLong)));
        continue;
      }
      // Odd weights: a change d of one element changes the sum by d * odd, never 0 mod 2^64.
      const at::Tensor weight = at::arange(flat.numel(), flat.options().dtype(at::kLong))
                                    .mul_(0x9E3779B1ll)
                                    .mul_(2)
                                    .add_(1);
      per_parameter.push_back(flat.view(bits_type(flat)).to(at::kLong).mul_(weight).sum());
    }
  }
  std::vector<std::vector<uint64_t>> hashes;
  if (per_parameter.empty()) return hashes;
  const at::Tensor host = comm.to_host(at::stack(per_parameter));
  const int64_t* h = host.data_ptr<int64_t>();
  for (const auto& group : groups) {
    hashes.emplace_back(h, h + group->num_parameters());
    h += group->num_parameters();
  }
  return hashes;
}

std::pair<int64_t, int64_t> replica_entries(const std::vector<uint64_t>& parameter_hashes,
                                            int replica) {
  detail::StableHash combined;
  for (const uint64_t h : parameter_hashes) combined.add(h);
  const int64_t mixed = detail::mix40(combined.value());
  return {mixed, replica == 0 ? mixed : 0};
}

void throw_replica_divergence(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                              const DeviceMesh& mesh,
                              const std::vector<std::vector<uint64_t>>& hashes, int64_t step_call) {
  std::vector<std::string> mine;
  for (const auto& group_hashes : hashes) {
    for (const uint64_t h : group_hashes) mine.push_back(std::to_string(h));
  }
  Communicator& world = *mesh.world;
  const std::vector<std::string> texts = gather_descriptions(world, join_lines(mine));
  const int shard_size = mesh.shard->size();
  std::string where = "the hashes differ only in their 40-bit mix";
  int differing = 0;
  for (int r = shard_size; r < world.size(); ++r) {
    const std::vector<std::string> theirs = split_lines(texts[r]);
    const std::vector<std::string> zero = split_lines(texts[r % shard_size]);
    size_t k = 0;
    bool found = false;
    for (size_t g = 0; g < groups.size() && !found; ++g) {
      for (size_t i = 0; i < groups[g]->num_parameters() && !found; ++i, ++k) {
        if (k < theirs.size() && k < zero.size() && theirs[k] == zero[k]) continue;
        found = true;
        if (differing++ > 0) continue;
        std::ostringstream text;
        text << "replica " << r / shard_size << " (world rank " << r << ", shard rank "
             << r % shard_size << ") holds other weights than replica 0 (world rank "
             << r % shard_size << ") in parameter '" << groups[g]->slot(i).name << "' of group '"
             << groups[g]->name() << "'";
        where = text.str();
      }
    }
  }
  FSDP_MUON_CHECK(false, "the replicas' weights diverged before step() call ", step_call, ": ",
                  where,
                  differing > 1 ? " (and " + std::to_string(differing - 1) + " more rank(s) differ)"
                                : std::string(),
                  ". Every replica must hold the same shards: something changed the weights of one "
                  "replica only (an edit outside the optimizers, a load or import on some ranks, a "
                  "faulty device). Nothing was changed; reload the last checkpoint on every rank "
                  "(FsdpMuonConfig::check_replicas_every)");
}

}  // namespace fsdp_muon::detail
