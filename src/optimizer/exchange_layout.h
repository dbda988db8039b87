#pragma once
// Where each matrix's pieces sit in one FSDP group's gather and scatter buffers
// (docs/DESIGN.md §3). Internal header.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "muon/row_state.h"

namespace fsdp_muon::detail {

// Who owns one matrix and which elements of it each rank holds.
struct MatrixPlacement {
  int owner = -1;
  // [rank] elements [first, second) of the flattened matrix; the ranges tile it in rank order.
  std::vector<std::pair<int64_t, int64_t>> held;

  // Columns of the matrix: where its rows start, for per-row state (0: none travels).
  int64_t cols = 0;

  int64_t held_numel(int rank) const { return held[rank].second - held[rank].first; }
  int64_t numel() const { return held.empty() ? 0 : held.back().second; }
  // The rows whose per-row state `rank` keeps (detail::rows_starting_in).
  std::pair<int64_t, int64_t> held_rows(int rank) const {
    return rows_starting_in(held[rank], cols);
  }
  int64_t held_rows_numel(int rank) const {
    const auto [first, last] = held_rows(rank);
    return last - first;
  }
};

// Offsets of one group's gather (and, mirrored, scatter) for one set of active matrices.
// Gather: this rank's send block for owner d holds its pieces of d's matrices in group order;
// the owner's receive block from holder s likewise. The scatter sends the same blocks back, so it
// reuses both buffers with the roles swapped. A matrix whose per-row state travels with it
// (NorMuon, docs/DESIGN.md §3) has, right after each piece, the state of the rows the holder
// keeps: a piece is held_numel + held_rows_numel elements long.
struct ExchangeLayout {
  std::vector<bool> active;          // [local matrix] the active set it was laid out for
  std::vector<bool> with_rows;       // [local matrix] carries its per-row state
  bool moves = false;                // whether any rank sends anything (the same on every rank)
  std::vector<int64_t> send_counts;  // [rank]
  std::vector<int64_t> recv_counts;  // [rank]
  std::vector<int64_t> send_offset;  // [local matrix] -1: not sent
  std::vector<std::vector<int64_t>> recv_offset;  // [local matrix][rank] -1: not received
  int64_t send_numel = 0;
  int64_t recv_numel = 0;
};

// The layout on `rank` for the group's matrices (in group order) whose `active` flag is set;
// those whose `with_rows` flag is set carry their per-row state (empty: none does).
ExchangeLayout layout_exchange(const std::vector<MatrixPlacement>& matrices,
                               const std::vector<bool>& active, int rank, int world,
                               const std::vector<bool>& with_rows = {});

}  // namespace fsdp_muon::detail
