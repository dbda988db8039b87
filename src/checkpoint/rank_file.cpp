#include "checkpoint/rank_file.h"

#include <array>
#include <cstdio>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include "checkpoint/optimizer_state.h"
#include "comm/agreement.h"

namespace fsdp_muon::checkpoint {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'M', 'U', 'O', 'N'};
constexpr int64_t kPrefixBytes = 24;
constexpr int64_t kAlign = 64;

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Where the entries start in a file whose header is `header_bytes` long.
int64_t data_start_after(int64_t header_bytes) { return align_up(kPrefixBytes + header_bytes); }

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

// ---- writing ----

struct OutEntry {
  std::string key;
  at::Tensor data;  // CPU, contiguous, 1-D
  int64_t offset = 0;
  uint32_t crc = 0;

  int64_t nbytes() const { return data.numel() * static_cast<int64_t>(data.element_size()); }
};

// This rank's slice of every parameter's main weights, in model order.
std::vector<OutEntry> weight_entries(const ModelIndex& model) {
  std::vector<OutEntry> entries;
  for (const auto& group : model.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const at::Tensor& shard = group->sharded_parameter(i);
      if (shard.numel() > 0) {
        entries.push_back(
            {weight_entry_key(group->slot(i).name), shard.detach().cpu().contiguous()});
      }
    }
  }
  return entries;
}

// This rank's slice of every optimizer state tensor, in optimizer and param-group order.
void append_state_entries(const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                          const char* api, std::vector<OutEntry>& entries) {
  for (size_t o = 0; o < opts.size(); ++o) {
    for (const auto& refs : opts[o].param_groups) {
      for (const ParamRef& ref : refs) {
        const at::Tensor& shard = model.shard(ref);
        const std::string& name = model.slot(ref).name;
        const ParamState state = read_state(opts[o], shard);
        for (const auto& [key, t] : state.tensors) {
          TORCH_CHECK(t.numel() == shard.numel(), api, ": optimizer ", o, " (",
                      kind_name(opts[o].kind), ") state '", key, "' of '", name, "' has ",
                      t.numel(), " elements but the shard ", shard.numel(),
                      "; only elementwise state can be sharded");
          if (t.numel() > 0) {
            entries.push_back(
                {state_entry_key(o, name, key), t.detach().cpu().contiguous().view({-1})});
          }
        }
      }
    }
  }
}

// Gives each entry its aligned offset from the data start and its CRC; returns the length of
// the data.
int64_t lay_out(std::vector<OutEntry>& entries) {
  int64_t data_bytes = 0;
  for (OutEntry& e : entries) {
    e.offset = align_up(data_bytes);
    e.crc = crc32(e.data.data_ptr(), static_cast<size_t>(e.nbytes()));
    data_bytes = e.offset + e.nbytes();
  }
  return data_bytes;
}

// Per parameter, the elements [first, last) this rank holds.
c10::impl::GenericDict held_table(const ModelIndex& model) {
  c10::impl::GenericDict held(c10::StringType::get(), c10::AnyType::get());
  for (const auto& group : model.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const auto [first, last] = group->held_range(i);
      c10::impl::GenericList range(c10::AnyType::get());
      range.push_back(first);
      range.push_back(last);
      held.insert(group->slot(i).name, range);
    }
  }
  return held;
}

c10::impl::GenericList entry_table(const std::vector<OutEntry>& entries) {
  c10::impl::GenericList table(c10::AnyType::get());
  for (const OutEntry& e : entries) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("key", e.key);
    d.insert("dtype", static_cast<int64_t>(e.data.scalar_type()));
    d.insert("numel", e.data.numel());
    d.insert("offset", e.offset);
    d.insert("nbytes", e.nbytes());
    d.insert("crc32", static_cast<int64_t>(e.crc));
    table.push_back(d);
  }
  return table;
}

std::vector<char> encode_header(const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                                const std::vector<OutEntry>& entries, int64_t data_bytes) {
  const c10::impl::GenericDict held = held_table(model);
  const c10::impl::GenericList table = entry_table(entries);
  c10::impl::GenericDict header = describe(model, opts);
  header.insert("type", std::string("rank"));
  header.insert("rank", static_cast<int64_t>(model.comm->rank()));
  header.insert("held", held);
  header.insert("entries", table);
  header.insert("data_bytes", data_bytes);
  return pickle_save_plain(header);
}

