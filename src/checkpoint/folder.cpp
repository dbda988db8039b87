#include "checkpoint/folder.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <utility>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <fsdp_muon/checkpoint/checkpoint.h>

#include "checkpoint/compatibility.h"
#include "checkpoint/failure_injection.h"
#include "checkpoint/file_io.h"
#include "checkpoint/framing.h"
#include "checkpoint/rank_file.h"
#include "comm/agreement.h"
#include "common/check.h"

namespace fsdp_muon::checkpoint {
namespace {

constexpr const char* kFolderPrefix = "ckpt-";

// Sequence number of a "ckpt-<n>" folder name, or -1.
int64_t folder_sequence(const std::string& name) {
  const std::string prefix = kFolderPrefix;
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  int64_t n = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || n > (int64_t{1} << 50)) return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

// The manifest's bytes: a frame around the dict (checkpoint/folder.h).
std::vector<char> encode_manifest(int64_t sequence, const std::string& save_id,
                                  const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                                  const std::vector<int64_t>& rank_file_bytes,
                                  const CheckpointUserState& user_state,
                                  const std::string& run_id) {
  c10::impl::GenericList files(c10::AnyType::get());
  c10::impl::GenericList file_bytes(c10::AnyType::get());
  const int world = model.comm->size();
  for (int r = 0; r < world; ++r) {
    files.push_back(rank_file_name(r, world));
    file_bytes.push_back(rank_file_bytes[r]);
  }
  c10::impl::GenericDict user(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [key, value] : user_state.ints) user.insert(key, value);
  for (const auto& [key, value] : user_state.strings) {
    FSDP_MUON_CHECK(!user.contains(key), "user_state key '", key,
                    "' is both an integer and a string; use one");
    user.insert(key, value);
  }
  c10::impl::GenericDict manifest = describe(model, opts);
  manifest.insert("type", std::string("manifest"));
  manifest.insert("save_id", save_id);
  manifest.insert("sequence", sequence);
  manifest.insert("rank_files", files);
  manifest.insert("rank_file_bytes", file_bytes);
  manifest.insert("user_state", user);
  manifest.insert("run_id", run_id);
  const std::vector<char> header = pickle_save_plain(manifest);
  const auto prefix = encode_frame_prefix(header, kFormatVersion);
  std::vector<char> bytes(prefix.begin(), prefix.end());
  bytes.insert(bytes.end(), header.begin(), header.end());
  return bytes;
}

void write_text_atomic(const std::string& path, const std::string& text) {
  write_file_atomic(path, {{text.data(), text.size()}});
}

bool is_latest_temporary(const std::string& name) {
  return name.rfind(std::string(kLatestName) + ".tmp.", 0) == 0;
}

// What `latest` says: a folder name and, from format version 2, the save id.
struct LatestLine {
  std::string name;
  std::string save_id;  // empty: a version 1 `latest`
};

// `latest` must be exactly one line "<name>[ <save id>]\n"; anything else is an error naming it.
LatestLine read_latest(const std::string& path) {
  const std::vector<char> bytes = read_whole_file(path);
  const std::string text(bytes.begin(), bytes.end());
  FSDP_MUON_CHECK(!text.empty(), path, " is empty; it should name the newest checkpoint");
  const bool one_line = text.back() == '\n' && text.find('\n') == text.size() - 1;
  const std::string line = text.substr(0, text.size() - 1);
  const size_t space = line.find(' ');
  LatestLine latest;
  latest.name = line.substr(0, space);
  if (space != std::string::npos) latest.save_id = line.substr(space + 1);
  bool ok = one_line && folder_sequence(latest.name) >= 0 &&
            (space == std::string::npos || !latest.save_id.empty());
  for (char ch : latest.save_id) ok = ok && std::isxdigit(static_cast<unsigned char>(ch)) != 0;
  FSDP_MUON_CHECK(ok, path, " is corrupt: it should be one line 'ckpt-<number> <save id>'",
                  " but holds ", bytes.size(), " bytes that are not");
  return latest;
}

// Names of the ckpt-* folders in `dir`, by sequence number.
std::vector<std::pair<int64_t, std::string>> checkpoint_folders(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> folders;
  for (const std::string& name : list_directory(dir)) {
    const int64_t sequence = folder_sequence(name);
    if (sequence >= 0 && is_directory(join_path(dir, name))) folders.emplace_back(sequence, name);
  }
  std::sort(folders.begin(), folders.end());
  return folders;
}

// Before a save writes anything: the leftovers of earlier saves that failed or crashed. Never
// a complete checkpoint, nor the folder `latest` names.
void remove_leftovers(const std::string& dir) {
  std::string named;
  {
    std::ifstream in(join_path(dir, kLatestName));
    if (in) in >> named;
  }
  for (const auto& [sequence, name] : checkpoint_folders(dir)) {
    const std::string folder = join_path(dir, name);
    if (name != named && !is_complete(folder)) remove_tree(folder);
  }
  for (const std::string& name : list_directory(dir)) {
    if (is_latest_temporary(name)) remove_tree(join_path(dir, name));
  }
}

// The manifest of a complete checkpoint, or nullopt when it does not read.
std::optional<SavedMeta> try_read_manifest(const std::string& folder) {
  try {
    return read_manifest(folder);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Best effort: the new checkpoint is already complete and named by `latest`, so nothing here
// may fail the save. Only this job's complete checkpoints older than `current` go, the newest
// first kept; another job's, and any whose manifest does not read, are not this save's to
// remove (docs/DESIGN.md §6).
void prune(const std::string& dir, int64_t current, int64_t keep_last, const ModelIndex& model,
           const std::vector<OptimizerEntry>& opts, const std::string& run_id) {
  if (keep_last <= 0) return;
  std::vector<std::string> ours;  // newest first
  const auto folders = checkpoint_folders(dir);
  for (auto it = folders.rbegin(); it != folders.rend(); ++it) {
    const std::string folder = join_path(dir, it->second);
    if (it->first > current || !is_complete(folder)) continue;
    if (it->first != current) {
      const std::optional<SavedMeta> saved = try_read_manifest(folder);
      if (!saved || !other_job_reason(*saved, model, opts, run_id).empty()) continue;
    }
    ours.push_back(folder);
  }
  for (size_t i = static_cast<size_t>(keep_last); i < ours.size(); ++i) remove_tree(ours[i]);
}

// Why `dir` holds no checkpoint (find_checkpoint found none).
[[noreturn]] void explain_no_checkpoint(const std::string& dir) {
  FSDP_MUON_CHECK(path_exists(dir), dir, " does not exist");
  FSDP_MUON_CHECK(false, "no checkpoint in ", dir, ": it has neither a ", kManifestName,
                  ", nor a '", kLatestName, "' file, nor a complete checkpoint folder");
}

}  // namespace

std::string folder_name(int64_t sequence) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s%06lld", kFolderPrefix, static_cast<long long>(sequence));
  return buf;
}

std::string new_save_id() {
  std::random_device device;
  std::mt19937_64 gen(
      (static_cast<uint64_t>(device()) << 32) ^ device() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(gen()),
                static_cast<unsigned long long>(gen()));
  return buf;
}

bool is_complete(const std::string& folder) {
  return path_exists(join_path(folder, kManifestName));
}

int64_t create_checkpoint_folder(const std::string& dir, const ModelIndex& model,
                                 const std::vector<OptimizerEntry>& opts,
                                 const std::string& run_id) {
  // A checkpoint nested in a checkpoint folder is one no load of that folder would see.
  FSDP_MUON_CHECK(!is_complete(dir), dir, " is a checkpoint folder (it holds ", kManifestName,
                  "); save into the folder that holds it instead: resuming from a ",
                  "root and saving into the same root continues its sequence");
  make_directories(dir);
  int64_t last = 0;
  for (const std::string& name : list_directory(dir)) {
    last = std::max(last, folder_sequence(name));
  }
  // One root holds one job's checkpoints: another job's save would prune them and move
  // `latest`. The newest complete checkpoint decides (one whose manifest does not read cannot
  // be attributed, and does not block the save).
  const auto folders = checkpoint_folders(dir);
  for (auto it = folders.rbegin(); it != folders.rend(); ++it) {
    const std::string folder = join_path(dir, it->second);
    if (!is_complete(folder)) continue;
    if (const std::optional<SavedMeta> saved = try_read_manifest(folder)) {
      const std::string reason = other_job_reason(*saved, model, opts, run_id);
      FSDP_MUON_CHECK(
          reason.empty(), folder, " is a checkpoint of another job (", reason,
          "); one folder holds the checkpoints of one job: save into another folder, or,",
          " if this job is that one resuming, pass its run_id, model and optimizers");
    }
    break;
  }
  // After `last` is known: a sequence number is never used twice, even when its folder goes.
  remove_leftovers(dir);
  const int64_t sequence = last + 1;
  const std::string folder = join_path(dir, folder_name(sequence));
  FSDP_MUON_CHECK(make_directory(folder), "cannot create ", folder, " (it exists)");
  sync_folder(dir);
  return sequence;
}

void publish_checkpoint(const std::string& dir, int64_t sequence, const std::string& save_id,
                        const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                        const std::vector<int64_t>& rank_file_bytes,
                        const CheckpointUserState& user_state, const std::string& run_id,
                        int64_t keep_last) {
  const std::string folder = join_path(dir, folder_name(sequence));
  const std::vector<char> manifest =
      encode_manifest(sequence, save_id, model, opts, rank_file_bytes, user_state, run_id);
  const std::string manifest_path = join_path(folder, kManifestName);
  try {
    write_file_atomic(manifest_path, {{manifest.data(), manifest.size()}});
    // What a load checks first: a checkpoint that fails it must not become `latest`, nor let
    // pruning remove the previous one.
    const SavedMeta back = read_manifest(folder);
    check_same_model(back, model);
    check_same_optimizers(back, model, opts);
  } catch (...) {
    // A failed save leaves no complete checkpoint (the folder is removed by the next save).
    ::unlink(manifest_path.c_str());
    throw;
  }
  write_text_atomic(join_path(dir, kLatestName), folder_name(sequence) + " " + save_id + "\n");
  prune(dir, sequence, keep_last, model, opts, run_id);
}

std::optional<FoundCheckpoint> find_checkpoint(const std::string& dir) {
  if (is_complete(dir)) return FoundCheckpoint{dir, "", read_manifest(dir)};
  const std::string latest_path = join_path(dir, kLatestName);
  if (path_exists(latest_path)) {
    run_latest_read_hook(false);
    const LatestLine latest = read_latest(latest_path);
    run_latest_read_hook(true);
    const std::string folder = join_path(dir, latest.name);
    FSDP_MUON_CHECK(is_directory(folder), latest_path, " names '", latest.name, "', but ", folder,
                    " does not exist");
    FSDP_MUON_CHECK(is_complete(folder), latest_path, " names '", latest.name, "', but ",
                    join_path(folder, kManifestName),
                    " does not exist: that checkpoint is incomplete or damaged");
    SavedMeta manifest = read_manifest(folder);
    if (latest.save_id.empty()) {
      FSDP_MUON_CHECK(manifest.version == 1, latest_path, " names '", latest.name,
                      "' without a save id, but its manifest (format version ", manifest.version,
                      ") has one: ", latest_path, " is corrupt");
    } else {
      FSDP_MUON_CHECK(manifest.save_id == latest.save_id, latest_path, " names '", latest.name,
                      "' of save ", latest.save_id, ", but ", manifest.path, " is of save ",
                      manifest.save_id.empty() ? "(none: version 1)" : manifest.save_id, ": ",
                      latest_path, " is corrupt or the folder was replaced");
    }
    return FoundCheckpoint{folder, latest.name, std::move(manifest)};
  }
  if (!path_exists(dir)) return std::nullopt;
  FSDP_MUON_CHECK(is_directory(dir), dir, " is a file, not a checkpoint folder");
  for (const std::string& name : list_directory(dir)) {
    FSDP_MUON_CHECK(name.rfind("rank-", 0) != 0, dir,
                    " is an incomplete checkpoint: it has rank files but no ", kManifestName,
                    " (the save that wrote it did not finish)");
  }
  // No `latest` yet: the first save stopped after its manifest. That checkpoint is complete.
  const auto folders = checkpoint_folders(dir);
  for (auto it = folders.rbegin(); it != folders.rend(); ++it) {
    const std::string folder = join_path(dir, it->second);
    if (is_complete(folder)) return FoundCheckpoint{folder, it->second, read_manifest(folder)};
  }
  return std::nullopt;
}

FoundCheckpoint resolve_checkpoint(const std::string& dir) {
  std::optional<FoundCheckpoint> found = find_checkpoint(dir);
  if (!found) explain_no_checkpoint(dir);
  return std::move(*found);
}

SavedMeta read_manifest(const std::string& folder) {
  const std::string path = join_path(folder, kManifestName);
  const ReadFile file(path);
  char prefix[kFramePrefixBytes] = {};
  if (file.size() >= kFramePrefixBytes) file.read(0, prefix, sizeof(prefix));
  const char* magic = prefix;
  if (has_frame_magic(prefix, sizeof(prefix))) {
    const uint64_t framed = kFramePrefixBytes + get_u64(prefix + 8);
    FSDP_MUON_CHECK(framed == static_cast<uint64_t>(file.size()), path,
                    " is truncated or corrupt (", file.size(), " bytes, its frame says ", framed,
                    ")");
    const Frame frame = read_frame(file);
    if (frame.version < 2) corrupt(path, "a framed manifest of format version 1");
    const Fields top(frame.header, path);
    if (top.str("type") != "manifest") corrupt(path, "it is not a manifest");
    SavedMeta meta = parse_meta(frame.header, path, /*manifest=*/true);
    if (meta.version != frame.version) {
      corrupt(path, "its frame and its header disagree on the format version");
    }
    return meta;
  }
  // Version 1: the pickle alone, without a checksum.
  FSDP_MUON_CHECK(file.size() >= kFramePrefixBytes && magic[0] == 'P' && magic[1] == 'K', path,
                  " is corrupt or not an fsdp_muon manifest: it starts with neither the fsdp_muon ",
                  "magic bytes nor a version 1 pickle archive (", file.size(), " bytes)");
  std::vector<char> bytes(static_cast<size_t>(file.size()));
  file.read(0, bytes.data(), bytes.size());
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (...) {
    FSDP_MUON_CHECK(false, path, " is truncated or corrupt (", bytes.size(),
                    " bytes): ", detail::current_exception_message());
  }
  SavedMeta meta;
  try {
    meta = parse_meta(value, path, /*manifest=*/true);
  } catch (const c10::Error& e) {
    // Version 1 manifests have no checksum: whatever a damaged one fails with names it.
    const std::string msg = e.what_without_backtrace();
    if (msg.find(path) != std::string::npos) throw;
    corrupt(path, msg);
  }
  if (meta.version != 1) corrupt(path, "a manifest of format version 2 or later needs a frame");
  return meta;
}

}  // namespace fsdp_muon::checkpoint

namespace fsdp_muon {

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  FSDP_MUON_API_SCOPE("latest_checkpoint");
  auto found = checkpoint::find_checkpoint(dir);
  if (!found) return std::nullopt;
  return found->folder;
}

}  // namespace fsdp_muon
