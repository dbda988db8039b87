// Sharded save and load (DESIGN §6).
//
// Rank file format (version 1), all integers little-endian:
//   bytes [0, 8)    magic "FSDPMUON"
//   bytes [8, 16)   H, the header's length
//   bytes [16, 20)  CRC-32 of the header
//   bytes [20, 24)  format version
//   bytes [24, 24+H) header: torch::pickle_save of a dict (describe() plus "rank", "held",
//                   "entries", "data_bytes")
//   then, from the next multiple of 64 ("data start"), the entries: raw bytes of 1-D tensors,
//   each at a 64-byte aligned offset from the data start. One entry per parameter this rank
//   holds part of ("w:<name>": its slice of the main weights) and per optimizer state tensor
//   ("s<optimizer>:<name>:<key>"), with dtype, numel, offset, length and CRC-32 in the header.
// A loader reads the header and then exactly the element ranges it needs with pread(); an
// entry read whole has its CRC checked.

#include <fsdp_muon/checkpoint/checkpoint.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include "checkpoint/file_io.h"
#include "checkpoint/metadata.h"
#include "checkpoint/model_index.h"
#include "comm/agreement.h"

namespace fsdp_muon {
using namespace checkpoint;

namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'M', 'U', 'O', 'N'};
constexpr int64_t kPrefixBytes = 24;
constexpr int64_t kAlign = 64;
constexpr const char* kFolderPrefix = "ckpt-";

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

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

std::string weight_key(const std::string& name) { return "w:" + name; }
std::string state_key(size_t opt, const std::string& name, const std::string& key) {
  return "s" + std::to_string(opt) + ":" + name + ":" + key;
}

std::string folder_name(int64_t sequence) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s%06lld", kFolderPrefix, static_cast<long long>(sequence));
  return buf;
}

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

int64_t broadcast_int(Communicator& comm, int64_t value) {
  at::Tensor t = at::full({1}, value, at::kLong).to(comm.device());
  comm.broadcast(t, 0);
  return t.cpu().item<int64_t>();
}

std::vector<int64_t> all_gather_int(Communicator& comm, int64_t value) {
  at::Tensor mine = at::full({1}, value, at::kLong).to(comm.device());
  at::Tensor all = at::empty({comm.size()}, mine.options());
  comm.all_gather(mine, all);
  all = all.cpu();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + comm.size());
}

// ---- save ----

// Rank 0: creates `dir` and a fresh checkpoint folder with the next sequence number.
int64_t create_folder(const std::string& dir) {
  make_directories(dir);
  int64_t last = 0;
  for (const std::string& name : list_directory(dir)) {
    last = std::max(last, folder_sequence(name));
  }
  const int64_t sequence = last + 1;
  const std::string folder = join_path(dir, folder_name(sequence));
  TORCH_CHECK(make_directory(folder), "save_checkpoint: cannot create ", folder, " (it exists)");
  return sequence;
}

struct Entry {
  std::string key;
  at::Tensor data;  // CPU, contiguous, 1-D
  int64_t offset = 0;
  uint32_t crc = 0;
};

