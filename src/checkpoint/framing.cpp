#include "checkpoint/framing.h"

#include <cstring>

#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include "checkpoint/metadata.h"
#include "comm/agreement.h"
#include "common/check.h"

namespace fsdp_muon::checkpoint {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'M', 'U', 'O', 'N'};

}  // namespace

void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}
void put_u32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

bool has_frame_magic(const char* bytes, size_t size) {
  return size >= sizeof(kMagic) && std::memcmp(bytes, kMagic, sizeof(kMagic)) == 0;
}

std::array<char, kFramePrefixBytes> encode_frame_prefix(const std::vector<char>& header,
                                                        int64_t version) {
  std::array<char, kFramePrefixBytes> prefix{};
  std::memcpy(prefix.data(), kMagic, sizeof(kMagic));
  put_u64(prefix.data() + 8, header.size());
  put_u32(prefix.data() + 16, crc32(header.data(), header.size()));
  put_u32(prefix.data() + 20, static_cast<uint32_t>(version));
  return prefix;
}

Frame read_frame(const ReadFile& file) {
  char bytes[kFramePrefixBytes];
  file.read(0, bytes, sizeof(bytes));
  if (!has_frame_magic(bytes, sizeof(bytes))) corrupt(file.path(), "bad magic bytes");
  Frame frame;
  frame.version = get_u32(bytes + 20);
  if (frame.version < 1) corrupt(file.path(), "format version 0");
  FSDP_MUON_CHECK(frame.version <= kFormatVersion, file.path(), " has format version ",
                  frame.version, "; this fsdp_muon reads up to ", kFormatVersion,
                  " (a newer fsdp_muon wrote it, or the file is corrupt)");
  const uint64_t header_bytes = get_u64(bytes + 8);
  if (header_bytes > static_cast<uint64_t>(file.size() - kFramePrefixBytes)) {
    corrupt(file.path(), "its header length runs past the end of the file");
  }
  frame.header_bytes = static_cast<int64_t>(header_bytes);
  std::vector<char> header(header_bytes);
  file.read(kFramePrefixBytes, header.data(), header.size());
  if (crc32(header.data(), header.size()) != get_u32(bytes + 16)) {
    corrupt(file.path(), "header checksum mismatch");
  }
  try {
    frame.header = torch::pickle_load(header);
  } catch (...) {
    corrupt(file.path(), "unreadable header: " + detail::current_exception_message());
  }
  if (!frame.header.isGenericDict()) corrupt(file.path(), "its header is not a dict");
  return frame;
}

}  // namespace fsdp_muon::checkpoint
