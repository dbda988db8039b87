#pragma once
// Checkpoints (docs/DESIGN.md §6): sharded save and load, resharding to another world size, and a
// full export that Python's torch.load reads.
//
// Layout of a checkpoint root `dir`:
//   dir/latest                         the name of the newest complete checkpoint and its save
//                                      id (one line: "ckpt-000007 <32 hex digits>")
//   dir/ckpt-000007/manifest.pt        written last, by rank 0: a checkpoint is complete iff
//                                      its manifest exists; checksummed, with the save id
//   dir/ckpt-000007/rank-00002-of-00004.bin   what rank 2 of 4 held: per parameter, its held
//                                      slice of the main weights and of each optimizer state;
//                                      header checksummed, data checksummed in 1 MiB chunks
// Every file is written to a temporary name in its own folder, flushed and renamed, and every
// save goes into a fresh folder, so a crash mid-save leaves the previous checkpoint whole and
// `latest` pointing at it.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/config.h>

namespace fsdp_muon {

class FsdpParameterGroup;  // parameter_group.h (the engine tier)

// The caller's own resume state (the step reached, a data cursor, a run name): a few values
// stored in the checkpoint's manifest, so that they and the weights become visible by the same
// rename and no crash can separate them. A key is in one map only.
struct FSDP_MUON_API CheckpointUserState {
  std::map<std::string, int64_t> ints;
  std::map<std::string, std::string> strings;
};

struct FSDP_MUON_API SaveCheckpointOptions {
  // Complete checkpoints kept in the root after a successful save, the new one included
  // (older ones and incomplete leftovers of crashed saves are removed); 0 keeps everything.
  TORCH_ARG(int64_t, keep_last) = 2;
  // Stored as rank 0 passes it; load_checkpoint returns it.
  TORCH_ARG(CheckpointUserState, user_state);
  // Names the training job, with the model and optimizer set-up (parameter names and shapes,
  // optimizer kinds and param groups): a save into a root whose newest checkpoint is of
  // another job (another run_id, model or set-up) is refused, and pruning removes only this
  // job's checkpoints. Pass the same value when a job resumes; "" is a valid run id.
  TORCH_ARG(std::string, run_id) = "";
};

struct FSDP_MUON_API ImportCheckpointOptions {
  // Install optimizer state ("<name>.exp_avg", ...) when the file has it.
  TORCH_ARG(bool, optimizer_state) = true;
  // A tensor in the file that names no parameter (or no state of one) is an error; false
  // ignores it.
  TORCH_ARG(bool, strict) = true;
};

// Saves the main-weight shards of `groups` and the state and options of `optimizers` (each an
// FsdpMuon, torch::optim::AdamW, Adam or SGD over sharded parameters of `groups`) into a new
// checkpoint under `dir`, then points dir/latest at it. Collective: every rank calls it with
// the same groups and optimizers in the same order, which the ranks check before anything is
// written (a difference throws on every rank, naming it). `dir` is a root, never a checkpoint
// folder itself (that throws): resuming with load_checkpoint(root) and saving into the same
// root is the pattern. A root holds one job's checkpoints (SaveCheckpointOptions::run_id).
// Returns the checkpoint folder. A failure on any rank (a failed fsync of a folder included)
// throws on every rank (with that rank's message) and leaves the previous checkpoint as it was
// (only a failed fsync after `latest` was renamed can leave `latest` naming the new, complete
// checkpoint); the failed save's temporary files are removed as the write fails, its incomplete
// folder by the next save (before it writes anything), so a retry after e.g. a full disk works.
FSDP_MUON_API std::string save_checkpoint(
    const std::string& dir, const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
    const std::vector<torch::optim::Optimizer*>& optimizers,
    const SaveCheckpointOptions& options = {});

// Loads the checkpoint dir/latest names, or `dir` itself when it is one checkpoint folder (it
// holds a manifest.pt), at any world size. Rank 0 resolves `dir`, once, and every rank loads
// exactly that checkpoint (checked by its save id), so a save that moves `latest` meanwhile
// cannot make the ranks load different saves, and ranks given different checkpoints (each its
// own latest_checkpoint() around a save) all throw: parameters are matched by name, each rank reads
// only the saved rank files whose shards overlap what it holds now, and only those byte ranges.
// Then the model weights are refreshed and optimizer state and options installed, as the
// optimizers would have created them. Nothing is changed unless every rank read everything it
// needs; errors (another model, a missing or truncated file, another optimizer set-up, a
// checksum mismatch, a rank file of another save) name what is wrong and the file, and are
// raised on every rank. Every byte the load uses is checked against a checksum (format version
// 2; version 1 checkpoints load with the checks they had). Returns the saved user state.
FSDP_MUON_API CheckpointUserState load_checkpoint(
    const std::string& dir, const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
    const std::vector<torch::optim::Optimizer*>& optimizers);

// The checkpoint folder to resume from: `dir` itself when it holds a manifest.pt, else the
// folder dir/latest names (or, when `latest` is absent because the first save stopped between
// its manifest and `latest`, the newest complete ckpt-* folder). nullopt only when there is no
// checkpoint: `dir` does not exist, or holds neither `latest` nor a complete checkpoint folder.
// A checkpoint that is there but unusable (`latest` empty, garbled, naming a missing or
// incomplete folder or another save; a corrupt manifest) throws, naming the file and the
// problem, so that a resume never silently restarts from scratch. Local: reads `latest` and the
// manifest (checksummed), no communication, so ranks calling it around a save can get different
// folders: to resume, pass the root to load_checkpoint, which resolves it once for all ranks.
FSDP_MUON_API std::optional<std::string> latest_checkpoint(const std::string& dir);

// Writes one file of full tensors keyed by parameter name, in LibTorch's pickle format
// (torch::pickle_save), so that Python's torch.load(path) returns a dict of tensors: "<name>"
// (main weights, full shape, main dtype) and, per optimizer state, "<name>.<state>"
// (momentum_buffer, exp_avg, exp_avg_sq, max_exp_avg_sq: full shape) and "<name>.step" (0-d
// int64). Collective (one all-gather per group and state); rank 0 writes, atomically.
FSDP_MUON_API void export_full_checkpoint(
    const std::string& path, const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
    const std::vector<torch::optim::Optimizer*>& optimizers);

// Reads such a file (or a dict of tensors Python saved with torch.save) on every rank: every
// parameter's weights must be there with its shape; optimizer state is installed where the
// file has it. Then the model weights are refreshed. Collective.
FSDP_MUON_API void import_full_checkpoint(
    const std::string& path, const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
    const std::vector<torch::optim::Optimizer*>& optimizers,
    const ImportCheckpointOptions& options = {});

}  // namespace fsdp_muon