// Writes this rank's file; returns its size in bytes.
int64_t write_rank_file(const std::string& folder, const ModelIndex& model,
                        const std::vector<OptimizerEntry>& opts) {
  const int me = model.comm->rank();
  const int world = model.comm->size();
  std::vector<Entry> entries;
  c10::impl::GenericDict held(c10::StringType::get(), c10::AnyType::get());
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const auto [first, last] = group->held_range(i);
      c10::impl::GenericList range(c10::AnyType::get());
      range.push_back(first);
      range.push_back(last);
      held.insert(group->slot(i).name, range);
      const at::Tensor& shard = group->sharded_parameter(i);
      if (shard.numel() > 0) {
        entries.push_back({weight_key(group->slot(i).name), shard.detach().cpu().contiguous()});
      }
    }
  }
  for (size_t o = 0; o < opts.size(); ++o) {
    for (const auto& refs : opts[o].param_groups) {
      for (const ParamRef& ref : refs) {
        const at::Tensor& shard = model.shard(ref);
        const std::string& name = model.slot(ref).name;
        const ParamState state = read_state(opts[o], shard);
        for (const auto& [key, t] : state.tensors) {
          TORCH_CHECK(t.numel() == shard.numel(), "save_checkpoint: optimizer ", o, " (",
                      kind_name(opts[o].kind), ") state '", key, "' of '", name, "' has ",
                      t.numel(), " elements but the shard ", shard.numel(),
                      "; only elementwise state can be sharded");
          if (t.numel() > 0) {
            entries.push_back({state_key(o, name, key), t.detach().cpu().contiguous().view({-1})});
          }
        }
      }
    }
  }
  int64_t data_bytes = 0;
  c10::impl::GenericList table(c10::AnyType::get());
  for (Entry& e : entries) {
    e.offset = align_up(data_bytes);
    const int64_t nbytes = e.data.numel() * static_cast<int64_t>(e.data.element_size());
    e.crc = crc32(e.data.data_ptr(), static_cast<size_t>(nbytes));
    data_bytes = e.offset + nbytes;
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("key", e.key);
    d.insert("dtype", static_cast<int64_t>(e.data.scalar_type()));
    d.insert("numel", e.data.numel());
    d.insert("offset", e.offset);
    d.insert("nbytes", nbytes);
    d.insert("crc32", static_cast<int64_t>(e.crc));
    table.push_back(d);
  }
  c10::impl::GenericDict header = describe(model, opts);
  header.insert("type", std::string("rank"));
  header.insert("rank", static_cast<int64_t>(me));
  header.insert("held", held);
  header.insert("entries", table);
  header.insert("data_bytes", data_bytes);
  const std::vector<char> header_bytes = pickle_save_plain(header);

  const int64_t data_start = align_up(kPrefixBytes + static_cast<int64_t>(header_bytes.size()));
  char prefix[kPrefixBytes];
  std::memcpy(prefix, kMagic, 8);
  put_u64(prefix + 8, header_bytes.size());
  put_u32(prefix + 16, crc32(header_bytes.data(), header_bytes.size()));
  put_u32(prefix + 20, static_cast<uint32_t>(kFormatVersion));
  static const std::vector<char> zeros(kAlign, 0);
  std::vector<Chunk> chunks;
  chunks.push_back({prefix, sizeof(prefix)});
  chunks.push_back({header_bytes.data(), header_bytes.size()});
  int64_t at = kPrefixBytes + static_cast<int64_t>(header_bytes.size());
  chunks.push_back({zeros.data(), static_cast<size_t>(data_start - at)});
  at = 0;
  for (const Entry& e : entries) {
    chunks.push_back({zeros.data(), static_cast<size_t>(e.offset - at)});
    const size_t nbytes = e.data.numel() * e.data.element_size();
    chunks.push_back({e.data.data_ptr(), nbytes});
    at = e.offset + static_cast<int64_t>(nbytes);
  }
  write_file_atomic(join_path(folder, rank_file_name(me, world)), chunks);
  return data_start + data_bytes;
}

void write_text_atomic(const std::string& path, const std::string& text) {
  write_file_atomic(path, {{text.data(), text.size()}});
}

