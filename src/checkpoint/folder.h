#pragma once
// The folders under a checkpoint root (docs/DESIGN.md §6): every save goes into a fresh folder
// "ckpt-<sequence>", whose manifest is written last, after every rank file is in place, so a
// checkpoint is complete iff its manifest exists; then `latest` names it and older checkpoints
// are pruned. A crash at any point leaves the previous complete checkpoint and `latest` as
// they were.

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/metadata.h"
#include "checkpoint/model_index.h"

namespace fsdp_muon::checkpoint {

constexpr const char* kManifestName = "manifest.pt";
constexpr const char* kLatestName = "latest";

// "ckpt-000007"
std::string folder_name(int64_t sequence);

// Rank 0: creates `dir` when needed and in it the folder that follows the highest sequence
// number present (complete or not); returns its sequence number.
int64_t create_checkpoint_folder(const std::string& dir, const char* api);

// Rank 0, once every rank's file of checkpoint `sequence` is in place (`rank_file_bytes` are
// their sizes): writes its manifest, which makes it complete, points `latest` at it, then
// prunes to the newest `keep_last` complete checkpoints (0 keeps all).
void publish_checkpoint(const std::string& dir, int64_t sequence, const ModelIndex& model,
                        const std::vector<OptimizerEntry>& opts,
                        const std::vector<int64_t>& rank_file_bytes, int64_t keep_last,
                        const char* api);

// `dir` when it is a complete checkpoint folder, else the folder dir/latest names; an error that
// says what `dir` is otherwise (missing, incomplete, no checkpoint).
std::string resolve_checkpoint_folder(const std::string& dir, const char* api);

// The parsed manifest of the checkpoint in `folder`.
SavedMeta read_manifest(const std::string& folder, const char* api);

}  // namespace fsdp_muon::checkpoint
