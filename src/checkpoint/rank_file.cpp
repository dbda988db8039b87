#include "checkpoint/rank_file.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include "checkpoint/failure_injection.h"
#include "checkpoint/framing.h"
#include "checkpoint/optimizer_state.h"
#include "comm/agreement.h"
#include "common/check.h"
#include "muon/row_state.h"

namespace fsdp_muon::checkpoint {
namespace {

constexpr int64_t kPrefixBytes = kFramePrefixBytes;
constexpr int64_t kAlign = 64;

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Where the entries start in a file whose header is `header_bytes` long.
int64_t data_start_after(int64_t header_bytes) { return align_up(kPrefixBytes + header_bytes); }

// ---- writing ----

struct OutEntry {
  std::string key;
  at::Tensor data;  // CPU, contiguous, 1-D
  int64_t offset = 0;

  int64_t nbytes() const { return data.numel() * static_cast<int64_t>(data.element_size()); }
};

// This rank's slice of every parameter's main weights, in model order.
std::vector<OutEntry> weight_entries(const ModelIndex& model) {
  // On CUDA the shards' copies to the host wait behind whatever is still on the stream, the
  // last step's collectives included. One bounded wait per group first (docs/DESIGN.md §5), so a
  // dead peer is an error within the timeout; the copies after it only wait for themselves.
  for (const auto& group : model.groups) {
    const auto& comm = group->communicator();
    comm->to_host(at::empty({1}, at::TensorOptions().device(comm->device())));
  }
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

// How many rows of `ref`'s row state this rank keeps (docs/DESIGN.md §6).
int64_t held_rows(const ModelIndex& model, const ParamRef& ref) {
  const ParameterSlot& slot = model.slot(ref);
  const auto [first, last] = detail::rows_starting_in(
      model.groups[ref.group]->held_range(ref.index), detail::row_state_cols(slot.shape));
  return last - first;
}

// This rank's slice of every optimizer state tensor, in optimizer and param-group order.
void append_state_entries(const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                          std::vector<OutEntry>& entries) {
  for (size_t o = 0; o < opts.size(); ++o) {
    for (const auto& refs : opts[o].param_groups) {
      for (const ParamRef& ref : refs) {
        const at::Tensor& shard = model.shard(ref);
        const std::string& name = model.slot(ref).name;
        const ParamState state = read_state(opts[o], shard);
        for (const auto& [key, t] : state.tensors) {
          const bool rows = is_row_state(opts[o].kind, key);
          const int64_t expected = rows ? held_rows(model, ref) : shard.numel();
          FSDP_MUON_CHECK(t.numel() == expected, "optimizer ", o, " (", kind_name(opts[o].kind),
                          ") state '", key, "' of '", name, "' has ", t.numel(),
                          " elements but this rank keeps ", expected,
                          rows ? " rows of it" : " (its shard)",
                          "; only elementwise and row state can be sharded");
          if (t.numel() > 0) {
            entries.push_back(
                {state_entry_key(o, name, key), t.detach().cpu().contiguous().view({-1})});
          }
        }
      }
    }
  }
}

// Gives each entry its aligned offset from the data start; returns the length of the data.
int64_t lay_out(std::vector<OutEntry>& entries) {
  int64_t data_bytes = 0;
  for (OutEntry& e : entries) {
    e.offset = align_up(data_bytes);
    data_bytes = e.offset + e.nbytes();
  }
  return data_bytes;
}

// CRC-32 of each chunk of a byte stream fed in pieces. The chunk size is the checksum
// granularity of the data: what one CRC covers and what a read rounds out to.
class ChunkCrcs {
 public:
  explicit ChunkCrcs(int64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {}
  void feed(const char* p, int64_t n) {
    while (n > 0) {
      const int64_t take = std::min(n, chunk_bytes_ - filled_);
      crc_ = crc32(p, static_cast<size_t>(take), crc_);
      filled_ += take;
      p += take;
      n -= take;
      if (filled_ == chunk_bytes_) flush();
    }
  }
  std::vector<uint32_t> finish() {
    if (filled_ > 0) flush();
    return std::move(crcs_);
  }

 private:
  void flush() {
    crcs_.push_back(crc_);
    crc_ = 0;
    filled_ = 0;
  }
  int64_t chunk_bytes_;
  std::vector<uint32_t> crcs_;
  uint32_t crc_ = 0;
  int64_t filled_ = 0;
};

// The chunk CRCs of the data region: each entry after the zeros that align it.
std::vector<uint32_t> data_chunk_crcs(const std::vector<OutEntry>& entries, int64_t chunk_bytes) {
  static const std::vector<char> zeros(kAlign, 0);
  ChunkCrcs crcs(chunk_bytes);
  int64_t at = 0;
  for (const OutEntry& e : entries) {
    crcs.feed(zeros.data(), e.offset - at);
    crcs.feed(static_cast<const char*>(e.data.data_ptr()), e.nbytes());
    at = e.offset + e.nbytes();
  }
  return crcs.finish();
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
    table.push_back(d);
  }
  return table;
}

std::vector<char> encode_header(const ModelIndex& model, const std::vector<OptimizerEntry>& opts,
                                const std::vector<OutEntry>& entries, int64_t data_bytes,
                                const std::string& save_id) {
  const c10::impl::GenericDict held = held_table(model);
  const c10::impl::GenericList table = entry_table(entries);
  const int64_t chunk_bytes = checkpoint_chunk_bytes();
  c10::impl::GenericList crcs(c10::AnyType::get());
  for (uint32_t crc : data_chunk_crcs(entries, chunk_bytes)) {
    crcs.push_back(static_cast<int64_t>(crc));
  }
  c10::impl::GenericDict header = describe(model, opts);
  header.insert("type", std::string("rank"));
  header.insert("rank", static_cast<int64_t>(model.comm->rank()));
  header.insert("save_id", save_id);
  header.insert("held", held);
  header.insert("entries", table);
  header.insert("data_bytes", data_bytes);
  header.insert("chunk_bytes", chunk_bytes);
  header.insert("chunk_crc32", crcs);
  return pickle_save_plain(header);
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

EntryLocation parse_entry(const Fields& e, int64_t version, int64_t data_bytes,
                          const std::string& path) {
  EntryLocation h;
  const int64_t dtype = e.integer("dtype");
  if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) {
    corrupt(path, "an entry has an unknown dtype");
  }
  h.dtype = static_cast<c10::ScalarType>(dtype);
  h.numel = e.integer("numel");
  h.offset = e.integer("offset");
  h.nbytes = e.integer("nbytes");
  if (version == 1) h.crc = static_cast<uint32_t>(e.integer("crc32"));
  if (h.numel < 0 || h.offset < 0 ||
      h.nbytes != h.numel * static_cast<int64_t>(c10::elementSize(h.dtype)) ||
      h.offset + h.nbytes > data_bytes) {
    corrupt(path, "entry '" + e.str("key") + "' lies outside the data");
  }
  return h;
}

std::unordered_map<std::string, std::pair<int64_t, int64_t>> parse_held(const Fields& held) {
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> out;
  for (const auto& item : held.raw()) {
    if (!item.key().isString() || !item.value().isList() || item.value().toListRef().size() != 2) {
      corrupt(held.path(), "bad 'held' table");
    }
    const auto r = item.value().toListRef();
    if (!r[0].isInt() || !r[1].isInt()) corrupt(held.path(), "bad 'held' table");
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
                        const std::vector<OptimizerEntry>& opts, const std::string& save_id) {
  std::vector<OutEntry> entries = weight_entries(model);
  append_state_entries(model, opts, entries);
  const int64_t data_bytes = lay_out(entries);
  const std::vector<char> header = encode_header(model, opts, entries, data_bytes, save_id);
  const std::array<char, kPrefixBytes> prefix = encode_frame_prefix(header, kFormatVersion);
  const std::string path =
      join_path(folder, rank_file_name(model.comm->rank(), model.comm->size()));
  write_file_atomic(path, file_chunks(prefix, header, entries));
  return data_start_after(static_cast<int64_t>(header.size())) + data_bytes;
}

RankFile open_rank_file(const SavedMeta& manifest, const std::string& folder, int rank) {
  const std::string p = join_path(folder, manifest.rank_files[rank]);
  FSDP_MUON_CHECK(path_exists(p), "missing rank file ", p, " (saved rank ", rank, " of ",
                  manifest.world_size, "); this rank needs its shards");
  RankFile rf;
  rf.file = ReadFile(p);
  const int64_t expected = manifest.rank_file_bytes[rank];
  if (rf.file.size() != expected) {
    // Another rank's intact file (swapped or renamed) has another size too: say so, rather than
    // "truncated", when its own header says whose it is.
    std::optional<std::pair<int64_t, int64_t>> writer;
    try {
      const Frame frame = read_frame(rf.file);
      const Fields top(frame.header, p);
      writer.emplace(top.integer("rank"), top.integer("world_size"));
    } catch (const c10::Error&) {
      // Not a readable rank file: the size checks below say what it is.
    }
    FSDP_MUON_CHECK(!writer || (writer->first == rank && writer->second == manifest.world_size), p,
                    " was written by rank ", writer->first, " of ", writer->second, ", not rank ",
                    rank, " of ", manifest.world_size, ": the rank files were swapped or renamed");
  }
  FSDP_MUON_CHECK(rf.file.size() >= expected, p, " is truncated: it has ", rf.file.size(),
                  " bytes, the manifest says ", expected);
  FSDP_MUON_CHECK(rf.file.size() == expected, p, " has ", rf.file.size(),
                  " bytes but the manifest says ", expected, "; it was changed after the save");
  const Frame frame = read_frame(rf.file);
  rf.version = frame.version;
  const Fields top(frame.header, p);
  // A header that passed its checksum but does not parse is still this file's problem: every
  // message names it.
  try {
    FSDP_MUON_CHECK(top.integer("format_version") == frame.version, p,
                    " is corrupt: its frame says format version ", frame.version, ", its header ",
                    top.integer("format_version"));
    FSDP_MUON_CHECK(frame.version == manifest.version, p, " has format version ", frame.version,
                    " but ", manifest.path, " has ", manifest.version,
                    ": the files are of different saves");
    if (frame.version >= 2) {
      FSDP_MUON_CHECK(top.str("type") == "rank", p, " is not a rank file (type '", top.str("type"),
                      "')");
      const std::string id = top.str("save_id");
      FSDP_MUON_CHECK(id == manifest.save_id, p, " belongs to another save (save id ", id,
                      ") than ", manifest.path, " (save id ", manifest.save_id,
                      "); rank files of different saves cannot be mixed");
    }
    FSDP_MUON_CHECK(top.integer("rank") == rank && top.integer("world_size") == manifest.world_size,
                    p, " was written by rank ", top.integer("rank"), " of ",
                    top.integer("world_size"), ", not rank ", rank, " of ", manifest.world_size,
                    ": the rank files were swapped or renamed");
    rf.data_start = data_start_after(frame.header_bytes);
    rf.data_bytes = top.integer("data_bytes");
    if (rf.data_bytes < 0) corrupt(p, "negative data_bytes");
    FSDP_MUON_CHECK(rf.file.size() >= rf.data_start + rf.data_bytes, p, " is truncated: it has ",
                    rf.file.size(), " bytes, its header says ", rf.data_start + rf.data_bytes);
    if (frame.version >= 2) {
      // The zeros between the header and the data are the only bytes no checksum covers.
      const int64_t gap = rf.data_start - (kPrefixBytes + frame.header_bytes);
      std::array<char, kAlign> zeros{};
      rf.file.read(kPrefixBytes + frame.header_bytes, zeros.data(), static_cast<size_t>(gap));
      for (int64_t k = 0; k < gap; ++k) {
        if (zeros[k] != 0) corrupt(p, "non-zero padding after the header");
      }
      rf.chunk_bytes = top.integer("chunk_bytes");
      if (rf.chunk_bytes <= 0) corrupt(p, "chunk_bytes <= 0");
      for (int64_t crc : top.ints("chunk_crc32"))
        rf.chunk_crcs.push_back(static_cast<uint32_t>(crc));
      const int64_t chunks = (rf.data_bytes + rf.chunk_bytes - 1) / rf.chunk_bytes;
      if (static_cast<int64_t>(rf.chunk_crcs.size()) != chunks) {
        corrupt(p, "it lists " + std::to_string(rf.chunk_crcs.size()) + " chunk checksums for " +
                       std::to_string(chunks) + " chunks");
      }
    }
    for (const c10::IValue& ev : top.list("entries")) {
      const Fields e(ev, p, " (an entry)");
      const EntryLocation location = parse_entry(e, frame.version, rf.data_bytes, p);
      rf.entries.emplace(e.str("key"), location);
    }
    rf.held = parse_held(top.dict("held"));
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find(p) != std::string::npos) throw;
    corrupt(p, "unreadable header: " + msg);
  }
  return rf;
}

namespace {

// Version 2: copies data bytes [begin, begin + size) into `out`, verifying every chunk they
// touch.
void read_checked(const RankFile& file, int64_t begin, int64_t size, char* out) {
  const int64_t c = file.chunk_bytes;
  std::vector<char> chunk;
  for (int64_t k = begin / c; k * c < begin + size; ++k) {
    const int64_t chunk_begin = k * c;
    const int64_t chunk_end = std::min(chunk_begin + c, file.data_bytes);
    chunk.resize(static_cast<size_t>(chunk_end - chunk_begin));
    file.file.read(file.data_start + chunk_begin, chunk.data(), chunk.size());
    if (crc32(chunk.data(), chunk.size()) != file.chunk_crcs[static_cast<size_t>(k)]) {
      corrupt(file.file.path(), "checksum mismatch in data bytes [" + std::to_string(chunk_begin) +
                                    ", " + std::to_string(chunk_end) + ") (chunk " +
                                    std::to_string(k) + ")");
    }
    const int64_t a = std::max(begin, chunk_begin);
    const int64_t b = std::min(begin + size, chunk_end);
    std::memcpy(out + (a - begin), chunk.data() + (a - chunk_begin), static_cast<size_t>(b - a));
  }
}

}  // namespace

void read_entry_range(const RankFile& file, const std::string& key, int64_t first, int64_t count,
                      const at::Tensor& dst) {
  auto it = file.entries.find(key);
  if (it == file.entries.end()) {
    corrupt(file.file.path(), "it has no entry '" + key + "' although the manifest says it should");
  }
  const EntryLocation& h = it->second;
  if (first < 0 || count < 0 || first + count > h.numel) {
    corrupt(file.file.path(), "entry '" + key + "' holds fewer elements than its held range");
  }
  if (count == 0) return;
  const int64_t elsize = static_cast<int64_t>(c10::elementSize(h.dtype));
  at::Tensor buf =
      dst.scalar_type() == h.dtype ? dst : at::empty({count}, dst.options().dtype(h.dtype));
  char* out = static_cast<char*>(buf.data_ptr());
  if (file.version >= 2) {
    read_checked(file, h.offset + first * elsize, count * elsize, out);
  } else {
    file.file.read(file.data_start + h.offset + first * elsize, out,
                   static_cast<size_t>(count * elsize));
    if (first == 0 && count == h.numel &&
        crc32(out, static_cast<size_t>(count * elsize)) != h.crc) {
      corrupt(file.file.path(), "checksum mismatch in entry '" + key + "'");
    }
  }
  if (!buf.is_same(dst)) dst.copy_(buf);
}

}  // namespace fsdp_muon::checkpoint
