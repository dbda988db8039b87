// save_checkpoint and load_checkpoint (docs/DESIGN.md §6): each a short sequence of steps that
// every rank runs and then agrees on, so that a failure on one rank fails the call on every rank
// instead of leaving the others waiting in a collective.

#include <fsdp_muon/checkpoint/checkpoint.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

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

namespace fsdp_muon {
namespace {

constexpr const char* kSaveApi = "fsdp_muon::save_checkpoint";
constexpr const char* kLoadApi = "fsdp_muon::load_checkpoint";

// The saved options of every param group ([optimizer][param group]), each parsed once into a
// copy of the live options, so that a bad archive fails the load here and not half-way through
// installing.
std::vector<std::vector<std::vector<char>>> checked_saved_options(
    const checkpoint::SavedMeta& saved, const std::vector<checkpoint::OptimizerEntry>& opts,
    const char* api) {
  std::vector<std::vector<std::vector<char>>> options;
  for (size_t o = 0; o < opts.size(); ++o) {
    options.push_back(saved.optimizers[o].options);
    const auto& live = opts[o].optimizer->param_groups();
    for (size_t j = 0; j < live.size(); ++j) {
      auto copy = live[j].options().clone();
      try {
        checkpoint::options_from_bytes(*copy, saved.optimizers[o].options[j]);
      } catch (...) {
        checkpoint::corrupt(saved.path,
                            "the options of optimizer " + std::to_string(o) + ", param group " +
                                std::to_string(j) +
                                " do not load: " + detail::current_exception_message(),
                            api);
      }
    }
  }
  return options;
}

}  // namespace

std::string save_checkpoint(const std::string& dir,
                            const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                            const std::vector<torch::optim::Optimizer*>& optimizers,
                            const SaveCheckpointOptions& options) {
  Communicator& comm = checkpoint::communicator_of(groups, kSaveApi);
  checkpoint::ModelIndex model;
  std::vector<checkpoint::OptimizerEntry> opts;
  detail::run_agreed(comm, kSaveApi, [&] {
    model = checkpoint::index_model(groups, kSaveApi);
    opts = checkpoint::index_optimizers(optimizers, model, kSaveApi);
  });
  // Rank 0 creates the folder and draws the save id; the agreed sum tells every rank both (the
  // id as two 63-bit halves, so the sum of rank 0's value and zeros cannot overflow).
  const std::vector<int64_t> agreed =
      detail::agree_on_sum(comm, kSaveApi, 3, [&](std::vector<int64_t>& mine) {
        if (comm.rank() != 0) return;
        mine[0] = checkpoint::create_checkpoint_folder(dir, kSaveApi);
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
  // Every rank writes its file and puts its size at its own index: the sum is every size.
  const std::vector<int64_t> rank_file_bytes =
      detail::agree_on_sum(comm, kSaveApi, comm.size(), [&](std::vector<int64_t>& mine) {
        mine[comm.rank()] = checkpoint::write_rank_file(folder, model, opts, save_id, kSaveApi);
      });
  // Only now that every rank file is in place may the manifest make the checkpoint complete.
  detail::run_agreed(comm, kSaveApi, [&] {
    if (comm.rank() != 0) return;
    checkpoint::publish_checkpoint(dir, sequence, save_id, model, opts, rank_file_bytes,
                                   options.user_state(), options.keep_last(), kSaveApi);
  });
  return folder;
}

CheckpointUserState load_checkpoint(const std::string& dir,
                                    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                                    const std::vector<torch::optim::Optimizer*>& optimizers) {
  Communicator& comm = checkpoint::communicator_of(groups, kLoadApi);
  checkpoint::ModelIndex model;
  std::vector<checkpoint::OptimizerEntry> opts;
  checkpoint::StagedRestore staged;
  CheckpointUserState user_state;
  detail::run_agreed(comm, kLoadApi, [&] {
    model = checkpoint::index_model(groups, kLoadApi);
    opts = checkpoint::index_optimizers(optimizers, model, kLoadApi);
    const checkpoint::FoundCheckpoint found = checkpoint::resolve_checkpoint(dir, kLoadApi);
    const std::string& folder = found.folder;
    const checkpoint::SavedMeta& saved = found.manifest;
    checkpoint::check_same_model(saved, model, kLoadApi);
    checkpoint::check_same_optimizers(saved, model, opts, kLoadApi);
    staged.options = checked_saved_options(saved, opts, kLoadApi);
    checkpoint::LoadPlan plan = checkpoint::plan_load(saved, model, opts, kLoadApi);
    checkpoint::read_planned(plan, saved, folder, kLoadApi);
    staged.weights = std::move(plan.weights);
    staged.states = std::move(plan.states);
    user_state = saved.user_state;
  });
  // Every rank has read everything it needs: only now does anything change.
  checkpoint::install_staged(model, opts, staged);
  return user_state;
}

}  // namespace fsdp_muon
