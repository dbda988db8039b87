#pragma once
// The library's one stable hash: 64-bit FNV-1a, the same on every build, process and machine
// (unlike std::hash), for what ranks compare with each other: descriptions, option
// fingerprints, replicas' shard hashes, and the tests' checks of bits. Not for security.
// Internal header.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fsdp_muon::detail {

class StableHash {
 public:
  StableHash& add(const void* data, size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) value_ = (value_ ^ bytes[i]) * kPrime;
    return *this;
  }
  StableHash& add(std::string_view text) { return add(text.data(), text.size()); }
  // The value's eight bytes, lowest first, whatever the machine's byte order.
  StableHash& add(uint64_t value) {
    for (int i = 0; i < 8; ++i) value_ = (value_ ^ ((value >> (8 * i)) & 0xff)) * kPrime;
    return *this;
  }
  uint64_t value() const { return value_; }

 private:
  static constexpr uint64_t kOffset = 1469598103934665603ull;
  static constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t value_ = kOffset;
};

inline uint64_t stable_hash(std::string_view text) { return StableHash().add(text).value(); }

}  // namespace fsdp_muon::detail
