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

// kOncePerWorldRelay's stage B on the rank with shard rank `shard_rank` in replica `replica`
// (docs/DESIGN.md §3): one all-gather-v over its replicate group (rank r there: replica r).
// Replica r's block holds, in round order, the pieces (update slice, then the per-row state
// where it travels) shard rank `shard_rank` holds of the active matrices owned in replica r.
struct RelayLayout {
  std::vector<int64_t> recv_counts;  // [replica] its block's length
  int64_t send_numel = 0;            // this rank's block: recv_counts[replica]
  int64_t recv_numel = 0;
  // [local matrix] where this rank's piece sits in the receive buffer (its owner's replica's
  // block) / in this rank's send block; -1: none.
  std::vector<int64_t> recv_offset;
  std::vector<int64_t> send_offset;
  // Whether any block is non-empty (the same on every rank of the replicate group).
  bool moves = false;
};

// Offsets of one round's gather and scatter for one set of active matrices (docs/DESIGN.md §3).
//
// The exchange runs over `world` exchange ranks forming `replicas` replicas of shard_size ranks
// each, replica-major (exchange rank q is shard rank q % shard_size of replica q / shard_size).
// One replica is the 1-D exchange (FSDP over one mesh dimension, or each replica on its own).
// Gather: a holder sends its pieces to the owners in its own replica, a block per owner in rank
// order, matrices in round order inside a block; an owner receives, likewise, a block per holder
// of its replica. Scatter: an owner sends every holder in every replica its slice of the update;
// a holder receives from every owner (the relay's stage A: every holder in the owner's replica).
// With one replica, or in the relay's stage A, the scatter sends back exactly the gather's blocks
// (`mirrored`), so it reuses both buffers with the roles swapped. A matrix whose
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

  // kOncePerWorldRelay on several replicas: stage B (laid out by Impl::exchange).
  RelayLayout relay;

  int shard_size() const { return static_cast<int>(gather.send_counts.size()) / replicas; }
  // Elements this rank sends to ranks of other replicas (the scatter's inter-node part; the
  // gather never leaves a replica).
  int64_t scatter_inter_replica_numel(int rank) const;
};

// The layout on exchange rank `rank` of `world` for the round's matrices whose `active` flag is
// set; those whose `with_rows` flag is set carry their per-row state (empty: none does). Every
// placement holds world / replicas ranges. `relay` (kOncePerWorldRelay's stage A): the scatter
// goes to the holders in the owner's replica only, so it is the gather mirrored.
ExchangeLayout layout_exchange(const std::vector<MatrixPlacement>& matrices,
                               const std::vector<bool>& active, int rank, int world,
                               const std::vector<bool>& with_rows = {}, int replicas = 1,
                               bool relay = false);

// The relay's stage B for the round's matrices whose `active` flag is set (`with_rows`: their
// per-row state travels, one flag per matrix).
RelayLayout layout_relay(const std::vector<MatrixPlacement>& matrices,
                         const std::vector<bool>& active, const std::vector<bool>& with_rows,
                         int shard_rank, int replica, int replicas);

}  // namespace fsdp_muon::detail
