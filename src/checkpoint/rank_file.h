#pragma once
// One rank's file of a sharded checkpoint: its byte layout, the writer and the reader
// (docs/DESIGN.md §6).
//
// Format (version kFormatVersion), all integers little-endian:
//   bytes [0, 8)    magic "FSDPMUON"
//   bytes [8, 16)   H, the header's length
//   bytes [16, 20)  CRC-32 of the header
//   bytes [20, 24)  format version
//   bytes [24, 24+H) header: pickle_save_plain of a dict (describe() plus "type", "rank",
//                   "held", "entries", "data_bytes")
//   then, from the next multiple of 64 ("data start"), the entries: raw bytes of 1-D tensors,
//   each at a 64-byte aligned offset from the data start. One entry per parameter this rank
//   holds part of (weight_entry_key: its slice of the main weights) and per optimizer state
//   tensor (state_entry_key), with dtype, numel, offset, length and CRC-32 in the header.
// The alignment and the per-entry table let a loader read exactly the element ranges it needs
// with pread(), without parsing or reading the rest of the file.

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "checkpoint/file_io.h"
#include "checkpoint/metadata.h"
#include "checkpoint/model_index.h"

namespace fsdp_muon::checkpoint {

// "rank-00002-of-00004.bin"
std::string rank_file_name(int rank, int world_size);

// Entry keys: "w:<parameter>" and "s<optimizer index>:<parameter>:<state key>".
std::string weight_entry_key(const std::string& param);
std::string state_entry_key(size_t optimizer, const std::string& param, const std::string& state);

// Writes this rank's file into `folder`, atomically; returns its size in bytes, which the
// manifest records so that a loader can tell a truncated or replaced file.
int64_t write_rank_file(const std::string& folder, const ModelIndex& model,
                        const std::vector<OptimizerEntry>& opts, const char* api);

// Where one entry lies in the file.
struct EntryLocation {
  c10::ScalarType dtype = at::kFloat;
  int64_t numel = 0;
  int64_t offset = 0;  // from the data start
  int64_t nbytes = 0;
  uint32_t crc = 0;
};

// An opened rank file whose header has been checked against the manifest.
struct RankFile {
  ReadFile file;
  int64_t data_start = 0;
  std::unordered_map<std::string, EntryLocation> entries;
  // Elements [first, last) of each parameter the saving rank held; the manifest's layout says
  // the same, the copy here keeps a rank file self-describing.
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> held;
};

// Opens saved rank `rank`'s file of the checkpoint in `folder` that `manifest` describes.
RankFile open_rank_file(const SavedMeta& manifest, const std::string& folder, int rank,
                        const char* api);

// Copies elements [first, first + count) of entry `key` into `dst` (1-D, count elements,
// converting the dtype when it differs). An entry read whole has its CRC checked.
void read_entry_range(const RankFile& file, const std::string& key, int64_t first, int64_t count,
                      const at::Tensor& dst, const char* api);

}  // namespace fsdp_muon::checkpoint
