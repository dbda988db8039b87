#pragma once
// The frame around the metadata of a checkpoint file (docs/DESIGN.md §6): rank files and, from
// format version 2, the manifest start with it, so that every byte of their metadata is covered
// by a checksum before it is parsed.
//
//   bytes [0, 8)    magic "FSDPMUON"
//   bytes [8, 16)   H, the header's length (little-endian)
//   bytes [16, 20)  CRC-32 of the header
//   bytes [20, 24)  format version
//   bytes [24, 24+H) header: pickle_save_plain of a dict
// A manifest is the frame alone (its size is exactly 24 + H); a rank file continues with data.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "checkpoint/file_io.h"

namespace fsdp_muon::checkpoint {

constexpr int64_t kFramePrefixBytes = 24;

// True when `bytes` (the first bytes of a file, at least 8 of them) start with the magic.
bool has_frame_magic(const char* bytes, size_t size);

std::array<char, kFramePrefixBytes> encode_frame_prefix(const std::vector<char>& header,
                                                        int64_t version);

struct Frame {
  int64_t version = 0;
  int64_t header_bytes = 0;
  c10::IValue header;  // a dict (checked)
};

// Reads and checks the frame of `file`: magic, a version this build reads, a header length
// inside the file, the header's CRC, then unpickles it; every error names the file.
Frame read_frame(const ReadFile& file);

// Little-endian integers.
void put_u64(char* p, uint64_t v);
void put_u32(char* p, uint32_t v);
uint64_t get_u64(const char* p);
uint32_t get_u32(const char* p);

}  // namespace fsdp_muon::checkpoint