// Rank 0, after the new checkpoint is complete: removes older checkpoints beyond `keep_last`
// and leftovers of saves that never finished. Best effort: the new checkpoint is already safe.
void prune(const std::string& dir, int64_t current, int64_t keep_last) {
  std::vector<std::pair<int64_t, std::string>> complete;
  std::vector<std::string> remove;
  for (const std::string& name : list_directory(dir)) {
    const std::string path = join_path(dir, name);
    const int64_t seq = folder_sequence(name);
    if (seq >= 0 && seq <= current && is_directory(path)) {
      if (path_exists(join_path(path, kManifestName))) {
        complete.emplace_back(seq, path);
      } else if (seq < current) {
        remove.push_back(path);
      }
    } else if (name.rfind(std::string(kLatestName) + ".tmp.", 0) == 0) {
      remove.push_back(path);
    }
  }
  std::sort(complete.begin(), complete.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  if (keep_last > 0) {
    for (size_t i = static_cast<size_t>(keep_last); i < complete.size(); ++i) {
      remove.push_back(complete[i].second);
    }
  }
  for (const std::string& p : remove) remove_tree(p);
}

// ---- load ----

std::string resolve_folder(const std::string& dir, const char* fn) {
  if (path_exists(join_path(dir, kManifestName))) return dir;
  const std::string latest = join_path(dir, kLatestName);
  if (path_exists(latest)) {
    std::ifstream in(latest);
    std::string name;
    std::getline(in, name);
    TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos, fn, ": ", latest,
                " does not name a checkpoint folder");
    const std::string folder = join_path(dir, name);
    TORCH_CHECK(path_exists(join_path(folder, kManifestName)), fn, ": ", latest, " names '", name,
                "', but ", join_path(folder, kManifestName), " does not exist");
    return folder;
  }
  TORCH_CHECK(path_exists(dir), fn, ": ", dir, " does not exist");
  bool has_rank_files = false;
  for (const std::string& name : list_directory(dir)) {
    if (name.rfind("rank-", 0) == 0) has_rank_files = true;
  }
  TORCH_CHECK(!has_rank_files, fn, ": ", dir,
              " is an incomplete checkpoint: it has rank files "
              "but no ",
              kManifestName, " (the save that wrote it did not finish)");
  TORCH_CHECK(false, fn, ": no checkpoint in ", dir, ": it has neither a ", kManifestName,
              " nor a '", kLatestName, "' file");
}

SavedMeta read_manifest(const std::string& folder) {
  const std::string path = join_path(folder, kManifestName);
  const std::vector<char> bytes = read_whole_file(path);
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (...) {
    TORCH_CHECK(false, "checkpoint: ", path, " is truncated or corrupt (", bytes.size(),
                " bytes): ", detail::current_exception_message());
  }
  SavedMeta meta = parse_meta(value, path, /*manifest=*/true);
  return meta;
}

// Collects the differences between the saved and the live model; throws when there are any.
void check_same_model(const SavedMeta& saved, const ModelIndex& model, const char* fn) {
  std::vector<std::string> problems;
  for (const auto& group : model.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const ParameterSlot& slot = group->slot(i);
      auto it = saved.by_name.find(slot.name);
      if (it == saved.by_name.end()) {
        problems.push_back("parameter '" + slot.name + "' (shape " + shape_string(slot.shape) +
                           ") is not in the checkpoint");
        continue;
      }
      const SavedParam& p = saved.groups[it->second.first].params[it->second.second];
      if (p.shape != slot.shape) {
        problems.push_back("parameter '" + slot.name + "' has shape " + shape_string(p.shape) +
                           " in the checkpoint but " + shape_string(slot.shape) + " in this model");
      }
    }
  }
  for (const auto& [name, where] : saved.by_name) {
    if (model.by_name.count(name) == 0) {
      const SavedParam& p = saved.groups[where.first].params[where.second];
      problems.push_back("checkpoint parameter '" + name + "' (shape " + shape_string(p.shape) +
                         ") is not in this model");
    }
  }
  if (problems.empty()) return;
  std::sort(problems.begin(), problems.end());
  std::ostringstream msg;
  msg << fn << ": " << saved.path << " is a checkpoint of another model: ";
  const size_t shown = std::min<size_t>(problems.size(), 8);
  for (size_t i = 0; i < shown; ++i) msg << (i ? "; " : "") << problems[i];
  if (shown < problems.size()) msg << "; and " << problems.size() - shown << " more";
  TORCH_CHECK(false, msg.str());
}

