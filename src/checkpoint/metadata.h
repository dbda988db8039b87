#pragma once
// The metadata of sharded checkpoints: what the manifest and each rank file's header say about
// the layout and the optimizers, built from the live model and parsed back (with errors that
// name the file when a field is missing or of the wrong type).

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include <fsdp_muon/checkpoint/checkpoint.h>

#include "checkpoint/model_index.h"

namespace fsdp_muon::checkpoint {

// 1: entries checksummed whole, manifest unchecked. 2: data checksummed in fixed-size chunks,
// a framed and checksummed manifest, a save id in every file and in `latest`, user state.
// Version 1 checkpoints still load, with the checks they had (docs/DESIGN.md §6).
constexpr int64_t kFormatVersion = 2;
constexpr const char* kFormatName = "fsdp_muon.checkpoint";

// Layout and optimizer description of the live model on this rank (optimizer state as this
// rank sees it: step and which state tensors exist).
c10::impl::GenericDict describe(const ModelIndex& model, const std::vector<OptimizerEntry>& opts);

struct SavedParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;
};

struct SavedGroup {
  std::string name;
  int64_t padded_numel = 0;
  int64_t shard_numel = 0;
  std::vector<SavedParam> params;
};

struct SavedState {
  int64_t step = 0;
  std::vector<std::string> keys;
};

struct SavedOptimizer {
  std::string kind;
  std::vector<std::vector<std::string>> param_groups;  // parameter names
  std::vector<std::vector<char>> options;              // per param group
  std::unordered_map<std::string, SavedState> state;   // by parameter name
};

struct SavedMeta {
  std::string path;  // for messages
  int64_t version = 0;
  std::string save_id;  // version 2 on: the same in the manifest and every rank file of a save
  int world_size = 0;
  std::vector<SavedGroup> groups;
  std::unordered_map<std::string, std::pair<size_t, size_t>> by_name;
  std::vector<SavedOptimizer> optimizers;
  // manifest only
  int64_t sequence = 0;
  std::vector<std::string> rank_files;
  std::vector<int64_t> rank_file_bytes;
  CheckpointUserState user_state;
  // SaveCheckpointOptions::run_id; none in manifests older than it (they match any run id).
  std::optional<std::string> run_id;
};

// Parses the fields describe() writes; `manifest` also requires the manifest-only ones.
SavedMeta parse_meta(const c10::IValue& value, const std::string& path, bool manifest);

// The fields of one dict in a checkpoint file (`path`), with accessors that throw
// "<api>: <path> is corrupt ..." naming the missing or mistyped field and `where` it is.
class Fields {
 public:
  Fields(const c10::IValue& value, std::string path, std::string where = "");
  const c10::IValue& at(const char* key) const;
  bool has(const char* key) const;
  int64_t integer(const char* key) const;
  std::string str(const char* key) const;
  std::vector<int64_t> ints(const char* key) const;
  std::vector<c10::IValue> list(const char* key) const;
  Fields dict(const char* key) const;
  const c10::impl::GenericDict& raw() const { return dict_; }
  const std::string& path() const { return path_; }

 private:
  c10::impl::GenericDict dict_;
  std::string path_;
  std::string where_;
};

// Throws "<api>: <path> is corrupt or not an fsdp_muon checkpoint file: <detail>".
[[noreturn]] void corrupt(const std::string& path, const std::string& detail);

}  // namespace fsdp_muon::checkpoint
