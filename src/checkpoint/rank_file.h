#pragma once
// One rank's file of a sharded checkpoint: its byte layout, the writer and the reader
// (docs/DESIGN.md §6).
//
// Format (version kFormatVersion), all integers little-endian:
//   bytes [0, 24+H) the frame (checkpoint/framing.h): magic, H, CRC-32 of the header, version,
//                   and the header: pickle_save_plain of a dict (describe() plus "type" =
//                   "rank", "rank", "save_id", "held", "entries", "data_bytes", "chunk_bytes",
//                   "chunk_crc32")
//   zeros up to the next multiple of 64 ("data start"; checked when the header is read)
//   then the data: raw bytes of 1-D tensors, each at a 64-byte aligned offset from the data
//   start. One entry per parameter this rank holds part of (weight_entry_key: its slice of the
//   main weights) and per optimizer state tensor (state_entry_key), with dtype, numel, offset
//   and length in the header.
// The data is checksummed in chunks: chunk k is bytes [k*C, min((k+1)*C, data_bytes)) from the
// data start, C = "chunk_bytes" (1 MiB), and "chunk_crc32"[k] its CRC-32. A read verifies
// every chunk it touches, so a partial read (another world size) is checked as a whole one.
// The alignment and the tables let a loader read the element ranges it needs with pread(),
// rounded out to whole chunks, without reading the rest of the file.
// Version 1 had no chunks, no save id and an entry "crc32" checked only for entries read whole.

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
// `save_id` marks the file as this save's, so that a loader refuses files of other saves.
int64_t write_rank_file(const std::string& folder, const ModelIndex& model,
                        const std::vector<OptimizerEntry>& opts, const std::string& save_id);

// Where one entry lies in the file.
struct EntryLocation {
  c10::ScalarType dtype = at::kFloat;
  int64_t numel = 0;
  int64_t offset = 0;  // from the data start
  int64_t nbytes = 0;
  uint32_t crc = 0;  // version 1: of the whole entry
};

// An opened rank file whose header has been checked against the manifest.
struct RankFile {
  ReadFile file;
  int64_t version = 0;
  int64_t data_start = 0;
  int64_t data_bytes = 0;
  int64_t chunk_bytes = 0;           // version 2
  std::vector<uint32_t> chunk_crcs;  // version 2
  std::unordered_map<std::string, EntryLocation> entries;
  // Elements [first, last) of each parameter the saving rank held; the manifest's layout says
  // the same, the copy here keeps a rank file self-describing.
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> held;
};

// Opens saved rank `rank`'s file of the checkpoint in `folder` that `manifest` describes.
RankFile open_rank_file(const SavedMeta& manifest, const std::string& folder, int rank);

// Copies elements [first, first + count) of entry `key` into `dst` (1-D, count elements,
// converting the dtype when it differs). Version 2: every chunk the read touches is checked;
// version 1: an entry read whole has its CRC checked.
void read_entry_range(const RankFile& file, const std::string& key, int64_t first, int64_t count,
                      const at::Tensor& dst);

}  // namespace fsdp_muon::checkpoint