void check_same_optimizers(const SavedMeta& saved, const ModelIndex& model,
                           const std::vector<OptimizerEntry>& opts, const char* fn) {
  auto kinds = [&]() {
    std::string s;
    for (size_t o = 0; o < saved.optimizers.size(); ++o) {
      s += (o ? ", " : "") + saved.optimizers[o].kind;
    }
    return "[" + s + "]";
  };
  TORCH_CHECK(saved.optimizers.size() == opts.size(), fn, ": ", saved.path, " holds ",
              saved.optimizers.size(), " optimizer(s) ", kinds(), " but ", opts.size(),
              " were given; pass the same optimizers, in the same order, as when saving");
  for (size_t o = 0; o < opts.size(); ++o) {
    const SavedOptimizer& s = saved.optimizers[o];
    TORCH_CHECK(s.kind == kind_name(opts[o].kind), fn, ": optimizer ", o, " is '", s.kind,
                "' in the checkpoint but '", kind_name(opts[o].kind), "' here");
    TORCH_CHECK(s.param_groups.size() == opts[o].param_groups.size(), fn, ": optimizer ", o, " (",
                s.kind, ") has ", s.param_groups.size(), " param group(s) in the checkpoint but ",
                opts[o].param_groups.size(), " here");
    for (size_t j = 0; j < s.param_groups.size(); ++j) {
      const auto& names = s.param_groups[j];
      const auto& refs = opts[o].param_groups[j];
      bool same = names.size() == refs.size();
      for (size_t k = 0; same && k < names.size(); ++k) {
        same = names[k] == model.slot(refs[k]).name;
      }
      if (!same) {
        std::ostringstream msg;
        msg << fn << ": optimizer " << o << " (" << s.kind << "), param group " << j
            << " holds different parameters in the checkpoint than here: saved [";
        for (size_t k = 0; k < std::min<size_t>(names.size(), 6); ++k) {
          msg << (k ? ", " : "") << names[k];
        }
        msg << (names.size() > 6 ? ", ..." : "") << "], here [";
        for (size_t k = 0; k < std::min<size_t>(refs.size(), 6); ++k) {
          msg << (k ? ", " : "") << model.slot(refs[k]).name;
        }
        msg << (refs.size() > 6 ? ", ..." : "") << "]";
        TORCH_CHECK(false, msg.str());
      }
    }
  }
}

struct HeaderEntry {
  c10::ScalarType dtype = at::kFloat;
  int64_t numel = 0;
  int64_t offset = 0;  // from the data start
  int64_t nbytes = 0;
  uint32_t crc = 0;
};

// An opened rank file: its checked header and entry table.
struct RankFile {
  ReadFile file;
  int64_t data_start = 0;
  std::unordered_map<std::string, HeaderEntry> entries;
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> held;
};

