#include "optimizer/exchange_layout.h"

#include <c10/util/Exception.h>

namespace fsdp_muon::detail {

ExchangeLayout layout_exchange(const std::vector<MatrixPlacement>& matrices,
                               const std::vector<bool>& active, int rank, int world,
                               const std::vector<bool>& with_rows) {
  const std::size_t n = matrices.size();
  // Internal callers build these from one plan; a mismatch is a bug there, caught here before
  // it becomes an out-of-range index.
  const char* api = "fsdp_muon::detail::layout_exchange: ";
  TORCH_CHECK(active.size() == n, api, active.size(), " active flags for ", n, " matrices");
  TORCH_CHECK(with_rows.empty() || with_rows.size() == n, api, with_rows.size(),
              " per-row state flags for ", n, " matrices");
  TORCH_CHECK(rank >= 0 && rank < world, api, "rank ", rank, " is outside the world of ", world);
  for (std::size_t j = 0; j < n; ++j) {
    TORCH_CHECK(matrices[j].held.size() == static_cast<std::size_t>(world), api, "matrix ", j,
                " has held ranges for ", matrices[j].held.size(), " ranks in a world of ", world);
    TORCH_CHECK(matrices[j].owner >= 0 && matrices[j].owner < world, api, "matrix ", j,
                " has owner ", matrices[j].owner, " outside the world of ", world);
  }
  ExchangeLayout x;
  x.active = active;
  x.with_rows = with_rows.empty() ? std::vector<bool>(n, false) : with_rows;
  for (std::size_t j = 0; j < n; ++j) {
    TORCH_CHECK(!x.with_rows[j] || matrices[j].cols > 0, api, "matrix ", j,
                " carries per-row state but has no columns");
  }
  // A holder's piece of matrix j: its elements, then (with_rows) the state of its rows.
  const auto piece = [&](std::size_t j, int holder) {
    const MatrixPlacement& m = matrices[j];
    return m.held_numel(holder) + (x.with_rows[j] ? m.held_rows_numel(holder) : 0);
  };
  x.send_counts.assign(world, 0);
  x.recv_counts.assign(world, 0);
  x.send_offset.assign(n, -1);
  x.recv_offset.assign(n, std::vector<int64_t>(world, -1));
  // Blocks in rank order, matrices in group order inside a block: what all_to_all_v expects.
  for (int owner = 0; owner < world; ++owner) {
    if (owner == rank) continue;
    for (std::size_t j = 0; j < n; ++j) {
      const MatrixPlacement& m = matrices[j];
      const int64_t len = piece(j, rank);
      if (!active[j] || m.owner != owner || len == 0) continue;
      x.send_offset[j] = x.send_numel;
      x.send_numel += len;
      x.send_counts[owner] += len;
    }
  }
  for (int holder = 0; holder < world; ++holder) {
    if (holder == rank) continue;
    for (std::size_t j = 0; j < n; ++j) {
      const MatrixPlacement& m = matrices[j];
      const int64_t len = piece(j, holder);
      if (!active[j] || m.owner != rank || len == 0) continue;
      x.recv_offset[j][holder] = x.recv_numel;
      x.recv_numel += len;
      x.recv_counts[holder] += len;
    }
  }
  for (std::size_t j = 0; j < n; ++j) {
    const MatrixPlacement& m = matrices[j];
    if (active[j] && m.numel() > m.held_numel(m.owner)) x.moves = true;
  }
  return x;
}

}  // namespace fsdp_muon::detail
