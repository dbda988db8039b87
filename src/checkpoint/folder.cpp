#include "checkpoint/folder.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <utility>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <fsdp_muon/checkpoint/checkpoint.h>

#include "checkpoint/file_io.h"
#include "checkpoint/rank_file.h"
#include "comm/agreement.h"

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

std::vector<char> encode_manifest(int64_t sequence, const ModelIndex& model,
                                  const std::vector<OptimizerEntry>& opts,
                                  const std::vector<int64_t>& rank_file_bytes) {
  c10::impl::GenericList files(c10::AnyType::get());
  c10::impl::GenericList file_bytes(c10::AnyType::get());
  const int world = model.comm->size();
  for (int r = 0; r < world; ++r) {
    files.push_back(rank_file_name(r, world));
    file_bytes.push_back(rank_file_bytes[r]);
  }
  c10::impl::GenericDict manifest = describe(model, opts);
  manifest.insert("type", std::string("manifest"));
  manifest.insert("sequence", sequence);
  manifest.insert("rank_files", files);
  manifest.insert("rank_file_bytes", file_bytes);
  return pickle_save_plain(manifest);
}

void write_text_atomic(const std::string& path, const std::string& text, const char* api) {
  write_file_atomic(path, {{text.data(), text.size()}}, api);
}

// What a root holds apart from checkpoint `current` and anything newer.
struct RootContents {
  std::vector<std::pair<int64_t, std::string>> complete;  // (sequence, path)
  // Folders of earlier saves that never got a manifest, and temporary `latest` files.
  std::vector<std::string> leftovers;
};

RootContents survey_root(const std::string& dir, int64_t current) {
  RootContents contents;
  for (const std::string& name : list_directory(dir)) {
    const std::string path = join_path(dir, name);
    const int64_t sequence = folder_sequence(name);
    if (sequence >= 0 && sequence <= current && is_directory(path)) {
      if (path_exists(join_path(path, kManifestName))) {
        contents.complete.emplace_back(sequence, path);
      } else if (sequence < current) {
        contents.leftovers.push_back(path);
      }
    } else if (name.rfind(std::string(kLatestName) + ".tmp.", 0) == 0) {
      contents.leftovers.push_back(path);
    }
  }
  return contents;
}

// Best effort: the new checkpoint is already complete and named by `latest`, so nothing here
// may fail the save.
void prune(const std::string& dir, int64_t current, int64_t keep_last) {
  RootContents contents = survey_root(dir, current);
  std::vector<std::string> remove = std::move(contents.leftovers);
  auto& complete = contents.complete;
  std::sort(complete.begin(), complete.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  if (keep_last > 0) {
    for (size_t i = static_cast<size_t>(keep_last); i < complete.size(); ++i) {
      remove.push_back(complete[i].second);
    }
  }
  for (const std::string& path : remove) remove_tree(path);
}

// The first line of the file at `path`; empty when it cannot be read.
std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (in) std::getline(in, line);
  return line;
}

// Why `dir`, which has neither a manifest nor `latest`, holds no checkpoint.
[[noreturn]] void explain_no_checkpoint(const std::string& dir, const char* api) {
  TORCH_CHECK(path_exists(dir), api, ": ", dir, " does not exist");
  bool has_rank_files = false;
  for (const std::string& name : list_directory(dir)) {
    if (name.rfind("rank-", 0) == 0) has_rank_files = true;
  }
  TORCH_CHECK(!has_rank_files, api, ": ", dir,
              " is an incomplete checkpoint: it has rank files but no ", kManifestName,
              " (the save that wrote it did not finish)");
  TORCH_CHECK(false, api, ": no checkpoint in ", dir, ": it has neither a ", kManifestName,
              " nor a '", kLatestName, "' file");
}

}  // namespace

std::string folder_name(int64_t sequence) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s%06lld", kFolderPrefix, static_cast<long long>(sequence));
  return buf;
}

int64_t create_checkpoint_folder(const std::string& dir, const char* api) {
  make_directories(dir, api);
  int64_t last = 0;
  for (const std::string& name : list_directory(dir)) {
    last = std::max(last, folder_sequence(name));
  }
  const int64_t sequence = last + 1;
  const std::string folder = join_path(dir, folder_name(sequence));
  TORCH_CHECK(make_directory(folder, api), api, ": cannot create ", folder, " (it exists)");
  return sequence;
}

void publish_checkpoint(const std::string& dir, int64_t sequence, const ModelIndex& model,
                        const std::vector<OptimizerEntry>& opts,
                        const std::vector<int64_t>& rank_file_bytes, int64_t keep_last,
                        const char* api) {
  const std::string folder = join_path(dir, folder_name(sequence));
  const std::vector<char> manifest = encode_manifest(sequence, model, opts, rank_file_bytes);
  write_file_atomic(join_path(folder, kManifestName), {{manifest.data(), manifest.size()}}, api);
  write_text_atomic(join_path(dir, kLatestName), folder_name(sequence) + "\n", api);
  prune(dir, sequence, keep_last);
}

std::string resolve_checkpoint_folder(const std::string& dir, const char* api) {
  if (path_exists(join_path(dir, kManifestName))) return dir;
  const std::string latest = join_path(dir, kLatestName);
  if (!path_exists(latest)) explain_no_checkpoint(dir, api);
  const std::string name = first_line(latest);
  TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos, api, ": ", latest,
              " does not name a checkpoint folder");
  const std::string folder = join_path(dir, name);
  TORCH_CHECK(path_exists(join_path(folder, kManifestName)), api, ": ", latest, " names '", name,
              "', but ", join_path(folder, kManifestName), " does not exist");
  return folder;
}

SavedMeta read_manifest(const std::string& folder, const char* api) {
  const std::string path = join_path(folder, kManifestName);
  const std::vector<char> bytes = read_whole_file(path, api);
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (...) {
    TORCH_CHECK(false, api, ": ", path, " is truncated or corrupt (", bytes.size(),
                " bytes): ", detail::current_exception_message());
  }
  return parse_meta(value, path, /*manifest=*/true, api);
}

}  // namespace fsdp_muon::checkpoint

namespace fsdp_muon {

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  const std::string name =
      checkpoint::first_line(checkpoint::join_path(dir, checkpoint::kLatestName));
  if (name.empty()) return std::nullopt;
  const std::string folder = checkpoint::join_path(dir, name);
  if (!checkpoint::path_exists(checkpoint::join_path(folder, checkpoint::kManifestName))) {
    return std::nullopt;
  }
  return folder;
}

}  // namespace fsdp_muon
