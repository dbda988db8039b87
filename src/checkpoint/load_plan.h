#pragma once
// Which saved byte ranges this rank reads to fill what it holds under the current layout
// (docs/DESIGN.md §6). A saved group's flat buffer was cut into world_size shards of
// shard_numel elements, saved rank r holding [r * shard_numel, (r + 1) * shard_numel); the
// slice of a parameter this rank holds now overlaps a run of consecutive saved ranks, and each
// overlap is one positional read from that rank's file. Saved files no overlap touches are
// never opened: a rank reads the bytes it holds now and nothing else.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "checkpoint/metadata.h"
#include "checkpoint/model_index.h"
#include "checkpoint/optimizer_state.h"

namespace fsdp_muon::checkpoint {

// One contiguous piece of one entry of a saved rank file.
struct RangeRead {
  std::string key;    // the entry (weight_entry_key, state_entry_key)
  int64_t first = 0;  // its first element to read
  int64_t count = 0;
  at::Tensor dst;  // a 1-D CPU view of `count` elements
};

struct LoadPlan {
  // Keyed by saved rank: the only files the load opens.
  std::map<int, std::vector<RangeRead>> reads_by_saved_rank;
  // Where the reads land, in the main dtype: this rank's slice of every parameter's weights
  // ([group][param]) and of its saved optimizer state ([optimizer][flat param]).
  std::vector<std::vector<at::Tensor>> weights;
  // Absent state (present == false) is engaged too: installing it removes the state the live
  // optimizer has made since the save.
  std::vector<std::vector<std::optional<ParamState>>> states;
};

// Plans the reads of the checkpoint `saved` describes into buffers for the live layout. `saved`
// must have passed check_same_model and check_same_optimizers.
LoadPlan plan_load(const SavedMeta& saved, const ModelIndex& model,
                   const std::vector<OptimizerEntry>& opts);

// Opens the saved rank files in `folder` that the plan reads from, only those, and performs
// its reads.
void read_planned(const LoadPlan& plan, const SavedMeta& saved, const std::string& folder);

}  // namespace fsdp_muon::checkpoint
