#include "fsdp/flat_layout.h"

#include <algorithm>

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon {
namespace fsdp {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

FlatLayout compute_flat_layout(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& named_shapes,
    int64_t alignment, int world_size) {
  FSDP_MUON_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size);
  FSDP_MUON_CHECK(alignment >= 1, "alignment must be at least 1 element, got ", alignment);
  FlatLayout layout;
  layout.world_size = world_size;
  layout.alignment = alignment;
  layout.slots.reserve(named_shapes.size());
  int64_t cursor = 0;
  for (const auto& [name, shape] : named_shapes) {
    ParameterSlot slot;
    slot.name = name;
    slot.shape = shape;
    slot.numel = 1;
    for (int64_t d : shape) {
      FSDP_MUON_CHECK(d >= 0, "parameter '", name, "' has a negative size");
      slot.numel *= d;
    }
    slot.offset = round_up(cursor, alignment);
    cursor = slot.offset + slot.numel;
    layout.slots.push_back(std::move(slot));
  }
  layout.unpadded_numel = cursor;
  layout.padded_numel = round_up(cursor, static_cast<int64_t>(world_size) * alignment);
  layout.shard_numel = layout.padded_numel / world_size;
  return layout;
}

std::pair<int64_t, int64_t> FlatLayout::held_range(size_t index, int rank) const {
  FSDP_MUON_CHECK(index < slots.size(), "parameter index ", index, " out of range (", slots.size(),
                  " parameters)");
  FSDP_MUON_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " outside [0, ", world_size, ")");
  const ParameterSlot& slot = slots[index];
  const int64_t begin = static_cast<int64_t>(rank) * shard_numel - slot.offset;
  const int64_t end = begin + shard_numel;
  return {std::clamp<int64_t>(begin, 0, slot.numel), std::clamp<int64_t>(end, 0, slot.numel)};
}

int64_t FlatLayout::shard_offset(size_t index, int rank) const {
  const auto [first, second] = held_range(index, rank);
  if (first == second) return 0;
  return slots[index].offset + first - static_cast<int64_t>(rank) * shard_numel;
}

}  // namespace fsdp
}  // namespace fsdp_muon
