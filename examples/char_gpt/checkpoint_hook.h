#pragma once
// Where char_gpt saves and resumes training, through the library's sharded checkpoints
// (docs/DESIGN.md §6): main-weight shards and the optimizer's state go through fsdp_muon's
// save_checkpoint/load_checkpoint (any world size on resume); the step reached goes into the
// same checkpoint as its user state, so it becomes visible with the weights, by one rename, and
// no crash can separate them. The data stream is a function of (seed, rank, step), so it needs
// no saved state of its own.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fsdp_muon/fsdp/sharded_model.h>
#include <fsdp_muon/training/muon_adamw.h>

namespace char_gpt {

struct TrainingState {
  std::shared_ptr<fsdp_muon::ShardedModel> model;
  fsdp_muon::MuonAdamW* optimizer = nullptr;
  int64_t step = 0;  // steps completed
};

// Throws when `directory` is itself one checkpoint folder (it holds a manifest.pt), which
// save_checkpoint refuses: --checkpoint names a root, and --resume X --checkpoint X resumes from
// the newest checkpoint under X and saves the next one beside it.
void check_checkpoint_root(const std::string& directory);

// Collective: a new checkpoint under `directory` (older ones beyond the last two removed).
// Returns its folder.
std::string save_checkpoint(const std::string& directory, const TrainingState& state);

// Collective: restores weights, optimizer state and the step from the newest checkpoint under
// `directory` (or from `directory` itself when it is one checkpoint folder) and refreshes the
// model weights.
void load_checkpoint(const std::string& directory, TrainingState& state);

}  // namespace char_gpt
