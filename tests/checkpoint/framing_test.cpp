// The frame around a checkpoint file's metadata on its own: the byte layout of the prefix
// (magic, header length, CRC, version, little-endian), a frame read back, and every way
// read_frame refuses a bad one, each naming the file.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <unistd.h>

#include "checkpoint/file_io.h"
#include "checkpoint/framing.h"
#include "checkpoint/metadata.h"
#include "common/test_util.h"

namespace fsdp_muon::checkpoint {
namespace {

// A file in the test's own temporary folder, removed with the fixture.
class FramingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fsdp_muon_framing_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { remove_tree(dir_); }

  // Writes `bytes` to a new file and returns its path.
  std::string write(const std::vector<char>& bytes) {
    const std::string path = join_path(dir_, "f" + std::to_string(files_++));
    write_file_atomic(path, {Chunk{bytes.data(), bytes.size()}});
    return path;
  }

  std::string dir_;
  int files_ = 0;
};

std::vector<char> dict_header() {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("format", "fsdp_muon.checkpoint");
  dict.insert("world_size", int64_t{3});
  return pickle_save_plain(dict);
}

// The prefix of `header` at `version` followed by the header and `tail`.
std::vector<char> framed(const std::vector<char>& header, int64_t version,
                         const std::vector<char>& tail = {}) {
  const auto prefix = encode_frame_prefix(header, version);
  // Sized up front and copied into: growing a vector from the prefix's exact size makes g++ 12
  // warn (-Warray-bounds) inside its own memmove.
  std::vector<char> bytes(prefix.size() + header.size() + tail.size());
  auto end = std::copy(prefix.begin(), prefix.end(), bytes.begin());
  end = std::copy(header.begin(), header.end(), end);
  std::copy(tail.begin(), tail.end(), end);
  return bytes;
}

TEST(Framing, IntegersAreLittleEndian) {
  char b[8];
  put_u32(b, 0x01020304u);
  EXPECT_EQ(std::vector<unsigned char>(b, b + 4), (std::vector<unsigned char>{4, 3, 2, 1}));
  EXPECT_EQ(get_u32(b), 0x01020304u);
  put_u64(b, 0x0102030405060708ull);
  EXPECT_EQ(std::vector<unsigned char>(b, b + 8),
            (std::vector<unsigned char>{8, 7, 6, 5, 4, 3, 2, 1}));
  EXPECT_EQ(get_u64(b), 0x0102030405060708ull);
  put_u64(b, ~uint64_t{0});
  EXPECT_EQ(get_u64(b), ~uint64_t{0});
}

TEST(Framing, PrefixLayout) {
  const std::vector<char> header{'a', 'b', 'c'};
  const auto prefix = encode_frame_prefix(header, 2);
  ASSERT_EQ(prefix.size(), 24u);
  EXPECT_EQ(std::string(prefix.data(), 8), "FSDPMUON");
  EXPECT_EQ(get_u64(prefix.data() + 8), 3u);
  EXPECT_EQ(get_u32(prefix.data() + 16), crc32(header.data(), header.size()));
  EXPECT_EQ(get_u32(prefix.data() + 20), 2u);
  EXPECT_TRUE(has_frame_magic(prefix.data(), prefix.size()));
  EXPECT_TRUE(has_frame_magic(prefix.data(), 8));
  EXPECT_FALSE(has_frame_magic(prefix.data(), 7));  // too short to tell
  EXPECT_FALSE(has_frame_magic("FSDPMUOM", 8));
}

TEST(Framing, CrcIsTheStandardCrc32) {
  // The check value of CRC-32 (zlib, PNG): "123456789" -> 0xCBF43926.
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(crc32("", 0), 0u);
  // Chained over two pieces, the same as over the whole.
  EXPECT_EQ(crc32("6789", 4, crc32("12345", 5)), 0xCBF43926u);
}

TEST_F(FramingTest, ReadsBackWhatWasFramed) {
  const std::vector<char> header = dict_header();
  const std::string path = write(framed(header, kFormatVersion, {'d', 'a', 't', 'a'}));
  const Frame frame = read_frame(ReadFile(path));
  EXPECT_EQ(frame.version, kFormatVersion);
  EXPECT_EQ(frame.header_bytes, static_cast<int64_t>(header.size()));
  ASSERT_TRUE(frame.header.isGenericDict());
  const auto dict = frame.header.toGenericDict();
  EXPECT_EQ(dict.at("format").toStringRef(), "fsdp_muon.checkpoint");
  EXPECT_EQ(dict.at("world_size").toInt(), 3);
  // Version 1 files still read.
  EXPECT_EQ(read_frame(ReadFile(write(framed(header, 1)))).version, 1);
}

TEST_F(FramingTest, RefusesBadFrames) {
  const std::vector<char> header = dict_header();
  const std::vector<char> good = framed(header, kFormatVersion);
  auto refuses = [&](const std::vector<char>& bytes, const std::string& detail) {
    const std::string path = write(bytes);
    testing::expect_error([&] { read_frame(ReadFile(path)); }, {"fsdp_muon: " + path, detail},
                          detail);
  };
  std::vector<char> bytes = good;
  bytes[0] = 'X';
  refuses(bytes, "is corrupt or not an fsdp_muon checkpoint file: bad magic bytes");
  refuses(framed(header, 0), "is corrupt or not an fsdp_muon checkpoint file: format version 0");
  refuses(framed(header, kFormatVersion + 1),
          "has format version " + std::to_string(kFormatVersion + 1) +
              "; this fsdp_muon reads up to " + std::to_string(kFormatVersion));
  bytes = good;
  put_u64(bytes.data() + 8, header.size() + 1);  // one byte more than the file has
  refuses(bytes, "its header length runs past the end of the file");
  bytes = good;
  bytes[kFramePrefixBytes + 3] ^= 0x40;  // a flipped bit in the header
  refuses(bytes, "header checksum mismatch");
  // A checksum that matches bytes that are not a pickle, or a pickle that is not a dict.
  refuses(framed({'n', 'o', 't', ' ', 'a', ' ', 'p', 'i', 'c', 'k', 'l', 'e'}, kFormatVersion),
          "unreadable header");
  refuses(framed(pickle_save_plain(c10::IValue(int64_t{7})), kFormatVersion),
          "its header is not a dict");
  // Shorter than the prefix: the file is truncated.
  refuses(std::vector<char>(good.begin(), good.begin() + 10), "truncated");
}

}  // namespace
}  // namespace fsdp_muon::checkpoint
