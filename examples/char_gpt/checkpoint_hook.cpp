#include "checkpoint_hook.h"

#include <cstdio>
#include <fstream>
#include <string>

#include <c10/util/Exception.h>

#include <fsdp_muon/checkpoint/checkpoint.h>
#include <fsdp_muon/comm/communicator.h>

namespace char_gpt {
namespace {

constexpr const char* kStepFile = "char_gpt_step.txt";

// The same order at save and load: the library matches optimizers by position.
std::vector<torch::optim::Optimizer*> optimizers_of(const TrainingState& state) {
  std::vector<torch::optim::Optimizer*> out;
  if (state.adamw != nullptr) out.push_back(state.adamw);
  if (state.muon != nullptr) out.push_back(state.muon);
  return out;
}

fsdp_muon::Communicator& communicator_of(const TrainingState& state) {
  TORCH_CHECK(!state.groups.empty(), "char_gpt: no parameter groups to checkpoint");
  return *state.groups.front()->communicator();
}

}  // namespace

std::string save_checkpoint(const std::string& directory, const TrainingState& state) {
  const std::string folder =
      fsdp_muon::save_checkpoint(directory, state.groups, optimizers_of(state));
  auto& comm = communicator_of(state);
  if (comm.rank() == 0) {
    // Atomic like the library's files: a reader sees the old step or the new one, never half.
    const std::string path = folder + "/" + kStepFile;
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << state.step << "\n";
      out.flush();
      TORCH_CHECK(out.good(), "char_gpt: cannot write ", tmp);
    }
    TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "char_gpt: cannot rename ", tmp,
                " to ", path);
  }
  comm.barrier();
  return folder;
}

void load_checkpoint(const std::string& directory, TrainingState& state) {
  const auto latest = fsdp_muon::latest_checkpoint(directory);
  const std::string folder = latest ? *latest : directory;
  std::ifstream in(folder + "/" + kStepFile);
  int64_t step = -1;
  in >> step;
  TORCH_CHECK(in && step >= 0, "char_gpt: --resume ", directory, ": no char_gpt checkpoint (",
              folder, "/", kStepFile, " is missing or unreadable); resume from a folder that ",
              "char_gpt --checkpoint wrote");
  fsdp_muon::load_checkpoint(folder, state.groups, optimizers_of(state));
  state.step = step;
}

}  // namespace char_gpt