std::array<char, kPrefixBytes> encode_prefix(const std::vector<char>& header) {
  std::array<char, kPrefixBytes> prefix{};
  std::memcpy(prefix.data(), kMagic, sizeof(kMagic));
  put_u64(prefix.data() + 8, header.size());
  put_u32(prefix.data() + 16, crc32(header.data(), header.size()));
  put_u32(prefix.data() + 20, static_cast<uint32_t>(kFormatVersion));
  return prefix;
}

// The file's bytes in order: prefix, header, zeros up to the data start, then each entry after
// the zeros that align it.
std::vector<Chunk> file_chunks(const std::array<char, kPrefixBytes>& prefix,
                               const std::vector<char>& header,
                               const std::vector<OutEntry>& entries) {
  static const std::vector<char> zeros(kAlign, 0);
  const int64_t header_end = kPrefixBytes + static_cast<int64_t>(header.size());
  std::vector<Chunk> chunks;
  chunks.push_back({prefix.data(), prefix.size()});
  chunks.push_back({header.data(), header.size()});
  chunks.push_back(
      {zeros.data(),
       static_cast<size_t>(data_start_after(static_cast<int64_t>(header.size())) - header_end)});
  int64_t at = 0;
  for (const OutEntry& e : entries) {
    chunks.push_back({zeros.data(), static_cast<size_t>(e.offset - at)});
    chunks.push_back({e.data.data_ptr(), static_cast<size_t>(e.nbytes())});
    at = e.offset + e.nbytes();
  }
  return chunks;
}

// ---- reading ----

struct Prefix {
  uint64_t header_bytes = 0;
  uint32_t header_crc = 0;
  uint32_t version = 0;
};

Prefix read_prefix(const ReadFile& file, const char* api) {
  char bytes[kPrefixBytes];
  file.read(0, bytes, sizeof(bytes));
  if (std::memcmp(bytes, kMagic, sizeof(kMagic)) != 0) corrupt(file.path(), "bad magic bytes", api);
  Prefix prefix;
  prefix.version = get_u32(bytes + 20);
  TORCH_CHECK(prefix.version <= kFormatVersion, api, ": ", file.path(), " has format version ",
              prefix.version, "; this fsdp_muon reads up to ", kFormatVersion);
  prefix.header_bytes = get_u64(bytes + 8);
  prefix.header_crc = get_u32(bytes + 16);
  if (static_cast<int64_t>(prefix.header_bytes) > file.size() - kPrefixBytes) {
    corrupt(file.path(), "its header length runs past the end of the file", api);
  }
  return prefix;
}

c10::IValue read_header(const ReadFile& file, const Prefix& prefix, const char* api) {
  std::vector<char> header(prefix.header_bytes);
  file.read(kPrefixBytes, header.data(), header.size());
  if (crc32(header.data(), header.size()) != prefix.header_crc) {
    corrupt(file.path(), "header checksum mismatch", api);
  }
  try {
    return torch::pickle_load(header);
  } catch (...) {
    corrupt(file.path(), "unreadable header: " + detail::current_exception_message(), api);
  }
}

EntryLocation parse_entry(const Fields& e, int64_t data_bytes, const std::string& path) {
  EntryLocation h;
  const int64_t dtype = e.integer("dtype");
  if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) {
    corrupt(path, "an entry has an unknown dtype", e.api());
  }
  h.dtype = static_cast<c10::ScalarType>(dtype);
  h.numel = e.integer("numel");
  h.offset = e.integer("offset");
  h.nbytes = e.integer("nbytes");
  h.crc = static_cast<uint32_t>(e.integer("crc32"));
  if (h.numel < 0 || h.offset < 0 ||
      h.nbytes != h.numel * static_cast<int64_t>(c10::elementSize(h.dtype)) ||
      h.offset + h.nbytes > data_bytes) {
    corrupt(path, "entry '" + e.str("key") + "' lies outside the data", e.api());
  }
  return h;
}

std::unordered_map<std::string, std::pair<int64_t, int64_t>> parse_held(const Fields& held) {
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> out;
  for (const auto& item : held.raw()) {
    if (!item.key().isString() || !item.value().isList() || item.value().toListRef().size() != 2) {
      corrupt(held.path(), "bad 'held' table", held.api());
    }
    const auto r = item.value().toListRef();
    out[item.key().toStringRef()] = {r[0].toInt(), r[1].toInt()};
  }
  return out;
}

}  // namespace

