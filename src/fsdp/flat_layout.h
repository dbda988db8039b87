#pragma once
// The flat layout of an FsdpParameterGroup as a pure function of the parameter shapes, the
// element alignment and the world size (docs/DESIGN.md §2), so it can be checked for any world size
// without processes and recomputed by code that reshards (checkpoints).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <fsdp_muon/fsdp/parameter_group.h>

namespace fsdp_muon {
namespace fsdp {

struct FlatLayout {
  std::vector<ParameterSlot> slots;
  int world_size = 1;
  int64_t alignment = 1;       // in elements
  int64_t unpadded_numel = 0;  // end of the last parameter
  int64_t padded_numel = 0;    // multiple of world_size (and of world_size * alignment)
  int64_t shard_numel = 0;     // padded_numel / world_size

  // Elements [first, second) of parameter `index` (flattened, row-major) held by `rank`.
  // Always 0 <= first <= second <= numel, and the ranges of ranks 0..W-1 tile [0, numel) in
  // order, so first == second exactly when the rank holds none of it.
  std::pair<int64_t, int64_t> held_range(size_t index, int rank) const;
  // Element offset inside `rank`'s shard where held_range(index, rank) starts (0 when empty).
  int64_t shard_offset(size_t index, int rank) const;
};

// Packs parameters in the order given. Each parameter starts at a multiple of `alignment`
// elements; the total is padded to a multiple of world_size * alignment, so every rank's shard
// starts aligned too (collectives on aligned blocks are faster, and the padding is at most
// world_size * alignment - 1 elements).
FlatLayout compute_flat_layout(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& named_shapes,
    int64_t alignment, int world_size);

}  // namespace fsdp
}  // namespace fsdp_muon
