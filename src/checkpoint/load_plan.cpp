#include "checkpoint/load_plan.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "checkpoint/rank_file.h"
#include "common/check.h"
#include "muon/row_state.h"

namespace fsdp_muon::checkpoint {
namespace {

using ReadsBySavedRank = std::map<int, std::vector<RangeRead>>;

// Elements [first, last) of `param` that saved rank `rank` held.
std::pair<int64_t, int64_t> saved_held_range(const SavedGroup& group, const SavedParam& param,
                                             int rank) {
  const int64_t s = group.shard_numel;
  const int64_t first = std::clamp<int64_t>(rank * s - param.offset, 0, param.numel);
  const int64_t last = std::clamp<int64_t>((rank + 1) * s - param.offset, 0, param.numel);
  return {first, std::max(first, last)};
}

// Adds the reads that fill `dst` with entries [first, first + dst.numel()) of saved parameter
// `name`'s state `key` from every saved rank that kept some of them. An entry is one element
// (unit 1: elementwise state, weights) or one row of `unit` elements (row state: a rank keeps
// the rows whose first element it holds, detail::rows_starting_in, which is the element range
// itself for unit 1).
void plan_range(const SavedMeta& saved, const std::string& name, const std::string& key,
                int64_t first, const at::Tensor& dst, ReadsBySavedRank& reads, int64_t unit = 1) {
  const auto [group_index, param_index] = saved.by_name.at(name);
  const SavedGroup& group = saved.groups[group_index];
  const SavedParam& param = group.params[param_index];
  const int64_t end = first + dst.numel();
  if (first == end) return;
  const int64_t s = group.shard_numel;
  // The saved ranks whose elements hold the first elements of entries [first, end).
  const int lo = static_cast<int>((param.offset + first * unit) / s);
  const int hi = static_cast<int>((param.offset + (end - 1) * unit) / s);
  for (int r = lo; r <= hi; ++r) {
    const auto [held_first, held_end] =
        detail::rows_starting_in(saved_held_range(group, param, r), unit);
    const int64_t a = std::max(first, held_first);
    const int64_t b = std::min(end, held_end);
    if (a >= b) continue;
    reads[r].push_back({key, a - held_first, b - a, dst.narrow(0, a - first, b - a)});
  }
}

at::Tensor held_buffer(const FsdpParameterGroup& group, size_t index) {
  const auto [a, b] = group.held_range(index);
  return at::empty({b - a}, at::TensorOptions().dtype(group.main_dtype()));
}

std::vector<std::vector<at::Tensor>> plan_weights(const SavedMeta& saved, const ModelIndex& model,
                                                  ReadsBySavedRank& reads) {
  std::vector<std::vector<at::Tensor>> weights;
  for (const auto& group : model.groups) {
    std::vector<at::Tensor> per_param;
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const std::string& name = group->slot(i).name;
      at::Tensor dst = held_buffer(*group, i);
      plan_range(saved, name, weight_entry_key(name), group->held_range(i).first, dst, reads);
      per_param.push_back(dst);
    }
    weights.push_back(std::move(per_param));
  }
  return weights;
}

// The state of optimizer `o` per parameter, param groups flattened.
std::vector<std::optional<ParamState>> plan_optimizer_state(const SavedMeta& saved,
                                                            const ModelIndex& model,
                                                            const std::vector<OptimizerEntry>& opts,
                                                            size_t o, ReadsBySavedRank& reads) {
  const SavedOptimizer& saved_opt = saved.optimizers[o];
  const auto& known = state_keys(opts[o].kind);
  std::vector<std::optional<ParamState>> states;
  for (const auto& refs : opts[o].param_groups) {
    for (const ParamRef& ref : refs) {
      const auto& group = model.groups[ref.group];
      const std::string& name = group->slot(ref.index).name;
      ParamState state;
      auto it = saved_opt.state.find(name);
      if (it != saved_opt.state.end()) {
        state.present = true;
        state.step = it->second.step;
        for (const std::string& key : it->second.keys) {
          FSDP_MUON_CHECK(std::find(known.begin(), known.end(), key) != known.end(), saved.path,
                          " has optimizer state '", key, "' for '", name, "', which a ",
                          saved_opt.kind, " optimizer does not keep");
          if (is_row_state(opts[o].kind, key)) {
            const ParameterSlot& slot = group->slot(ref.index);
            FSDP_MUON_CHECK(slot.shape.size() >= 2, saved.path, " has row state '", key, "' for '",
                            name, "', which is not a matrix");
            const int64_t cols = detail::row_state_cols(slot.shape);
            const auto [first, last] = detail::rows_starting_in(group->held_range(ref.index), cols);
            at::Tensor dst =
                at::empty({last - first}, at::TensorOptions().dtype(group->main_dtype()));
            plan_range(saved, name, state_entry_key(o, name, key), first, dst, reads, cols);
            state.tensors.emplace_back(key, dst);
            continue;
          }
          at::Tensor dst = held_buffer(*group, ref.index);
          plan_range(saved, name, state_entry_key(o, name, key), group->held_range(ref.index).first,
                     dst, reads);
          state.tensors.emplace_back(key, dst);
        }
      }
      states.push_back(std::move(state));
    }
  }
  return states;
}

}  // namespace

LoadPlan plan_load(const SavedMeta& saved, const ModelIndex& model,
                   const std::vector<OptimizerEntry>& opts) {
  LoadPlan plan;
  plan.weights = plan_weights(saved, model, plan.reads_by_saved_rank);
  for (size_t o = 0; o < opts.size(); ++o) {
    plan.states.push_back(plan_optimizer_state(saved, model, opts, o, plan.reads_by_saved_rank));
  }
  return plan;
}

void read_planned(const LoadPlan& plan, const SavedMeta& saved, const std::string& folder) {
  for (const auto& [rank, reads] : plan.reads_by_saved_rank) {
    const RankFile file = open_rank_file(saved, folder, rank);
    for (const RangeRead& read : reads) {
      read_entry_range(file, read.key, read.first, read.count, read.dst);
    }
  }
}

}  // namespace fsdp_muon::checkpoint
