#pragma once
// Whether a saved checkpoint fits the live model and optimizers, checked before anything is
// read: errors list what differs (parameter names and shapes, optimizer kinds and param groups),
// so a user can tell "another model" from "another optimizer set-up".

#include <vector>

#include "checkpoint/metadata.h"
#include "checkpoint/model_index.h"

namespace fsdp_muon::checkpoint {

// Parameters are matched by name: every live one must be saved with the same shape, and every
// saved one must be live.
void check_same_model(const SavedMeta& saved, const ModelIndex& model, const char* api);

// The same optimizers in the same order: kinds, param groups and their parameters.
void check_same_optimizers(const SavedMeta& saved, const ModelIndex& model,
                           const std::vector<OptimizerEntry>& opts, const char* api);

}  // namespace fsdp_muon::checkpoint
