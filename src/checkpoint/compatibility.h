#pragma once
// Whether a saved checkpoint fits the live model and optimizers, checked before anything is
// read: errors list what differs (parameter names and shapes, optimizer kinds and param groups),
// so a user can tell "another model" from "another optimizer set-up".

#include <string>
#include <vector>

#include "checkpoint/metadata.h"
#include "checkpoint/model_index.h"

namespace fsdp_muon::checkpoint {

// Parameters are matched by name: every live one must be saved with the same shape, and every
// saved one must be live.
void check_same_model(const SavedMeta& saved, const ModelIndex& model);

// The same optimizers in the same order: kinds, param groups and their parameters.
void check_same_optimizers(const SavedMeta& saved, const ModelIndex& model,
                           const std::vector<OptimizerEntry>& opts);

// Why the saved checkpoint is of another job than a save of `model` and `opts` under `run_id`
// (SaveCheckpointOptions::run_id; docs/DESIGN.md §6), or "" when it is of this one: another run
// id (a manifest without one matches any), another model, another optimizer set-up.
std::string other_job_reason(const SavedMeta& saved, const ModelIndex& model,
                             const std::vector<OptimizerEntry>& opts, const std::string& run_id);

// What a save writes that a load checks, as "label = value" lines, so that the ranks can compare
// them before anything is written or read (comm/agreement.h, agree_on_arguments): the groups,
// the optimizers in order (kinds, param groups and their parameters) and, `with_state`, per
// parameter which optimizer state exists (what a save or export writes; a load or import
// replaces it).
std::vector<std::string> describe_for_save(const ModelIndex& model,
                                           const std::vector<OptimizerEntry>& opts,
                                           bool with_state = true);

}  // namespace fsdp_muon::checkpoint
