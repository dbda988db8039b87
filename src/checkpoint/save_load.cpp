// save_checkpoint and load_checkpoint (docs/DESIGN.md §6): each a short sequence of steps that
// every rank runs and then agrees on, so that a failure on one rank fails the call on every rank
// instead of leaving the others waiting in a collective.

#include <fsdp_muon/checkpoint/checkpoint.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include <fsdp_muon/muon/muon_options.h>

#include "checkpoint/compatibility.h"
#include "checkpoint/file_io.h"
#include "checkpoint/folder.h"
#include "checkpoint/load_plan.h"
#include "checkpoint/metadata.h"
#include "checkpoint/model_index.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/rank_file.h"
#include "checkpoint/staged_restore.h"
#include "comm/agreement.h"
#include "common/check.h"
#include "fsdp/group_agreement.h"

namespace fsdp_muon {
namespace {

// The saved options of every param group ([optimizer][param group]), each parsed once into a
// copy of the live options, so that a bad archive fails the load here and not half-way through
// installing.
std::vector<std::vector<std::vector<char>>> checked_saved_options(
    const checkpoint::SavedMeta& saved, const std::vector<checkpoint::OptimizerEntry>& opts) {
  std::vector<std::vector<std::vector<char>>> options;
  for (size_t o = 0; o < opts.size(); ++o) {
    options.push_back(saved.optimizers[o].options);
    const auto& live = opts[o].optimizer->param_groups();
    for (size_t j = 0; j < live.size(); ++j) {
      auto copy = live[j].options().clone();
      try {
        checkpoint::options_from_bytes(*copy, saved.optimizers[o].options[j]);
      } catch (...) {
        checkpoint::corrupt(saved.path, "the options of optimizer " + std::to_string(o) +
                                            ", param group " + std::to_string(j) +
                                            " do not load: " + detail::current_exception_message());
      }
      // The layout decides which matrices exist: FsdpMuon planned its owners for the live one,
      // and single-device Muon would silently switch, so a different saved one is refused.
      const auto* saved_muon = dynamic_cast<const MuonOptions*>(copy.get());
      const auto* live_muon = dynamic_cast<const MuonOptions*>(&live[j].options());
      FSDP_MUON_CHECK(saved_muon == nullptr || live_muon == nullptr ||
                          saved_muon->matrix_layout() == live_muon->matrix_layout(),
                      "optimizer ", o, ", param group ", j, " was saved with matrix_layout ",
                      saved_muon ? saved_muon->matrix_layout().to_string() : "",
                      " but is now constructed with ",
                      live_muon ? live_muon->matrix_layout().to_string() : "", " in ", saved.path,
                      "; construct the optimizer with the saved layout to resume");
    }
  }
  return options;
}

// A save id as two non-negative 63-bit halves (new_save_id's values fit, see save_checkpoint),
// so that rank 0 can send it through a sum; {-1, -1} for a version 1 checkpoint, which has none.
std::pair<int64_t, int64_t> save_id_halves(const checkpoint::SavedMeta& saved) {
  if (saved.save_id.empty()) return {-1, -1};
  bool ok = saved.save_id.size() == 32;
  for (char ch : saved.save_id) ok = ok && std::isxdigit(static_cast<unsigned char>(ch)) != 0;
  uint64_t hi = 0, lo = 0;
  if (ok) {
    hi = std::stoull(saved.save_id.substr(0, 16), nullptr, 16);
    lo = std::stoull(saved.save_id.substr(16), nullptr, 16);
  }
  if (!ok || hi >> 63 || lo >> 63) {
    checkpoint::corrupt(saved.path,
                        "its save id '" + saved.save_id + "' is not one fsdp_muon writes");
  }
  return {static_cast<int64_t>(hi), static_cast<int64_t>(lo)};
}

std::string save_id_text(int64_t hi, int64_t lo) {
  if (hi < 0) return "";
  char id[40];
  std::snprintf(id, sizeof(id), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return id;
}

// "ckpt-000007" from its sequence number and its number of digits (as rank 0 found it).
std::string folder_name_with_digits(int64_t sequence, int64_t digits) {
  std::string number = std::to_string(sequence);
  if (static_cast<int64_t>(number.size()) < digits) {
    number.insert(0, static_cast<size_t>(digits) - number.size(), '0');
  }
  return "ckpt-" + number;
}

// Rank 0 resolves `dir` (the folder itself, or the checkpoint `latest` names) and every rank
// loads exactly that checkpoint, checked by its save id: a save that moves `latest` between
// two ranks' reads, or ranks given different folders (each its own latest_checkpoint()), must
// not make them load shards of different saves (docs/DESIGN.md §6).
checkpoint::FoundCheckpoint resolve_on_rank0(Communicator& comm, const std::string& dir) {
  checkpoint::FoundCheckpoint found;
  const std::vector<int64_t> agreed =
      detail::agree_on_sum(comm, 5, [&](std::vector<int64_t>& mine) {
        if (comm.rank() != 0) return;
        found = checkpoint::resolve_checkpoint(dir);
        const auto [hi, lo] = save_id_halves(found.manifest);
        mine[0] = found.name.empty() ? 1 : 2;
        if (!found.name.empty()) {  // "ckpt-<digits>", as find_checkpoint checked
          mine[1] = std::stoll(found.name.substr(5));
          mine[2] = static_cast<int64_t>(found.name.size()) - 5;
        }
        mine[3] = hi;
        mine[4] = lo;
      });
  const std::string id = save_id_text(agreed[3], agreed[4]);
  detail::run_agreed(comm, [&] {
    if (comm.rank() == 0) return;
    const bool itself = agreed[0] == 1;
    found.name = itself ? "" : folder_name_with_digits(agreed[1], agreed[2]);
    found.folder = itself ? dir : checkpoint::join_path(dir, found.name);
    const std::string rank0 = itself ? "rank 0 was given a checkpoint folder"
                                     : "rank 0 resolved " + dir + " to " + found.name;
    const std::string how =
        "every rank must load the same checkpoint (pass the same root to load_checkpoint on every "
        "rank, which resolves it once, rather than each rank's latest_checkpoint())";
    FSDP_MUON_CHECK(checkpoint::is_complete(found.folder), rank0, " (save ",
                    id.empty() ? "of format version 1" : id, "), but here ", found.folder,
                    " is not a complete checkpoint: ", how);
    found.manifest = checkpoint::read_manifest(found.folder);
    FSDP_MUON_CHECK(
        found.manifest.save_id == id, rank0, " of save ",
        id.empty() ? "(none: format version 1)" : id, ", but here ", found.folder, " is of save ",
        found.manifest.save_id.empty() ? "(none: format version 1)" : found.manifest.save_id, ": ",
        how);
  });
  return found;
}

}  // namespace

std::string save_checkpoint(const std::string& dir,
                            const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                            const std::vector<torch::optim::Optimizer*>& optimizers,
                            const SaveCheckpointOptions& options) {
  FSDP_MUON_API_SCOPE("save_checkpoint");
  // Every step agrees over the world: every rank of every replica (docs/DESIGN.md §6, Meshes).
  Communicator& comm = checkpoint::communicator_of(groups);
  checkpoint::ModelIndex model;
  std::vector<checkpoint::OptimizerEntry> opts;
  // Every rank describes what it is about to save; a rank that differs from rank 0 would make
  // rank 0's manifest describe its file wrongly, and the checkpoint would not load.
  detail::agree_on_arguments(
      comm, "what to save",
      "Every rank must pass the same groups and optimizers, in the same order; nothing was "
      "written",
      [&] {
        model = checkpoint::index_model(groups);
        opts = checkpoint::index_optimizers(optimizers, model);
        return checkpoint::describe_for_save(model, opts);
      });
  // Rank 0 creates the folder and draws the save id; the agreed sum tells every rank both (the
  // id as two 63-bit halves, so the sum of rank 0's value and zeros cannot overflow).
  const std::vector<int64_t> agreed =
      detail::agree_on_sum(comm, 3, [&](std::vector<int64_t>& mine) {
        if (comm.rank() != 0) return;
        mine[0] = checkpoint::create_checkpoint_folder(dir, model, opts, options.run_id());
        const std::string id = checkpoint::new_save_id();
        mine[1] = static_cast<int64_t>(std::stoull(id.substr(0, 16), nullptr, 16) >> 1);
        mine[2] = static_cast<int64_t>(std::stoull(id.substr(16), nullptr, 16) >> 1);
      });
  const int64_t sequence = agreed[0];
  char id[40];
  std::snprintf(id, sizeof(id), "%016llx%016llx", static_cast<unsigned long long>(agreed[1]),
                static_cast<unsigned long long>(agreed[2]));
  const std::string save_id = id;
  const std::string folder = checkpoint::join_path(dir, checkpoint::folder_name(sequence));
  // One copy: the file of shard rank s is written by replica s % replicas, which holds the same
  // bytes as every other replica (docs/DESIGN.md §6, Meshes), so the writes of one checkpoint are
  // spread over min(replicas, shard size) replicas (nodes) instead of all coming from one. The
  // writer puts its file's size at its shard rank's index: the sum over the world is every size.
  // On a 1-D mesh every rank writes its own file, as before meshes.
  const int shard_rank = model.comm->rank();
  const bool writer = shard_rank % model.mesh.replicas() == model.mesh.replica();
  const std::vector<int64_t> rank_file_bytes =
      detail::agree_on_sum(comm, model.comm->size(), [&](std::vector<int64_t>& mine) {
        if (!writer) return;
        mine[shard_rank] = checkpoint::write_rank_file(folder, model, opts, save_id);
      });
  // Only now that every rank file is in place may the manifest make the checkpoint complete.
  detail::run_agreed(comm, [&] {
    if (comm.rank() != 0) return;
    checkpoint::publish_checkpoint(dir, sequence, save_id, model, opts, rank_file_bytes,
                                   options.user_state(), options.run_id(), options.keep_last());
  });
  return folder;
}

CheckpointUserState load_checkpoint(const std::string& dir,
                                    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                                    const std::vector<torch::optim::Optimizer*>& optimizers) {
  FSDP_MUON_API_SCOPE("load_checkpoint");
  // Agreed over the world; every rank reads the saved bytes of what its shard rank holds, so the
  // replicas read the same bytes and install the same bits (docs/DESIGN.md §6, Meshes).
  Communicator& comm = checkpoint::communicator_of(groups);
  checkpoint::ModelIndex model;
  std::vector<checkpoint::OptimizerEntry> opts;
  checkpoint::StagedRestore staged;
  CheckpointUserState user_state;
  detail::agree_on_arguments(
      comm, "what to load into",
      "Every rank must pass the same groups and optimizers, in the same order; nothing was read",
      [&] {
        model = checkpoint::index_model(groups);
        opts = checkpoint::index_optimizers(optimizers, model);
        return checkpoint::describe_for_save(model, opts, /*with_state=*/false);
      });
  const checkpoint::FoundCheckpoint found = resolve_on_rank0(comm, dir);
  detail::run_agreed(comm, [&] {
    const std::string& folder = found.folder;
    const checkpoint::SavedMeta& saved = found.manifest;
    checkpoint::check_same_model(saved, model);
    checkpoint::check_same_optimizers(saved, model, opts);
    staged.options = checked_saved_options(saved, opts);
    checkpoint::LoadPlan plan = checkpoint::plan_load(saved, model, opts);
    checkpoint::read_planned(plan, saved, folder);
    staged.weights = std::move(plan.weights);
    staged.states = std::move(plan.states);
    user_state = saved.user_state;
  });
  // Every rank has read everything it needs: only now does anything change.
  checkpoint::install_staged(model, opts, staged);
  return user_state;
}

}  // namespace fsdp_muon
