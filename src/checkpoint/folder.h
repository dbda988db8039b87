#pragma once
// The folders under a checkpoint root (docs/DESIGN.md §6): every save goes into a fresh folder
// "ckpt-<sequence>", whose manifest is written last, after every rank file is in place, so a
// checkpoint is complete iff its manifest exists; then `latest` names it and older checkpoints
// are pruned. A crash at any point leaves the previous complete checkpoint and `latest` as
// they were.
//
// The manifest (format version 2) is a frame (checkpoint/framing.h) and nothing else: describe()
// plus "type" = "manifest", "save_id", "sequence", "rank_files", "rank_file_bytes",
// "user_state", "run_id" (the last since the job identity; older manifests lack it). Version 1
// wrote the dict with pickle_save_plain alone, unchecked.
// `latest` is one line, "ckpt-000007 <save id>\n" (version 1: "ckpt-000007\n"): the save id
// ties it to the manifest it names, so a garbled `latest` is an error, never another checkpoint.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/metadata.h"
#include "checkpoint/model_index.h"

namespace fsdp_muon::checkpoint {

constexpr const char* kManifestName = "manifest.pt";
constexpr const char* kLatestName = "latest";

// "ckpt-000007"
std::string folder_name(int64_t sequence);

// Whether `folder` holds a manifest (a complete checkpoint).
bool is_complete(const std::string& folder);

// A new random save id: 32 hex digits.
std::string new_save_id();

// Rank 0: refuses a `dir` that is itself a checkpoint folder and a `dir` whose newest complete
// checkpoint is of another job (compatibility.h: other_job_reason), creates `dir` when needed,
// removes what earlier saves that failed or crashed left (folders without a manifest,
// temporary `latest` files) so that they cannot fill the disk again, and creates the folder
// that follows the highest sequence number present, durably (the root is fsynced); returns its
// sequence number.
int64_t create_checkpoint_folder(const std::string& dir, const ModelIndex& model,
                                 const std::vector<OptimizerEntry>& opts,
                                 const std::string& run_id);

// Rank 0, once every rank's file of checkpoint `sequence` is in place (`rank_file_bytes` are
// their sizes): writes its manifest, which makes it complete, reads it back and checks it as a
// load would (a failure removes it again), points `latest` at it, then prunes this job's
// complete checkpoints to the newest `keep_last` (0 keeps all); another job's are never
// removed.
void publish_checkpoint(const std::string& dir, int64_t sequence, const std::string& save_id,
                        const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                        const std::vector<int64_t>& rank_file_bytes,
                        const CheckpointUserState& user_state, const std::string& run_id,
                        int64_t keep_last);

struct FoundCheckpoint {
  std::string folder;
  std::string name;    // the folder's name in the root; "" when the root itself is the folder
  SavedMeta manifest;  // read and checked
};

// latest_checkpoint's rule (checkpoint.h): the checkpoint to load from `dir`, nullopt when there
// is none, an error naming the file when one is there but unusable.
std::optional<FoundCheckpoint> find_checkpoint(const std::string& dir);

// find_checkpoint, where nullopt is an error that says what `dir` is (missing, incomplete, no
// checkpoint).
FoundCheckpoint resolve_checkpoint(const std::string& dir);

// The parsed and checked manifest of the checkpoint in `folder`.
SavedMeta read_manifest(const std::string& folder);

}  // namespace fsdp_muon::checkpoint
