#pragma once
// Where each matrix's pieces sit in one round's gather and scatter buffers (docs/DESIGN.md §3).
// Internal header.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "muon/row_state.h"

namespace fsdp_muon::detail {

// Who owns one matrix and which elements of it each shard rank holds.
struct MatrixPlacement {
  // An exchange rank (see layout_exchange): a shard rank in a 1-D exchange, a world rank when
  // the exchange spans the replicas.
  int owner = -1;
  // [shard rank] elements [first, second) of the flattened matrix; the ranges tile it in rank
  // order. Every replica holds the same ranges.
  std::vector<std::pair<int64_t, int64_t>> held;

  // Columns of the matrix: where its rows start, for per-row state (0: none travels).
  int64_t cols = 0;

  int shard_size() const { return static_cast<int>(held.size()); }
  int64_t held_numel(int shard_rank) const {
    return held[shard_rank].second - held[shard_rank].first;
  }
  int64_t numel() const { return held.empty() ? 0 : held.back().second; }
  // The rows whose per-row state `shard_rank` keeps (detail::rows_starting_in).
  std::pair<int64_t, int64_t> held_rows(int shard_rank) const {
    return rows_starting_in(held[shard_rank], cols);
  }
  int64_t held_rows_numel(int shard_rank) const {
    const auto [first, last] = held_rows(shard_rank);
    return last - first;
  }
};

// The counts of one all-to-all-v, per exchange rank, and the lengths of its two buffers.
struct ExchangeBlocks {
  std::vector<int64_t> send_counts;  // [exchange rank]
  std::vector<int64_t> recv_counts;  // [exchange rank]
  int64_t send_numel = 0;
  int64_t recv_numel = 0;
};

// Offsets of one round's gather and scatter for one set of active matrices (docs/DESIGN.md §3).
//
// The exchange runs over `world` exchange ranks forming `replicas` replicas of shard_size ranks
// each, replica-major (exchange rank q is shard rank q % shard_size of replica q / shard_size).
// One replica is the 1-D exchange (FSDP over one mesh dimension, or each replica on its own).
// Gather: a holder sends its pieces to the owners in its own replica, a block per owner in rank
// order, matrices in round order inside a block; an owner receives, likewise, a block per holder
// of its replica. Scatter: an owner sends every holder in every replica its slice of the update;
// a holder receives from every owner. With one replica the scatter sends back exactly the
// gather's blocks (`mirrored`), so it reuses both buffers with the roles swapped. A matrix whose
// per-row state travels with it (NorMuon) has, right after each piece, the state of the rows the
// holder keeps: a piece is held_numel + held_rows_numel elements long.
struct ExchangeLayout {
  std::vector<bool> active;     // [local matrix] the active set it was laid out for
  std::vector<bool> with_rows;  // [local matrix] carries its per-row state
  int replicas = 1;
  // Whether the scatter's blocks are the gather's with send and receive swapped (one replica).
  bool mirrored = true;
  // Whether any rank sends anything in the gather / the scatter (the same on every rank).
  bool gather_moves = false;
  bool scatter_moves = false;
  ExchangeBlocks gather;
  ExchangeBlocks scatter;
  // [local matrix] where this rank's piece sits in the gather's send buffer / the scatter's
  // receive buffer; -1: none.
  std::vector<int64_t> gather_send_offset;
  std::vector<int64_t> scatter_recv_offset;
  // [local matrix][exchange rank] where that rank's piece sits in the owner's gather receive
  // buffer / scatter send buffer; -1: none.
  std::vector<std::vector<int64_t>> gather_recv_offset;
  std::vector<std::vector<int64_t>> scatter_send_offset;

  int shard_size() const { return static_cast<int>(gather.send_counts.size()) / replicas; }
  // Elements this rank sends to ranks of other replicas (the scatter's inter-node part; the
  // gather never leaves a replica).
  int64_t scatter_inter_replica_numel(int rank) const;
};

// The layout on exchange rank `rank` of `world` for the round's matrices whose `active` flag is
// set; those whose `with_rows` flag is set carry their per-row state (empty: none does). Every
// placement holds world / replicas ranges.
ExchangeLayout layout_exchange(const std::vector<MatrixPlacement>& matrices,
                               const std::vector<bool>& active, int rank, int world,
                               const std::vector<bool>& with_rows = {}, int replicas = 1);

}  // namespace fsdp_muon::detail
