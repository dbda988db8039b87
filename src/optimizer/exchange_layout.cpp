#include "optimizer/exchange_layout.h"

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon::detail {

int64_t ExchangeLayout::scatter_inter_replica_numel(int rank) const {
  const int size = shard_size();
  int64_t numel = 0;
  for (int q = 0; q < static_cast<int>(scatter.send_counts.size()); ++q) {
    if (q / size != rank / size) numel += scatter.send_counts[q];
  }
  return numel;
}

ExchangeLayout layout_exchange(const std::vector<MatrixPlacement>& matrices,
                               const std::vector<bool>& active, int rank, int world,
                               const std::vector<bool>& with_rows, int replicas, bool relay) {
  const std::size_t n = matrices.size();
  // Internal callers build these from one plan; a mismatch is a bug there, caught here before
  // it becomes an out-of-range index.
  FSDP_MUON_API_SCOPE("detail::layout_exchange");
  FSDP_MUON_CHECK(active.size() == n, active.size(), " active flags for ", n, " matrices");
  FSDP_MUON_CHECK(with_rows.empty() || with_rows.size() == n, with_rows.size(),
                  " per-row state flags for ", n, " matrices");
  FSDP_MUON_CHECK(rank >= 0 && rank < world, "rank ", rank, " is outside the world of ", world);
  FSDP_MUON_CHECK(replicas >= 1 && world % replicas == 0, replicas,
                  " replicas do not divide the world of ", world);
  const int size = world / replicas;  // shard ranks per replica
  for (std::size_t j = 0; j < n; ++j) {
    FSDP_MUON_CHECK(matrices[j].shard_size() == size, "matrix ", j, " has held ranges for ",
                    matrices[j].held.size(), " ranks in a world of ", world, " (", replicas,
                    " replica(s) of ", size, ")");
    FSDP_MUON_CHECK(matrices[j].owner >= 0 && matrices[j].owner < world, "matrix ", j,
                    " has owner ", matrices[j].owner, " outside the world of ", world);
  }
  ExchangeLayout x;
  x.active = active;
  x.with_rows = with_rows.empty() ? std::vector<bool>(n, false) : with_rows;
  x.replicas = replicas;
  x.mirrored = replicas == 1 || relay;
  for (std::size_t j = 0; j < n; ++j) {
    FSDP_MUON_CHECK(!x.with_rows[j] || matrices[j].cols > 0, "matrix ", j,
                    " carries per-row state but has no columns");
  }
  // Exchange rank q's piece of matrix j: the elements of its shard rank, then (with_rows) the
  // state of its rows.
  const auto piece = [&](std::size_t j, int q) {
    const MatrixPlacement& m = matrices[j];
    const int holder = q % size;
    return m.held_numel(holder) + (x.with_rows[j] ? m.held_rows_numel(holder) : 0);
  };
  const auto same_replica = [&](int a, int b) { return a / size == b / size; };
  for (ExchangeBlocks* blocks : {&x.gather, &x.scatter}) {
    blocks->send_counts.assign(world, 0);
    blocks->recv_counts.assign(world, 0);
  }
  x.gather_send_offset.assign(n, -1);
  x.scatter_recv_offset.assign(n, -1);
  x.gather_recv_offset.assign(n, std::vector<int64_t>(world, -1));
  x.scatter_send_offset.assign(n, std::vector<int64_t>(world, -1));
  // Puts a piece of `len` elements at the end of a buffer of `numel` (its offset there) and
  // counts it in its peer's block.
  const auto add = [](int64_t& offset, int64_t& numel, int64_t& count, int64_t len) {
    offset = numel;
    numel += len;
    count += len;
  };
  // Blocks in rank order, matrices in round order inside a block: what all_to_all_v expects.
  // This rank as a holder: the gather sends to the owners of its replica, the scatter receives
  // from every owner.
  for (int owner = 0; owner < world; ++owner) {
    if (owner == rank) continue;
    for (std::size_t j = 0; j < n; ++j) {
      const int64_t len = piece(j, rank);
      if (!active[j] || matrices[j].owner != owner || len == 0) continue;
      if (same_replica(owner, rank)) {
        add(x.gather_send_offset[j], x.gather.send_numel, x.gather.send_counts[owner], len);
      }
      if (relay && !same_replica(owner, rank)) continue;
      add(x.scatter_recv_offset[j], x.scatter.recv_numel, x.scatter.recv_counts[owner], len);
    }
  }
  // This rank as an owner: the gather receives from the holders of its replica, the scatter
  // sends to the holders of every replica.
  for (int holder = 0; holder < world; ++holder) {
    if (holder == rank) continue;
    for (std::size_t j = 0; j < n; ++j) {
      const int64_t len = piece(j, holder);
      if (!active[j] || matrices[j].owner != rank || len == 0) continue;
      if (same_replica(holder, rank)) {
        add(x.gather_recv_offset[j][holder], x.gather.recv_numel, x.gather.recv_counts[holder],
            len);
      }
      if (relay && !same_replica(holder, rank)) continue;
      add(x.scatter_send_offset[j][holder], x.scatter.send_numel, x.scatter.send_counts[holder],
          len);
    }
  }
  for (std::size_t j = 0; j < n; ++j) {
    const MatrixPlacement& m = matrices[j];
    if (!active[j]) continue;
    // Something of the matrix is held outside the owner: by its replica's other shard ranks,
    // or (scatter only) by any rank of another replica.
    const bool outside_owner = m.numel() > m.held_numel(m.owner % size);
    x.gather_moves = x.gather_moves || outside_owner;
    x.scatter_moves = x.scatter_moves || outside_owner || (replicas > 1 && !relay && m.numel() > 0);
  }
  return x;
}

RelayLayout layout_relay(const std::vector<MatrixPlacement>& matrices,
                         const std::vector<bool>& active, const std::vector<bool>& with_rows,
                         int shard_rank, int replica, int replicas) {
  const std::size_t n = matrices.size();
  FSDP_MUON_API_SCOPE("detail::layout_relay");
  FSDP_MUON_CHECK(active.size() == n && with_rows.size() == n, active.size(), " active and ",
                  with_rows.size(), " per-row state flags for ", n, " matrices");
  FSDP_MUON_CHECK(replica >= 0 && replica < replicas, "replica ", replica, " of ", replicas);
  RelayLayout x;
  x.recv_counts.assign(replicas, 0);
  x.recv_offset.assign(n, -1);
  x.send_offset.assign(n, -1);
  // Block by block (replica order), matrices in round order inside each: what all_gather_v
  // expects, and every rank of the replicate group computes the same counts.
  for (int r = 0; r < replicas; ++r) {
    const int64_t block_start = x.recv_numel;
    for (std::size_t j = 0; j < n; ++j) {
      const MatrixPlacement& m = matrices[j];
      FSDP_MUON_CHECK(shard_rank < m.shard_size(), "shard rank ", shard_rank, " outside matrix ", j,
                      "'s ", m.shard_size(), " held ranges");
      if (!active[j] || m.owner < 0 || m.owner / m.shard_size() != r) continue;
      const int64_t len =
          m.held_numel(shard_rank) + (with_rows[j] ? m.held_rows_numel(shard_rank) : 0);
      if (len == 0) continue;
      x.recv_offset[j] = x.recv_numel;
      if (r == replica) x.send_offset[j] = x.recv_numel - block_start;
      x.recv_numel += len;
    }
    x.recv_counts[r] = x.recv_numel - block_start;
    x.moves = x.moves || (replicas > 1 && x.recv_counts[r] > 0);
  }
  x.send_numel = x.recv_counts[replica];
  return x;
}

}  // namespace fsdp_muon::detail