RankFile open_rank_file(const SavedMeta& manifest, const std::string& folder, int rank,
                        const char* fn) {
  const std::string p = join_path(folder, manifest.rank_files[rank]);
  TORCH_CHECK(path_exists(p), fn, ": missing rank file ", p, " (saved rank ", rank, " of ",
              manifest.world_size, "); this rank needs its shards");
  RankFile rf;
  rf.file = ReadFile(p);
  const int64_t expected = manifest.rank_file_bytes[rank];
  TORCH_CHECK(rf.file.size() >= expected, "checkpoint: ", p, " is truncated: it has ",
              rf.file.size(), " bytes, the manifest says ", expected);
  TORCH_CHECK(rf.file.size() == expected, "checkpoint: ", p, " has ", rf.file.size(),
              " bytes but the manifest says ", expected, "; it was changed after the save");
  char prefix[kPrefixBytes];
  rf.file.read(0, prefix, sizeof(prefix));
  if (std::memcmp(prefix, kMagic, 8) != 0) corrupt(p, "bad magic bytes");
  const uint32_t version = get_u32(prefix + 20);
  TORCH_CHECK(version <= kFormatVersion, "checkpoint: ", p, " has format version ", version,
              "; this fsdp_muon reads up to ", kFormatVersion);
  const uint64_t header_bytes = get_u64(prefix + 8);
  if (static_cast<int64_t>(header_bytes) > rf.file.size() - kPrefixBytes) {
    corrupt(p, "its header length runs past the end of the file");
  }
  std::vector<char> header(header_bytes);
  rf.file.read(kPrefixBytes, header.data(), header.size());
  if (crc32(header.data(), header.size()) != get_u32(prefix + 16)) {
    corrupt(p, "header checksum mismatch");
  }
  c10::IValue value;
  try {
    value = torch::pickle_load(header);
  } catch (...) {
    corrupt(p, "unreadable header: " + detail::current_exception_message());
  }
  const Fields top(value, p);
  TORCH_CHECK(top.integer("rank") == rank && top.integer("world_size") == manifest.world_size,
              "checkpoint: ", p, " was written by rank ", top.integer("rank"), " of ",
              top.integer("world_size"), ", not rank ", rank, " of ", manifest.world_size);
  rf.data_start = align_up(kPrefixBytes + static_cast<int64_t>(header_bytes));
  const int64_t data_bytes = top.integer("data_bytes");
  TORCH_CHECK(rf.file.size() >= rf.data_start + data_bytes, "checkpoint: ", p,
              " is truncated: it has ", rf.file.size(), " bytes, its header says ",
              rf.data_start + data_bytes);
  for (const c10::IValue& ev : top.list("entries")) {
    const Fields e(ev, p, " (an entry)");
    HeaderEntry h;
    const int64_t dtype = e.integer("dtype");
    if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) {
      corrupt(p, "an entry has an unknown dtype");
    }
    h.dtype = static_cast<c10::ScalarType>(dtype);
    h.numel = e.integer("numel");
    h.offset = e.integer("offset");
    h.nbytes = e.integer("nbytes");
    h.crc = static_cast<uint32_t>(e.integer("crc32"));
    if (h.numel < 0 || h.offset < 0 ||
        h.nbytes != h.numel * static_cast<int64_t>(c10::elementSize(h.dtype)) ||
        h.offset + h.nbytes > data_bytes) {
      corrupt(p, "entry '" + e.str("key") + "' lies outside the data");
    }
    rf.entries.emplace(e.str("key"), h);
  }
  const Fields held = top.dict("held");
  for (const auto& item : held.raw()) {
    if (!item.key().isString() || !item.value().isList() || item.value().toListRef().size() != 2) {
      corrupt(p, "bad 'held' table");
    }
    const auto r = item.value().toListRef();
    rf.held[item.key().toStringRef()] = {r[0].toInt(), r[1].toInt()};
  }
  return rf;
}

// Copies elements [first, first + count) of entry `key` into `dst` (1-D, count elements).
void read_range(const RankFile& rf, const std::string& key, int64_t first, int64_t count,
                const at::Tensor& dst) {
  auto it = rf.entries.find(key);
  if (it == rf.entries.end()) {
    corrupt(rf.file.path(), "it has no entry '" + key + "' although the manifest says it should");
  }
  const HeaderEntry& h = it->second;
  if (first < 0 || first + count > h.numel) {
    corrupt(rf.file.path(), "entry '" + key + "' holds fewer elements than its held range");
  }
  const int64_t elsize = static_cast<int64_t>(c10::elementSize(h.dtype));
  at::Tensor buf =
      dst.scalar_type() == h.dtype ? dst : at::empty({count}, dst.options().dtype(h.dtype));
  rf.file.read(rf.data_start + h.offset + first * elsize, buf.data_ptr(),
               static_cast<size_t>(count * elsize));
  if (first == 0 && count == h.numel &&
      crc32(buf.data_ptr(), static_cast<size_t>(count * elsize)) != h.crc) {
    corrupt(rf.file.path(), "checksum mismatch in entry '" + key + "'");
  }
  if (!buf.is_same(dst)) dst.copy_(buf);
}

