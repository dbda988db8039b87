#include "optimizer/step_views.h"

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon::detail {

std::vector<at::Tensor> slices_of(const at::Tensor& flat,
                                  const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  std::vector<at::Tensor> out(ranges.size());
  if (ranges.empty()) return out;
  std::vector<size_t> order(ranges.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return ranges[a].first < ranges[b].first; });
  // [size], and for each range the index of its piece; the gaps between ranges are pieces too.
  std::vector<int64_t> sizes;
  std::vector<size_t> piece(ranges.size());
  int64_t at = 0;
  for (size_t i : order) {
    const auto [offset, length] = ranges[i];
    FSDP_MUON_CHECK(offset >= at && length >= 0 && offset + length <= flat.numel(),
                    "internal error: slice [", offset, ", ", offset + length, ") of a ",
                    flat.numel(), "-element buffer overlaps another or lies outside it");
    if (offset > at) sizes.push_back(offset - at);
    piece[i] = sizes.size();
    sizes.push_back(length);
    at = offset + length;
  }
  if (at < flat.numel()) sizes.push_back(flat.numel() - at);
  const std::vector<at::Tensor> pieces = flat.split_with_sizes(sizes);
  for (size_t i = 0; i < ranges.size(); ++i) out[i] = pieces[piece[i]];
  return out;
}

const at::Tensor& PieceViews::get(size_t m, const at::Tensor& base, int64_t first, int64_t length) {
  if (m >= entries_.size()) entries_.resize(m + 1);
  Entry& e = entries_[m];
  const void* data = base.data_ptr();
  const void* storage = base.storage().unsafeGetStorageImpl();
  // The view holds the storage it was made from, so while `storage` is that storage and the base
  // starts at the same place, the same elements are meant (a 1-D base of stride 1: sharded
  // tensors and momentum buffers are).
  if (e.data != data || e.storage != storage || e.first != first || e.length != length ||
      !e.view.defined() || e.view.scalar_type() != base.scalar_type() || base.dim() != 1 ||
      base.stride(0) != 1) {
    e = Entry{data, storage, first, length, base.narrow(0, first, length)};
  }
  return e.view;
}

}  // namespace fsdp_muon::detail
