#pragma once
// Which rows of a sharded matrix a rank keeps per-row optimizer state for (NorMuon's
// `normuon_variance`, docs/DESIGN.md §4): the rows whose first element it holds. A pure function
// of the flat layout, shared by FsdpMuon's step and the checkpoint's save, load and resharding.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace fsdp_muon::detail {

// Rows [ceil(first / cols), ceil(last / cols)) of a matrix with `cols` columns for held
// elements [first, last) of its row-major flattening. As the held ranges of ranks 0..W-1 tile
// [0, rows * cols) in rank order, these tile [0, rows) in rank order; a rank may hold elements
// and no row start (a piece inside one row), never a row start without its element.
inline std::pair<int64_t, int64_t> rows_starting_in(std::pair<int64_t, int64_t> held,
                                                    int64_t cols) {
  if (cols <= 0) return {0, 0};
  const auto ceil_div = [cols](int64_t e) { return (e + cols - 1) / cols; };
  const int64_t first = ceil_div(held.first);
  return {first, std::max(first, ceil_div(held.second))};
}

// The columns of a parameter's rows for its row state: its last dimension, as a rows x cols
// matrix or E x m x n experts read as E·m rows of n (MatrixLayout::batched); 0 for a vector,
// which has no row state.
inline int64_t row_state_cols(const std::vector<int64_t>& shape) {
  return shape.size() >= 2 ? shape.back() : 0;
}

// How many rows of row state the whole parameter has (0 for a vector).
inline int64_t row_state_rows(const std::vector<int64_t>& shape) {
  const int64_t cols = row_state_cols(shape);
  if (cols <= 0) return 0;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  return numel / cols;
}

}  // namespace fsdp_muon::detail
