#include "checkpoint_hook.h"

#include <fstream>
#include <string>

#include <c10/util/Exception.h>

#include <fsdp_muon/checkpoint/checkpoint.h>

namespace char_gpt {
namespace {

constexpr const char* kStepKey = "char_gpt.step";
constexpr const char* kLegacyStepFile = "char_gpt_step.txt";

}  // namespace

void check_checkpoint_root(const std::string& directory) {
  TORCH_CHECK(!std::ifstream(directory + "/manifest.pt").good(), "char_gpt: --checkpoint ",
              directory, " is one checkpoint folder (it holds manifest.pt); pass the folder that ",
              "holds it (--resume X --checkpoint X continues a run and saves beside it)");
}

std::string save_checkpoint(const std::string& directory, const TrainingState& state) {
  fsdp_muon::CheckpointUserState user;
  user.ints[kStepKey] = state.step;
  // MuonAdamW stores AdamW, then FsdpMuon: the order char_gpt's two optimizers had, so
  // checkpoints of earlier versions load.
  return fsdp_muon::save_checkpoint(directory, *state.model, *state.optimizer,
                                    fsdp_muon::SaveCheckpointOptions().user_state(user));
}

void load_checkpoint(const std::string& directory, TrainingState& state) {
  // The library resolves `directory` once, on rank 0, and every rank loads that checkpoint; an
  // unusable one throws, naming the file.
  const fsdp_muon::CheckpointUserState user =
      fsdp_muon::load_checkpoint(directory, *state.model, *state.optimizer);
  auto it = user.ints.find(kStepKey);
  int64_t step = it != user.ints.end() ? it->second : -1;
  std::string folder = directory;
  if (it == user.ints.end()) {
    // Checkpoints of earlier char_gpt versions kept the step in a file beside the manifest.
    folder = fsdp_muon::latest_checkpoint(directory).value_or(directory);
    std::ifstream in(folder + "/" + kLegacyStepFile);
    if (!(in >> step)) step = -1;
  }
  TORCH_CHECK(step >= 0, "char_gpt: --resume ", directory, ": ", folder,
              " holds no char_gpt step (no user state '", kStepKey, "', no ", kLegacyStepFile,
              "); resume from a folder that char_gpt --checkpoint wrote");
  state.step = step;
}

}  // namespace char_gpt
