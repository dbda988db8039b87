// export_full_checkpoint: one file of full tensors by parameter name, in LibTorch's pickle
// format, so that Python's torch.load reads it (docs/DESIGN.md §6).

#include <fsdp_muon/checkpoint/checkpoint.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>

#include "checkpoint/compatibility.h"
#include "checkpoint/file_io.h"
#include "checkpoint/model_index.h"
#include "checkpoint/optimizer_state.h"
#include "comm/agreement.h"
#include "common/check.h"
#include "muon/row_state.h"

namespace fsdp_muon {
namespace {

using checkpoint::ModelIndex;
using checkpoint::OptimizerEntry;
using checkpoint::OptimizerKind;
using checkpoint::ParamRef;
using checkpoint::ParamState;

// Full state tensors ("<name>.<key>", "<name>.step") by parameter name, in the order the file
// lists them after the parameter's weights.
using StateByParam =
    std::unordered_map<std::string, std::vector<std::pair<std::string, at::Tensor>>>;

// What all ranks know about one parameter's optimizer state once they have pooled theirs: a rank
// that holds none of a parameter may have no state for it, but any rank's answer stands for all.
struct PooledStateInfo {
  bool present = false;
  int64_t step = 0;
  std::vector<bool> has_key;  // per state_keys(kind)
};

// The full parameter `slot` out of a gathered flat group buffer.
at::Tensor full_parameter(const at::Tensor& gathered, const ParameterSlot& slot) {
  return gathered.narrow(0, slot.offset, slot.numel).view(slot.shape).clone();
}

// Rank 0: every parameter's full main weights, [group][param]; other ranks: empty lists. One
// all-gather of the main-weight shards per group.
std::vector<std::vector<at::Tensor>> gather_full_weights(const ModelIndex& model,
                                                         Communicator& comm) {
  std::vector<std::vector<at::Tensor>> weights(model.groups.size());
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    const at::Tensor& shard = group->main_weight_shard();
    at::Tensor full = at::empty({group->padded_numel()}, shard.options());
    comm.all_gather(shard.contiguous(), full);
    if (comm.rank() != 0) continue;
    full = comm.to_host(full);  // bounded by the communicator's timeout (docs/DESIGN.md §5)
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      weights[g].push_back(full_parameter(full, group->slot(i)));
    }
  }
  return weights;
}

// One all-reduce (max) of every parameter's [present, step, has key...]: the step is the same
// on every rank that has state, and zero elsewhere.
std::vector<PooledStateInfo> pool_state_info(const std::vector<ParamState>& local,
                                             const std::vector<std::string>& keys,
                                             Communicator& comm) {
  const int64_t n = static_cast<int64_t>(local.size());
  const int64_t width = 2 + static_cast<int64_t>(keys.size());
  at::Tensor packed = at::zeros({n * width}, at::kLong);
  int64_t* row = packed.data_ptr<int64_t>();
  for (const ParamState& state : local) {
    if (state.present) {
      row[0] = 1;
      row[1] = state.step;
      for (const auto& [key, t] : state.tensors) {
        row[2 + (std::find(keys.begin(), keys.end(), key) - keys.begin())] = 1;
      }
    }
    row += width;
  }
  if (n > 0) {
    at::Tensor reduced = comm.to_device(packed);
    comm.all_reduce(reduced, ReduceOp::kMax);
    packed = comm.to_host(reduced);
  }
  std::vector<PooledStateInfo> pooled(local.size());
  row = packed.data_ptr<int64_t>();
  for (PooledStateInfo& info : pooled) {
    info.present = row[0] != 0;
    info.step = row[1];
    for (size_t k = 0; k < keys.size(); ++k) info.has_key.push_back(row[2 + k] != 0);
    row += width;
  }
  return pooled;
}

// The rows of a parameter's row state that `rank` keeps (docs/DESIGN.md §6); none for a vector.
std::pair<int64_t, int64_t> held_rows(const FsdpParameterGroup& group, size_t index, int rank) {
  return detail::rows_starting_in(group.held_range(index, rank),
                                  detail::row_state_cols(group.slot(index).shape));
}

// Rank 0: appends "<name>.<key>" for every parameter of group `g` that has state tensor `key`.
// One all-gather of a shard-shaped buffer that holds this rank's slices of that state. Row state
// (is_row_state) has at most as many rows on a rank as elements, so its rows go where the
// rank's elements of the parameter start, and rank 0 concatenates them in rank order.
void gather_state_key(const ModelIndex& model, size_t g, const std::vector<ParamRef>& refs,
                      const std::vector<ParamState>& local,
                      const std::vector<PooledStateInfo>& pooled, size_t key_index,
                      const std::string& key, OptimizerKind kind, Communicator& comm,
                      StateByParam& out) {
  const auto& group = model.groups[g];
  const bool rows = checkpoint::is_row_state(kind, key);
  at::Tensor buffer = at::zeros({group->shard_numel()}, group->main_weight_shard().options());
  for (size_t k = 0; k < refs.size(); ++k) {
    if (refs[k].group != g) continue;
    for (const auto& [state_key, t] : local[k].tensors) {
      if (state_key != key || t.numel() == 0) continue;
      const auto [first, last] = held_rows(*group, refs[k].index, comm.rank());
      const int64_t expected = rows ? last - first : model.shard(refs[k]).numel();
      FSDP_MUON_CHECK(t.numel() == expected, "state '", key, "' of '", model.slot(refs[k]).name,
                      "' has ", t.numel(), " elements on this rank, not ", expected);
      buffer.narrow(0, group->shard_offset(refs[k].index, comm.rank()), t.numel())
          .copy_(t.reshape({-1}));
    }
  }
  at::Tensor full = at::empty({group->padded_numel()}, buffer.options());
  comm.all_gather(buffer, full);
  if (comm.rank() != 0) return;
  full = comm.to_host(full);
  for (size_t k = 0; k < refs.size(); ++k) {
    if (refs[k].group != g || !pooled[k].has_key[key_index]) continue;
    const ParameterSlot& slot = model.slot(refs[k]);
    if (!rows) {
      out[slot.name].emplace_back(slot.name + "." + key, full_parameter(full, slot));
      continue;
    }
    at::Tensor per_row = at::empty({detail::row_state_rows(slot.shape)}, full.options());
    for (int r = 0; r < comm.size(); ++r) {
      const auto [first, last] = held_rows(*group, refs[k].index, r);
      if (first == last) continue;
      const int64_t from = slot.offset + group->held_range(refs[k].index, r).first;
      per_row.narrow(0, first, last - first).copy_(full.narrow(0, from, last - first));
    }
    out[slot.name].emplace_back(slot.name + "." + key, per_row);
  }
}

