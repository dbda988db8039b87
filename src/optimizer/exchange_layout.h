#pragma once
// Where each matrix's pieces sit in one FSDP group's gather and scatter buffers
// (docs/DESIGN.md §3). Internal header.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fsdp_muon::detail {

// Who owns one matrix and which elements of it each rank holds.
struct MatrixPlacement {
  int owner = -1;
  // [rank] elements [first, second) of the flattened matrix; the ranges tile it in rank order.
  std::vector<std::pair<int64_t, int64_t>> held;

  int64_t held_numel(int rank) const { return held[rank].second - held[rank].first; }
  int64_t numel() const { return held.empty() ? 0 : held.back().second; }
};

// Offsets of one group's gather (and, mirrored, scatter) for one set of active matrices.
// Gather: this rank's send block for owner d holds its pieces of d's matrices in group order;
// the owner's receive block from holder s likewise. The scatter sends the same blocks back, so it
// reuses both buffers with the roles swapped.
struct ExchangeLayout {
  std::vector<bool> active;          // [local matrix] the active set it was laid out for
  bool moves = false;                // whether any rank sends anything (the same on every rank)
  std::vector<int64_t> send_counts;  // [rank]
  std::vector<int64_t> recv_counts;  // [rank]
  std::vector<int64_t> send_offset;  // [local matrix] -1: not sent
  std::vector<std::vector<int64_t>> recv_offset;  // [local matrix][rank] -1: not received
  int64_t send_numel = 0;
  int64_t recv_numel = 0;
};

// The layout on `rank` for the group's matrices (in group order) whose `active` flag is set.
ExchangeLayout layout_exchange(const std::vector<MatrixPlacement>& matrices,
                               const std::vector<bool>& active, int rank, int world);

}  // namespace fsdp_muon::detail