std::string rank_file_name(int rank, int world_size) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "rank-%05d-of-%05d.bin", rank, world_size);
  return buf;
}

std::string weight_entry_key(const std::string& param) { return "w:" + param; }

std::string state_entry_key(size_t optimizer, const std::string& param, const std::string& state) {
  return "s" + std::to_string(optimizer) + ":" + param + ":" + state;
}

int64_t write_rank_file(const std::string& folder, const ModelIndex& model,
                        const std::vector<OptimizerEntry>& opts, const char* api) {
  std::vector<OutEntry> entries = weight_entries(model);
  append_state_entries(model, opts, api, entries);
  const int64_t data_bytes = lay_out(entries);
  const std::vector<char> header = encode_header(model, opts, entries, data_bytes);
  const std::array<char, kPrefixBytes> prefix = encode_prefix(header);
  const std::string path =
      join_path(folder, rank_file_name(model.comm->rank(), model.comm->size()));
  write_file_atomic(path, file_chunks(prefix, header, entries), api);
  return data_start_after(static_cast<int64_t>(header.size())) + data_bytes;
}

RankFile open_rank_file(const SavedMeta& manifest, const std::string& folder, int rank,
                        const char* api) {
  const std::string p = join_path(folder, manifest.rank_files[rank]);
  TORCH_CHECK(path_exists(p), api, ": missing rank file ", p, " (saved rank ", rank, " of ",
              manifest.world_size, "); this rank needs its shards");
  RankFile rf;
  rf.file = ReadFile(p, api);
  const int64_t expected = manifest.rank_file_bytes[rank];
  TORCH_CHECK(rf.file.size() >= expected, api, ": ", p, " is truncated: it has ", rf.file.size(),
              " bytes, the manifest says ", expected);
  TORCH_CHECK(rf.file.size() == expected, api, ": ", p, " has ", rf.file.size(),
              " bytes but the manifest says ", expected, "; it was changed after the save");
  const Prefix prefix = read_prefix(rf.file, api);
  const Fields top(read_header(rf.file, prefix, api), p, api);
  TORCH_CHECK(top.integer("rank") == rank && top.integer("world_size") == manifest.world_size, api,
              ": ", p, " was written by rank ", top.integer("rank"), " of ",
              top.integer("world_size"), ", not rank ", rank, " of ", manifest.world_size);
  rf.data_start = data_start_after(static_cast<int64_t>(prefix.header_bytes));
  const int64_t data_bytes = top.integer("data_bytes");
  TORCH_CHECK(rf.file.size() >= rf.data_start + data_bytes, api, ": ", p, " is truncated: it has ",
              rf.file.size(), " bytes, its header says ", rf.data_start + data_bytes);
  for (const c10::IValue& ev : top.list("entries")) {
    const Fields e(ev, p, api, " (an entry)");
    const EntryLocation location = parse_entry(e, data_bytes, p);
    rf.entries.emplace(e.str("key"), location);
  }
  rf.held = parse_held(top.dict("held"));
  return rf;
}

void read_entry_range(const RankFile& file, const std::string& key, int64_t first, int64_t count,
                      const at::Tensor& dst, const char* api) {
  auto it = file.entries.find(key);
  if (it == file.entries.end()) {
    corrupt(file.file.path(), "it has no entry '" + key + "' although the manifest says it should",
            api);
  }
  const EntryLocation& h = it->second;
  if (first < 0 || first + count > h.numel) {
    corrupt(file.file.path(), "entry '" + key + "' holds fewer elements than its held range", api);
  }
  const int64_t elsize = static_cast<int64_t>(c10::elementSize(h.dtype));
  at::Tensor buf =
      dst.scalar_type() == h.dtype ? dst : at::empty({count}, dst.options().dtype(h.dtype));
  file.file.read(file.data_start + h.offset + first * elsize, buf.data_ptr(),
                 static_cast<size_t>(count * elsize));
  if (first == 0 && count == h.numel &&
      crc32(buf.data_ptr(), static_cast<size_t>(count * elsize)) != h.crc) {
    corrupt(file.file.path(), "checksum mismatch in entry '" + key + "'", api);
  }
  if (!buf.is_same(dst)) dst.copy_(buf);
}

}  // namespace fsdp_muon::checkpoint
