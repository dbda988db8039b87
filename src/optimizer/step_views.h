#pragma once
// Views the step takes of many matrices at once, so that finding them costs no ATen call per
// matrix (docs/DESIGN.md §4, "Kernels per step"). Internal header.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp_muon::detail {

// Views of `flat` (1-D) at each range (offset, length), made by one split_with_sizes over the
// ranges in offset order. The ranges must not overlap; an empty range gives an empty view.
std::vector<at::Tensor> slices_of(const at::Tensor& flat,
                                  const std::vector<std::pair<int64_t, int64_t>>& ranges);

// This rank's piece of each matrix in a tensor the step reads every step (a parameter's shard,
// its gradient, its momentum buffer), kept from one step to the next while that tensor keeps
// its storage and place in it. A view holds the storage it was made from, so a tensor replaced
// (a checkpoint load replaces momentum buffers) keeps its old storage until the next step.
class PieceViews {
 public:
  // Elements [first, first + length) of `base` (1-D) for matrix m.
  const at::Tensor& get(size_t m, const at::Tensor& base, int64_t first, int64_t length);

 private:
  struct Entry {
    const void* data = nullptr;  // base's data pointer when the view was made
    const void* storage = nullptr;
    int64_t first = -1;
    int64_t length = -1;
    at::Tensor view;
  };
  std::vector<Entry> entries_;
};

}  // namespace fsdp_muon::detail