// One contiguous piece this rank needs from a saved rank's file.
struct Read {
  std::string key;
  int64_t first = 0;  // element in the saved entry
  int64_t count = 0;
  at::Tensor dst;  // a 1-D CPU view of count elements
};

}  // namespace

std::string save_checkpoint(const std::string& dir,
                            const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                            const std::vector<torch::optim::Optimizer*>& optimizers,
                            const SaveCheckpointOptions& options) {
  TORCH_CHECK(!groups.empty() && groups[0], "save_checkpoint: no parameter groups given");
  Communicator& comm = *groups[0]->communicator();
  const char* fn = "save_checkpoint";
  ModelIndex model;
  std::vector<OptimizerEntry> opts;
  detail::run_agreed(comm, fn, [&] {
    model = index_model(groups, fn);
    opts = index_optimizers(optimizers, model, fn);
  });
  int64_t sequence = 0;
  detail::run_agreed(comm, fn, [&] {
    if (comm.rank() == 0) sequence = create_folder(dir);
  });
  sequence = broadcast_int(comm, sequence);
  const std::string folder = join_path(dir, folder_name(sequence));
  int64_t bytes = 0;
  detail::run_agreed(comm, fn, [&] { bytes = write_rank_file(folder, model, opts); });
  const std::vector<int64_t> sizes = all_gather_int(comm, bytes);
  // The manifest is written only once every rank file is in place, and `latest` only once the
  // manifest is: a checkpoint is complete iff its manifest exists.
  detail::run_agreed(comm, fn, [&] {
    if (comm.rank() != 0) return;
    c10::impl::GenericDict manifest = describe(model, opts);
    manifest.insert("type", std::string("manifest"));
    manifest.insert("sequence", sequence);
    c10::impl::GenericList files(c10::AnyType::get());
    c10::impl::GenericList file_bytes(c10::AnyType::get());
    for (int r = 0; r < comm.size(); ++r) {
      files.push_back(rank_file_name(r, comm.size()));
      file_bytes.push_back(sizes[r]);
    }
    manifest.insert("rank_files", files);
    manifest.insert("rank_file_bytes", file_bytes);
    const std::vector<char> data = pickle_save_plain(manifest);
    write_file_atomic(join_path(folder, kManifestName), {{data.data(), data.size()}});
    write_text_atomic(join_path(dir, kLatestName), folder_name(sequence) + "\n");
    prune(dir, sequence, options.keep_last());
  });
  return folder;
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  std::ifstream in(join_path(dir, kLatestName));
  if (!in) return std::nullopt;
  std::string name;
  std::getline(in, name);
  if (name.empty()) return std::nullopt;
  const std::string folder = join_path(dir, name);
  if (!path_exists(join_path(folder, kManifestName))) return std::nullopt;
  return folder;
}

