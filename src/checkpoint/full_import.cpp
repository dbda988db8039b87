// import_full_checkpoint: reads a file of full tensors by parameter name (an export, or a dict
// Python saved with torch.save) on every rank, each rank keeping the slices it holds
// (docs/DESIGN.md §6).

#include <fsdp_muon/checkpoint/checkpoint.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include "checkpoint/compatibility.h"
#include "checkpoint/file_io.h"
#include "checkpoint/model_index.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/staged_restore.h"
#include "comm/agreement.h"
#include "common/check.h"
#include "muon/row_state.h"

namespace fsdp_muon {
namespace {

using checkpoint::ModelIndex;
using checkpoint::OptimizerEntry;
using checkpoint::ParamRef;
using checkpoint::ParamState;

using TensorsByName = std::unordered_map<std::string, at::Tensor>;

// "'a', 'b', 'c'": the first `limit` names.
std::string quoted_names(const std::vector<std::string>& names, size_t limit) {
  std::string list;
  for (size_t k = 0; k < std::min(names.size(), limit); ++k) {
    list += (k ? ", '" : "'") + names[k] + "'";
  }
  return list;
}

// Elements [first, last) of the flattened `full`, contiguous on the CPU.
at::Tensor held_slice(const at::Tensor& full, int64_t first, int64_t last) {
  return full.reshape({-1}).slice(0, first, last).to(at::kCPU).contiguous();
}

TensorsByName read_tensor_dict(const std::vector<char>& bytes, const std::string& path,
                               bool strict) {
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (...) {
    FSDP_MUON_CHECK(false, path, " is not a readable torch.save / pickle file (", bytes.size(),
                    " bytes; truncated or corrupt?): ", detail::current_exception_message());
  }
  FSDP_MUON_CHECK(value.isGenericDict(), path, " holds a ", value.tagKind(),
                  ", not a dict of tensors by parameter name");
  TensorsByName tensors;
  for (const auto& item : value.toGenericDict()) {
    FSDP_MUON_CHECK(item.key().isString(), path, " has a key that is not a string");
    if (!item.value().isTensor()) {
      FSDP_MUON_CHECK(!strict, path, " entry '", item.key().toStringRef(), "' is a ",
                      item.value().tagKind(), ", not a tensor (pass strict(false) to ignore it)");
      continue;
    }
    // On the host from here on: a file saved from CUDA tensors loads onto the GPU, and reading
    // those later (.item(), slices) would wait on a stream that collectives may occupy by then.
    tensors.emplace(item.key().toStringRef(), item.value().toTensor().to(at::kCPU));
  }
  return tensors;
}

// This rank's slice of every parameter's weights, [group][param]; every parameter must be in
// the file with its shape.
std::vector<std::vector<at::Tensor>> slice_weights(const TensorsByName& tensors,
                                                   const ModelIndex& model, const std::string& path,
                                                   std::set<std::string>& used) {
  std::vector<std::vector<at::Tensor>> weights;
  for (const auto& group : model.groups) {
    std::vector<at::Tensor> per_param;
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const ParameterSlot& slot = group->slot(i);
      auto it = tensors.find(slot.name);
      FSDP_MUON_CHECK(it != tensors.end(), path, " has no tensor '", slot.name, "' (parameter ", i,
                      " of group '", group->name(), "', shape ",
                      c10::str(c10::IntArrayRef(slot.shape)), ")");
      FSDP_MUON_CHECK(it->second.sizes().vec() == slot.shape, path, " tensor '", slot.name,
                      "' has shape ", c10::str(c10::IntArrayRef(it->second.sizes())),
                      " but the parameter has shape ", c10::str(c10::IntArrayRef(slot.shape)));
      used.insert(slot.name);
      const auto [a, b] = group->held_range(i);
      per_param.push_back(held_slice(it->second, a, b));
    }
    weights.push_back(std::move(per_param));
  }
  return weights;
}

// A state the file has for a parameter must be complete: every tensor the optimizer would have
// created for it under its param group's options, and the step where the optimizer counts one.
void check_state_complete(const TensorsByName& tensors, const OptimizerEntry& opt,
                          const torch::optim::OptimizerOptions& group_options,
                          const std::string& name, bool has_step_tensor, const std::string& path) {
  std::vector<std::string> missing;
  for (const std::string& key : checkpoint::required_state_keys(opt.kind, group_options)) {
    if (!tensors.count(name + "." + key)) missing.push_back(name + "." + key);
  }
  if (checkpoint::has_step(opt.kind) && !has_step_tensor) missing.push_back(name + ".step");
  FSDP_MUON_CHECK(missing.empty(), path, " has optimizer state of '", name, "' for a ",
                  checkpoint::kind_name(opt.kind), " optimizer but lacks ",
                  quoted_names(missing, missing.size()),
                  " (pass optimizer_state(false) to import weights only)");
}

// The state to install for one parameter, or nullopt to keep the live one (the file has none
// for it, or optimizer state is not imported). Marks the tensors it accounts for as used.
std::optional<ParamState> import_param_state(const TensorsByName& tensors, const ModelIndex& model,
                                             const OptimizerEntry& opt, const ParamRef& ref,
                                             const torch::optim::OptimizerOptions& group_options,
                                             const ImportCheckpointOptions& options,
                                             const std::string& path, std::set<std::string>& used) {
  const ParameterSlot& slot = model.slot(ref);
  std::vector<std::string> found;
  for (const std::string& key : checkpoint::state_keys(opt.kind)) {
    if (tensors.count(slot.name + "." + key)) found.push_back(key);
  }
  const std::string step_name = slot.name + ".step";
  const bool has_step_tensor = tensors.count(step_name) > 0;
  if (found.empty() && !has_step_tensor) return std::nullopt;
  for (const std::string& key : found) used.insert(slot.name + "." + key);
  if (has_step_tensor) used.insert(step_name);
  if (!options.optimizer_state()) return std::nullopt;

  check_state_complete(tensors, opt, group_options, slot.name, has_step_tensor, path);
  ParamState state;
  state.present = true;
  if (has_step_tensor) {
    const at::Tensor& s = tensors.at(step_name);
    FSDP_MUON_CHECK(s.numel() == 1, path, " tensor '", step_name, "' has ", s.numel(),
                    " elements, expected 1");
    state.step = static_cast<int64_t>(s.item<double>());
  }
  const auto [a, b] = model.groups[ref.group]->held_range(ref.index);
  for (const std::string& key : found) {
    const at::Tensor& t = tensors.at(slot.name + "." + key);
    if (checkpoint::is_row_state(opt.kind, key)) {
      // One value per row; this rank keeps the rows whose first element it holds.
      const bool matrix = slot.shape.size() >= 2;
      const int64_t rows = detail::row_state_rows(slot.shape);
      FSDP_MUON_CHECK(matrix && t.dim() == 1 && t.size(0) == rows, path, " tensor '", slot.name,
                      ".", key, "' has shape ", c10::str(c10::IntArrayRef(t.sizes())),
                      " but the parameter has shape ", c10::str(c10::IntArrayRef(slot.shape)),
                      matrix ? " (one value per row expected: " + std::to_string(rows) + ")"
                             : std::string(" (not a matrix)"));
      const auto [first, last] =
          detail::rows_starting_in({a, b}, detail::row_state_cols(slot.shape));
      state.tensors.emplace_back(key, held_slice(t, first, last));
      continue;
    }
    FSDP_MUON_CHECK(t.sizes().vec() == slot.shape, path, " tensor '", slot.name, ".", key,
                    "' has shape ", c10::str(c10::IntArrayRef(t.sizes())),
                    " but the parameter has shape ", c10::str(c10::IntArrayRef(slot.shape)));
    state.tensors.emplace_back(key, held_slice(t, a, b));
  }
  return state;
}

// [optimizer][flat param]: the state import_param_state decides for each parameter.
std::vector<std::vector<std::optional<ParamState>>> import_states(
    const TensorsByName& tensors, const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
    const ImportCheckpointOptions& options, const std::string& path, std::set<std::string>& used) {
  std::vector<std::vector<std::optional<ParamState>>> states;
  for (const OptimizerEntry& opt : opts) {
    std::vector<std::optional<ParamState>> per_param;
    const auto& live = opt.optimizer->param_groups();
    for (size_t j = 0; j < opt.param_groups.size(); ++j) {
      for (const ParamRef& ref : opt.param_groups[j]) {
        per_param.push_back(
            import_param_state(tensors, model, opt, ref, live[j].options(), options, path, used));
      }
    }
    states.push_back(std::move(per_param));
  }
  return states;
}

void check_all_used(const TensorsByName& tensors, const std::set<std::string>& used,
                    const std::string& path) {
  std::vector<std::string> extra;
  for (const auto& [key, t] : tensors) {
    if (!used.count(key)) extra.push_back(key);
  }
  if (extra.empty()) return;
  std::sort(extra.begin(), extra.end());
  FSDP_MUON_CHECK(false, path, " has ", extra.size(),
                  " tensor(s) that name no parameter of this model or state of its optimizers: ",
                  quoted_names(extra, 8), extra.size() > 8 ? ", ..." : "",
                  " (pass strict(false) to ignore them)");
}

}  // namespace

