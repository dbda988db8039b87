#pragma once
// Files of a checkpoint: atomic writes (temporary file in the same folder, fsync, rename,
// fsync of the folder), positional reads, CRC-32. Every write honours the failure injection
// test hook (checkpoint/failure_injection.h).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

namespace fsdp_muon::checkpoint {

// Bytes to write, in order; `data` must stay valid for the duration of the write.
struct Chunk {
  const void* data = nullptr;
  size_t size = 0;
};

// Writes `chunks` to `path` atomically: either the old file (if any) stays or the whole new one
// is there. Throws naming the path and errno on failure.
void write_file_atomic(const std::string& path, const std::vector<Chunk>& chunks);

// fsync of a folder, so that the names created, renamed or removed in it are durable; throws
// naming the folder and errno when it fails (EINVAL, a file system that cannot, is accepted).
void sync_folder(const std::string& dir);

// torch::pickle_save without the type tags (torch.jit._pickle.restore_type_tag) it wraps
// dicts and lists in: Python's torch.load refuses those under weights_only=True (its default
// since 2.6), and torch::pickle_load does not need them.
std::vector<char> pickle_save_plain(const c10::IValue& value);

// Paths without std::filesystem: libtorch.so exports its own copy of some std::filesystem
// functions, which the dynamic linker may bind our calls to, and its remove_all() crashes.
std::string join_path(const std::string& dir, const std::string& name);
bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// mkdir -p; throws naming the path on failure.
void make_directories(const std::string& path);
// mkdir; false when it already exists, throws on other failures.
bool make_directory(const std::string& path);
// Names in `path` (no "." or ".."); empty when it cannot be read.
std::vector<std::string> list_directory(const std::string& path);
// rm -rf, best effort.
void remove_tree(const std::string& path);

uint32_t crc32(const void* data, size_t size, uint32_t crc = 0);

std::vector<char> read_whole_file(const std::string& path);

// A file opened for positional reads.
class ReadFile {
 public:
  ReadFile() = default;
  // Throws when it cannot be opened.
  ReadFile(const std::string& path);
  ~ReadFile();
  ReadFile(ReadFile&& other) noexcept;
  ReadFile& operator=(ReadFile&& other) noexcept;
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  // Reads exactly `size` bytes at `offset`; a short read (the file ends earlier) throws saying
  // the file is truncated.
  void read(int64_t offset, void* out, size_t size) const;

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

}  // namespace fsdp_muon::checkpoint