// Rank 0: appends the full state of every parameter of `opt`. Every rank takes part in the same
// collectives, decided from the pooled information only.
void gather_full_state(const ModelIndex& model, const OptimizerEntry& opt, Communicator& comm,
                       StateByParam& out) {
  const auto& keys = checkpoint::state_keys(opt.kind);
  std::vector<ParamRef> refs;
  for (const auto& pg : opt.param_groups) refs.insert(refs.end(), pg.begin(), pg.end());
  std::vector<ParamState> local;
  for (const ParamRef& ref : refs) local.push_back(checkpoint::read_state(opt, model.shard(ref)));
  const std::vector<PooledStateInfo> pooled = pool_state_info(local, keys, comm);
  for (size_t g = 0; g < model.groups.size(); ++g) {
    for (size_t kk = 0; kk < keys.size(); ++kk) {
      bool any = false;
      for (size_t k = 0; k < refs.size(); ++k) any |= refs[k].group == g && pooled[k].has_key[kk];
      if (any) gather_state_key(model, g, refs, local, pooled, kk, keys[kk], opt.kind, comm, out);
    }
  }
  if (comm.rank() != 0 || !checkpoint::has_step(opt.kind)) return;
  for (size_t k = 0; k < refs.size(); ++k) {
    if (!pooled[k].present) continue;
    const std::string& name = model.slot(refs[k]).name;
    out[name].emplace_back(name + ".step", at::scalar_tensor(pooled[k].step, at::kLong));
  }
}

void insert_unique(c10::Dict<std::string, at::Tensor>& out, const std::string& key,
                   const at::Tensor& t) {
  FSDP_MUON_CHECK(!out.contains(key), "two tensors would be named '", key,
                  "'; rename the parameter that clashes");
  out.insert(key, t);
}

// Rank 0. The file lists, in model order, each parameter's weights followed by its state: it
// reads like the model.
void write_export(const std::string& path, const ModelIndex& model,
                  const std::vector<std::vector<at::Tensor>>& weights, const StateByParam& state) {
  c10::Dict<std::string, at::Tensor> out;
  for (size_t g = 0; g < model.groups.size(); ++g) {
    for (size_t i = 0; i < model.groups[g]->num_parameters(); ++i) {
      const std::string& name = model.groups[g]->slot(i).name;
      insert_unique(out, name, weights[g][i]);
      auto it = state.find(name);
      if (it == state.end()) continue;
      for (const auto& [key, t] : it->second) insert_unique(out, key, t);
    }
  }
  const auto slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0) checkpoint::make_directories(path.substr(0, slash));
  const std::vector<char> bytes = checkpoint::pickle_save_plain(c10::IValue(out));
  checkpoint::write_file_atomic(path, {{bytes.data(), bytes.size()}});
}

}  // namespace

void export_full_checkpoint(const std::string& path,
                            const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                            const std::vector<torch::optim::Optimizer*>& optimizers) {
  FSDP_MUON_API_SCOPE("export_full_checkpoint");
  Communicator& world = checkpoint::communicator_of(groups);
  ModelIndex model;
  std::vector<OptimizerEntry> opts;
  // Rank 0 writes what every rank gathers in the order of its own arguments: a rank that passed
  // the groups or optimizers in another order would put its shards under other names.
  detail::agree_on_arguments(
      world, "what to export",
      "Every rank must pass the same path, groups and optimizers, in the same order; nothing was "
      "written",
      [&] {
        model = checkpoint::index_model(groups);
        opts = checkpoint::index_optimizers(optimizers, model);
        std::vector<std::string> lines = checkpoint::describe_for_save(model, opts);
        lines.insert(lines.begin(), "path = " + path);
        return lines;
      });
  // The replicas hold the same shards: replica 0 gathers them over its shard group and its shard
  // rank 0 (world rank 0) writes; the other replicas only take part in the agreement.
  std::vector<std::vector<at::Tensor>> weights;
  StateByParam state;
  if (model.mesh.replica() == 0) {
    Communicator& comm = *model.comm;
    weights = gather_full_weights(model, comm);
    for (const OptimizerEntry& opt : opts) gather_full_state(model, opt, comm, state);
  }
  detail::run_agreed(world, [&] {
    if (world.rank() == 0) write_export(path, model, weights, state);
  });
}

}  // namespace fsdp_muon