void load_checkpoint(const std::string& dir,
                     const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                     const std::vector<torch::optim::Optimizer*>& optimizers) {
  TORCH_CHECK(!groups.empty() && groups[0], "load_checkpoint: no parameter groups given");
  Communicator& comm = *groups[0]->communicator();
  const char* fn = "load_checkpoint";
  ModelIndex model;
  std::vector<OptimizerEntry> opts;
  // What gets installed once every rank has read everything (nothing changes before).
  std::vector<std::vector<at::Tensor>> weights;              // [group][param], CPU
  std::vector<std::vector<ParamState>> states;               // [optimizer][flat param]
  std::vector<std::vector<std::vector<char>>> option_bytes;  // [optimizer][param group]
  detail::run_agreed(comm, fn, [&] {
    model = index_model(groups, fn);
    opts = index_optimizers(optimizers, model, fn);
    const std::string folder = resolve_folder(dir, fn);
    const SavedMeta saved = read_manifest(folder);
    check_same_model(saved, model, fn);
    check_same_optimizers(saved, model, opts, fn);

    // Options: parse into clones first, so a bad archive fails here and not half-way through
    // installing.
    for (size_t o = 0; o < opts.size(); ++o) {
      option_bytes.push_back(saved.optimizers[o].options);
      const auto& live = opts[o].optimizer->param_groups();
      for (size_t j = 0; j < live.size(); ++j) {
        auto clone = live[j].options().clone();
        options_from_bytes(*clone, saved.optimizers[o].options[j]);
      }
    }

    // Plan the reads: per saved rank, the pieces of its entries this rank now holds.
    std::map<int, std::vector<Read>> reads;
    auto plan = [&](const std::string& name, const at::Tensor& dst, int64_t a,
                    const std::function<std::string(const std::string&)>& key_of) {
      const auto [sg, si] = saved.by_name.at(name);
      const SavedGroup& group = saved.groups[sg];
      const SavedParam& param = group.params[si];
      const int64_t b = a + dst.numel();
      if (a == b) return;
      const int64_t s = group.shard_numel;
      const int lo = static_cast<int>((param.offset + a) / s);
      const int hi = static_cast<int>((param.offset + b - 1) / s);
      for (int r = lo; r <= hi; ++r) {
        const auto [c, d] = saved_held_range(group, param, r);
        const int64_t first = std::max(a, c);
        const int64_t last = std::min(b, d);
        if (first >= last) continue;
        reads[r].push_back(
            {key_of(name), first - c, last - first, dst.narrow(0, first - a, last - first)});
      }
    };
    for (size_t g = 0; g < model.groups.size(); ++g) {
      const auto& group = model.groups[g];
      std::vector<at::Tensor> w;
      for (size_t i = 0; i < group->num_parameters(); ++i) {
        const auto [a, b] = group->held_range(i);
        at::Tensor dst = at::empty({b - a}, at::TensorOptions().dtype(group->main_dtype()));
        plan(group->slot(i).name, dst, a, weight_key);
        w.push_back(dst);
      }
      weights.push_back(std::move(w));
    }
    for (size_t o = 0; o < opts.size(); ++o) {
      const SavedOptimizer& so = saved.optimizers[o];
      std::vector<ParamState> per_param;
      for (const auto& refs : opts[o].param_groups) {
        for (const ParamRef& ref : refs) {
          const auto& group = model.groups[ref.group];
          const std::string& name = group->slot(ref.index).name;
          ParamState state;
          auto it = so.state.find(name);
          if (it != so.state.end()) {
            state.present = true;
            state.step = it->second.step;
            const auto [a, b] = group->held_range(ref.index);
            for (const std::string& key : it->second.keys) {
              const auto& known = state_keys(opts[o].kind);
              TORCH_CHECK(std::find(known.begin(), known.end(), key) != known.end(), fn, ": ",
                          saved.path, " has optimizer state '", key, "' for '", name, "', which a ",
                          so.kind, " optimizer does not keep");
              at::Tensor dst = at::empty({b - a}, at::TensorOptions().dtype(group->main_dtype()));
              plan(name, dst, a, [&](const std::string& n) { return state_key(o, n, key); });
              state.tensors.emplace_back(key, dst);
            }
          }
          per_param.push_back(std::move(state));
        }
      }
      states.push_back(std::move(per_param));
    }

    // Only the saved rank files this rank's shards overlap are opened.
    for (auto& [rank, pieces] : reads) {
      const RankFile rf = open_rank_file(saved, folder, rank, fn);
      for (const Read& piece : pieces)
        read_range(rf, piece.key, piece.first, piece.count, piece.dst);
    }
  });

  install_weights(model, weights);
  for (size_t o = 0; o < opts.size(); ++o) {
    size_t k = 0;
    auto& live = opts[o].optimizer->param_groups();
    for (size_t j = 0; j < opts[o].param_groups.size(); ++j) {
      options_from_bytes(live[j].options(), option_bytes[o][j]);
      for (const ParamRef& ref : opts[o].param_groups[j]) {
        install_state(opts[o], model.shard(ref), states[o][k++]);
      }
    }
  }
}

}  // namespace fsdp_muon