void import_full_checkpoint(const std::string& path,
                            const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                            const std::vector<torch::optim::Optimizer*>& optimizers,
                            const ImportCheckpointOptions& options) {
  FSDP_MUON_API_SCOPE("import_full_checkpoint");
  Communicator& comm = checkpoint::communicator_of(groups);
  ModelIndex model;
  std::vector<OptimizerEntry> opts;
  checkpoint::StagedRestore staged;
  // The path may differ (a copy on each node's disk), the file may not: every rank names it by
  // its size and CRC-32, and a rank that read other bytes fails the import everywhere before
  // anything changes, instead of building a model mixed from two files.
  detail::agree_on_arguments(
      comm, "what to import",
      "Every rank must read the same file (its path may differ) into the same groups and "
      "optimizers, in the same order, with the same options; nothing was changed",
      [&] {
        model = checkpoint::index_model(groups);
        opts = checkpoint::index_optimizers(optimizers, model);
        const std::vector<char> bytes = checkpoint::read_whole_file(path);
        const TensorsByName tensors = read_tensor_dict(bytes, path, options.strict());
        std::set<std::string> used;
        staged.weights = slice_weights(tensors, model, path, used);
        staged.states = import_states(tensors, model, opts, options, path, used);
        if (options.strict()) check_all_used(tensors, used, path);
        std::vector<std::string> lines =
            checkpoint::describe_for_save(model, opts, /*with_state=*/false);
        char crc[16];
        std::snprintf(crc, sizeof(crc), "%08x", checkpoint::crc32(bytes.data(), bytes.size()));
        lines.push_back("file = " + std::to_string(bytes.size()) + " bytes, CRC-32 " + crc);
        lines.push_back(std::string("optimizer_state = ") +
                        (options.optimizer_state() ? "true" : "false"));
        lines.push_back(std::string("strict = ") + (options.strict() ? "true" : "false"));
        return lines;
      });
  // Every rank has what it needs: only now does anything change.
  checkpoint::install_staged(model, opts, staged);
}

}  // namespace fsdp_muon
