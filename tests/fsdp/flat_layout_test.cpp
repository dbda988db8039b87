// The flat layout as a pure function of (shapes, alignment, world size): checked for world
// sizes 1-4 in one process, the properties every rank's buffers rely on.

#include <gtest/gtest.h>

#include <numeric>

#include "fsdp/flat_layout.h"

namespace fsdp_muon {
namespace fsdp {
namespace {

using NamedShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

NamedShapes shapes_of(const std::vector<std::vector<int64_t>>& shapes) {
  NamedShapes named;
  for (size_t i = 0; i < shapes.size(); ++i) named.emplace_back("p" + std::to_string(i), shapes[i]);
  return named;
}

// Every property of the layout, derived from first principles rather than from the code.
void check_layout(const NamedShapes& shapes, int64_t alignment, int world) {
  SCOPED_TRACE("world " + std::to_string(world) + ", alignment " + std::to_string(alignment));
  const FlatLayout layout = compute_flat_layout(shapes, alignment, world);
  ASSERT_EQ(layout.slots.size(), shapes.size());
  EXPECT_EQ(layout.padded_numel % world, 0);
  EXPECT_EQ(layout.padded_numel % (world * alignment), 0);
  EXPECT_EQ(layout.shard_numel * world, layout.padded_numel);
  EXPECT_GE(layout.padded_numel, layout.unpadded_numel);
  EXPECT_LT(layout.padded_numel - layout.unpadded_numel, world * alignment);

  int64_t end_of_previous = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const ParameterSlot& slot = layout.slots[i];
    EXPECT_EQ(slot.name, shapes[i].first);
    EXPECT_EQ(slot.shape, shapes[i].second);
    const int64_t numel = std::accumulate(shapes[i].second.begin(), shapes[i].second.end(),
                                          int64_t{1}, std::multiplies<int64_t>());
    EXPECT_EQ(slot.numel, numel);
    EXPECT_EQ(slot.offset % alignment, 0) << slot.name;
    EXPECT_GE(slot.offset, end_of_previous) << slot.name << " overlaps its predecessor";
    EXPECT_LT(slot.offset - end_of_previous, alignment) << slot.name << " wastes space";
    end_of_previous = slot.offset + slot.numel;

    // Each element is held by exactly one rank, which owns its flat position, and sits at the
    // shard offset that rank's buffers use.
    std::vector<int> holders(numel, 0);
    for (int r = 0; r < world; ++r) {
      const auto [first, second] = layout.held_range(i, r);
      ASSERT_LE(0, first);
      ASSERT_LE(first, second);
      ASSERT_LE(second, numel);
      for (int64_t k = first; k < second; ++k) {
        ++holders[k];
        const int64_t flat = slot.offset + k;
        EXPECT_EQ(flat / layout.shard_numel, r) << slot.name << "[" << k << "]";
      }
      if (first < second) {
        EXPECT_EQ(layout.shard_offset(i, r), slot.offset + first - r * layout.shard_numel);
      } else {
        EXPECT_EQ(layout.shard_offset(i, r), 0);
      }
    }
    for (int64_t k = 0; k < numel; ++k) {
      EXPECT_EQ(holders[k], 1) << slot.name << "[" << k << "] held by " << holders[k] << " ranks";
    }
  }
  EXPECT_EQ(layout.unpadded_numel, end_of_previous);
}

const std::vector<std::vector<int64_t>> kMixedShapes = {{2}, {7, 5},    {1, 13}, {13, 1}, {3},
                                                        {0}, {4, 4, 3}, {1},     {11}};

TEST(FlatLayout, PropertiesHoldForWorldSizesOneToFour) {
  for (int world = 1; world <= 4; ++world) {
    for (int64_t alignment : {1, 4, 8}) {
      check_layout(shapes_of(kMixedShapes), alignment, world);
      check_layout(shapes_of({{1}}), alignment, world);
      check_layout(shapes_of({{1, 97}, {97, 1}}), alignment, world);
    }
  }
}

TEST(FlatLayout, ExactOffsetsAndRangesForAStraddlingParameter) {
  // p0: [0, 2); p1: 10 elements at [4, 14) after 4-element alignment; p2: [16, 17).
  // Padded to a multiple of 3 * 4 = 12: 24, shards of 8.
  const FlatLayout layout = compute_flat_layout(shapes_of({{2}, {2, 5}, {1}}), 4, 3);
  EXPECT_EQ(layout.slots[0].offset, 0);
  EXPECT_EQ(layout.slots[1].offset, 4);
  EXPECT_EQ(layout.slots[2].offset, 16);
  EXPECT_EQ(layout.unpadded_numel, 17);
  EXPECT_EQ(layout.padded_numel, 24);
  EXPECT_EQ(layout.shard_numel, 8);
  using Range = std::pair<int64_t, int64_t>;
  EXPECT_EQ(layout.held_range(0, 0), Range(0, 2));
  EXPECT_EQ(layout.held_range(0, 1), Range(2, 2));  // rank 1 holds none of p0
  EXPECT_EQ(layout.held_range(0, 2), Range(2, 2));
  EXPECT_EQ(layout.held_range(1, 0), Range(0, 4));  // p1 straddles all three ranks
  EXPECT_EQ(layout.held_range(1, 1), Range(4, 10));
  EXPECT_EQ(layout.held_range(1, 2), Range(10, 10));
  EXPECT_EQ(layout.held_range(2, 0), Range(0, 0));
  EXPECT_EQ(layout.held_range(2, 2), Range(0, 1));
  EXPECT_EQ(layout.shard_offset(1, 0), 4);
  EXPECT_EQ(layout.shard_offset(1, 1), 0);
  EXPECT_EQ(layout.shard_offset(2, 2), 0);
}

TEST(FlatLayout, StraddlesThreeRanksWithoutAlignment) {
  // 3 + 10 = 13 elements, padded to 16 at W=4: p1 = [3, 13) spans ranks 0..3.
  const FlatLayout layout = compute_flat_layout(shapes_of({{3}, {10}}), 1, 4);
  EXPECT_EQ(layout.padded_numel, 16);
  int holders = 0;
  for (int r = 0; r < 4; ++r) {
    const auto [first, second] = layout.held_range(1, r);
    holders += first < second;
  }
  EXPECT_EQ(holders, 4);
}

TEST(FlatLayout, RejectsBadArguments) {
  EXPECT_THROW(compute_flat_layout(shapes_of({{2}}), 1, 0), c10::Error);
  EXPECT_THROW(compute_flat_layout(shapes_of({{2}}), 0, 2), c10::Error);
  EXPECT_THROW(compute_flat_layout(shapes_of({{-1, 2}}), 1, 2), c10::Error);
  const FlatLayout layout = compute_flat_layout(shapes_of({{2}}), 1, 2);
  EXPECT_THROW(layout.held_range(1, 0), c10::Error);
  EXPECT_THROW(layout.held_range(0, 2), c10::Error);
}

}  // namespace
}  // namespace fsdp
}  // namespace fsdp_muon
