// layout_exchange on its own: the send and receive blocks of one round's gather and scatter for
// hand-worked placements: three matrices on three ranks of one replica (owners that hold all,
// part or none of their matrix; a rank holding nothing of one), whose scatter is the gather's
// mirror; three matrices on a 2x2 mesh whose owners gather in their own replica and scatter to
// every replica (rows of 1, a shard rank holding nothing, NorMuon's rows); peers that agree on
// every count on 3x2 and 2x3 meshes; inactive matrices; bad input.

#include <cstdint>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/test_util.h"
#include "optimizer/exchange_layout.h"

namespace fsdp_muon::detail {
namespace {

using Counts = std::vector<int64_t>;

// m0: owner 0, 6 elements: rank 0 holds [0, 4), rank 1 [4, 6), rank 2 none.
// m1: owner 2, 5 elements: rank 0 none, rank 1 [0, 3), rank 2 [3, 5).
// m2: owner 1, 2 elements: rank 0 holds all, the owner none.
std::vector<MatrixPlacement> three_matrices() {
  return {MatrixPlacement{0, {{0, 4}, {4, 6}, {6, 6}}},
          MatrixPlacement{2, {{0, 0}, {0, 3}, {3, 5}}},
          MatrixPlacement{1, {{0, 2}, {2, 2}, {2, 2}}}};
}

TEST(ExchangeLayout, PlacementAccessors) {
  const auto m = three_matrices();
  EXPECT_EQ(m[0].numel(), 6);
  EXPECT_EQ(m[0].held_numel(1), 2);
  EXPECT_EQ(m[0].held_numel(2), 0);
  EXPECT_EQ(MatrixPlacement{}.numel(), 0);
}

TEST(ExchangeLayout, HandWorkedThreeRanks) {
  const auto m = three_matrices();
  const std::vector<bool> all{true, true, true};
  // Rank 0 sends its m2 (2) to owner 1 and has none of m1 for owner 2; it receives m0's piece
  // from rank 1 (2).
  const ExchangeLayout r0 = layout_exchange(m, all, 0, 3);
  EXPECT_EQ(r0.gather.send_counts, (Counts{0, 2, 0}));
  EXPECT_EQ(r0.gather_send_offset, (Counts{-1, -1, 0}));
  EXPECT_EQ(r0.gather.send_numel, 2);
  EXPECT_EQ(r0.gather.recv_counts, (Counts{0, 2, 0}));
  EXPECT_EQ(r0.gather_recv_offset, (std::vector<Counts>{{-1, 0, -1}, {-1, -1, -1}, {-1, -1, -1}}));
  EXPECT_EQ(r0.gather.recv_numel, 2);
  // Rank 1: blocks in rank order, so m0 (to owner 0) before m1 (to owner 2).
  const ExchangeLayout r1 = layout_exchange(m, all, 1, 3);
  EXPECT_EQ(r1.gather.send_counts, (Counts{2, 0, 3}));
  EXPECT_EQ(r1.gather_send_offset, (Counts{0, 2, -1}));
  EXPECT_EQ(r1.gather.send_numel, 5);
  EXPECT_EQ(r1.gather.recv_counts, (Counts{2, 0, 0}));  // all of m2, from rank 0
  EXPECT_EQ(r1.gather_recv_offset[2], (Counts{0, -1, -1}));
  EXPECT_EQ(r1.gather.recv_numel, 2);
  // Rank 2 sends nothing (it holds none of m0 and m2) and receives m1's 3 from rank 1.
  const ExchangeLayout r2 = layout_exchange(m, all, 2, 3);
  EXPECT_EQ(r2.gather.send_counts, (Counts{0, 0, 0}));
  EXPECT_EQ(r2.gather.send_numel, 0);
  EXPECT_EQ(r2.gather.recv_counts, (Counts{0, 3, 0}));
  EXPECT_EQ(r2.gather_recv_offset[1], (Counts{-1, 0, -1}));
  for (const ExchangeLayout* x : {&r0, &r1, &r2}) {
    EXPECT_TRUE(x->gather_moves);  // the same on every rank
    EXPECT_EQ(x->active, all);
  }
}

TEST(ExchangeLayout, WhatEachRankSendsIsWhatItsPeerReceives) {
  const auto m = three_matrices();
  for (const std::vector<bool>& active : std::vector<std::vector<bool>>{
           {true, true, true}, {true, false, true}, {false, true, false}}) {
    std::vector<ExchangeLayout> x;
    for (int r = 0; r < 3; ++r) x.push_back(layout_exchange(m, active, r, 3));
    for (int s = 0; s < 3; ++s) {
      for (int d = 0; d < 3; ++d) EXPECT_EQ(x[s].gather.send_counts[d], x[d].gather.recv_counts[s]);
    }
  }
}

TEST(ExchangeLayout, InactiveMatricesAreLeftOut) {
  const auto m = three_matrices();
  const std::vector<bool> active{true, false, true};
  const ExchangeLayout r1 = layout_exchange(m, active, 1, 3);
  EXPECT_EQ(r1.gather.send_counts, (Counts{2, 0, 0}));  // m1 is inactive: nothing to owner 2
  EXPECT_EQ(r1.gather_send_offset, (Counts{0, -1, -1}));
  const ExchangeLayout r2 = layout_exchange(m, active, 2, 3);
  EXPECT_EQ(r2.gather.recv_numel, 0);
  EXPECT_EQ(r2.gather_recv_offset[1], (Counts{-1, -1, -1}));
}

TEST(ExchangeLayout, NothingMovesWhenEveryOwnerHoldsItsWholeMatrix) {
  const std::vector<MatrixPlacement> m{MatrixPlacement{1, {{0, 0}, {0, 5}}},
                                       MatrixPlacement{0, {{0, 3}, {3, 3}}}};
  for (int r = 0; r < 2; ++r) {
    const ExchangeLayout x = layout_exchange(m, {true, true}, r, 2);
    EXPECT_FALSE(x.gather_moves);
    EXPECT_EQ(x.gather.send_numel, 0);
    EXPECT_EQ(x.gather.recv_numel, 0);
  }
  // Only the active set counts: m0 split across ranks but inactive moves nothing either.
  const std::vector<MatrixPlacement> split{MatrixPlacement{0, {{0, 2}, {2, 4}}},
                                           MatrixPlacement{1, {{0, 0}, {0, 1}}}};
  EXPECT_FALSE(layout_exchange(split, {false, true}, 0, 2).gather_moves);
  EXPECT_TRUE(layout_exchange(split, {true, true}, 0, 2).gather_moves);
}

// One replica: the scatter sends back exactly what the gather brought (today's 1-D exchange, the
// same buffers with the roles swapped), whatever the active set and the per-row state.
TEST(ExchangeLayout, OneReplicaScatterIsTheGathersMirror) {
  auto m = three_matrices();
  for (MatrixPlacement& p : m) p.cols = 1;
  for (const std::vector<bool>& rows : std::vector<std::vector<bool>>{{}, {true, false, true}}) {
    for (int r = 0; r < 3; ++r) {
      const ExchangeLayout x = layout_exchange(m, {true, true, true}, r, 3, rows);
      EXPECT_TRUE(x.mirrored);
      EXPECT_EQ(x.scatter.send_counts, x.gather.recv_counts);
      EXPECT_EQ(x.scatter.recv_counts, x.gather.send_counts);
      EXPECT_EQ(x.scatter.send_numel, x.gather.recv_numel);
      EXPECT_EQ(x.scatter.recv_numel, x.gather.send_numel);
      EXPECT_EQ(x.scatter_send_offset, x.gather_recv_offset);
      EXPECT_EQ(x.scatter_recv_offset, x.gather_send_offset);
      EXPECT_EQ(x.scatter_moves, x.gather_moves);
      EXPECT_EQ(x.scatter_inter_replica_numel(r), 0);
    }
  }
}

// A 2x2 mesh: exchange (world) rank q is shard rank q % 2 of replica q / 2.
// m0: 2 x 3, owner 3 (replica 1, shard 1): shard rank 0 holds [0, 4), shard rank 1 [4, 6).
// m1: 1 x 5, owner 0: shard rank 0 holds all of it, shard rank 1 nothing.
// m2: 1 x 2, owner 2 (replica 1, shard 0), which holds none of it: shard rank 1 holds all.
std::vector<MatrixPlacement> two_by_two() {
  return {MatrixPlacement{3, {{0, 4}, {4, 6}}, 3}, MatrixPlacement{0, {{0, 5}, {5, 5}}, 5},
          MatrixPlacement{2, {{0, 0}, {0, 2}}, 2}};
}

TEST(ExchangeLayout, HandWorkedTwoByTwo) {
  const auto m = two_by_two();
  const std::vector<bool> all{true, true, true};
  std::vector<ExchangeLayout> x;
  for (int r = 0; r < 4; ++r) x.push_back(layout_exchange(m, all, r, 4, {}, 2));
  // Rank 0 owns m1, held whole by shard rank 0 of each replica: it gathers nothing (its
  // replica's shard rank 1 holds none), scatters all 5 to rank 2 (replica 1's shard rank 0), and
  // receives m0's 4 from its owner, rank 3.
  EXPECT_EQ(x[0].gather.send_counts, (Counts{0, 0, 0, 0}));
  EXPECT_EQ(x[0].gather.recv_counts, (Counts{0, 0, 0, 0}));
  EXPECT_EQ(x[0].scatter.send_counts, (Counts{0, 0, 5, 0}));
  EXPECT_EQ(x[0].scatter_send_offset[1], (Counts{-1, -1, 0, -1}));
  EXPECT_EQ(x[0].scatter.recv_counts, (Counts{0, 0, 0, 4}));
  EXPECT_EQ(x[0].scatter_recv_offset, (Counts{0, -1, -1}));
  EXPECT_EQ(x[0].scatter_inter_replica_numel(0), 5);
  // Rank 1 owns nothing and its replica's owner of m1 needs nothing from it; it receives m2 (2,
  // from rank 2) then m0 (2, from rank 3): blocks in owner order.
  EXPECT_EQ(x[1].gather.send_numel, 0);
  EXPECT_EQ(x[1].scatter.send_numel, 0);
  EXPECT_EQ(x[1].scatter.recv_counts, (Counts{0, 0, 2, 2}));
  EXPECT_EQ(x[1].scatter_recv_offset, (Counts{2, -1, 0}));
  // Rank 2 owns m2: it gathers m2 from rank 3 (its replica) only and scatters it to every other
  // holder (ranks 1 and 3); it sends its m0 piece to rank 3 in its replica, and receives m1
  // from rank 0 and m0 from rank 3.
  EXPECT_EQ(x[2].gather.send_counts, (Counts{0, 0, 0, 4}));
  EXPECT_EQ(x[2].gather_send_offset, (Counts{0, -1, -1}));
  EXPECT_EQ(x[2].gather.recv_counts, (Counts{0, 0, 0, 2}));
  EXPECT_EQ(x[2].gather_recv_offset[2], (Counts{-1, -1, -1, 0}));
  EXPECT_EQ(x[2].scatter.send_counts, (Counts{0, 2, 0, 2}));
  EXPECT_EQ(x[2].scatter_send_offset[2], (Counts{-1, 0, -1, 2}));
  EXPECT_EQ(x[2].scatter.recv_counts, (Counts{5, 0, 0, 4}));
  EXPECT_EQ(x[2].scatter_recv_offset, (Counts{5, 0, -1}));
  EXPECT_EQ(x[2].scatter_inter_replica_numel(2), 2);
  // Rank 3 owns m0: gathers rank 2's 4 (not rank 0's: the same elements, another replica) and
  // scatters to ranks 0, 1 and 2.
  EXPECT_EQ(x[3].gather.send_counts, (Counts{0, 0, 2, 0}));
  EXPECT_EQ(x[3].gather.recv_counts, (Counts{0, 0, 4, 0}));
  EXPECT_EQ(x[3].gather_recv_offset[0], (Counts{-1, -1, 0, -1}));
  EXPECT_EQ(x[3].scatter.send_counts, (Counts{4, 2, 4, 0}));
  EXPECT_EQ(x[3].scatter_send_offset[0], (Counts{0, 4, 6, -1}));
  EXPECT_EQ(x[3].scatter.send_numel, 10);
  EXPECT_EQ(x[3].scatter.recv_counts, (Counts{0, 0, 2, 0}));
  EXPECT_EQ(x[3].scatter_inter_replica_numel(3), 6);
  for (const ExchangeLayout& l : x) {
    EXPECT_FALSE(l.mirrored);
    EXPECT_TRUE(l.gather_moves);
    EXPECT_TRUE(l.scatter_moves);
  }
}

// NorMuon's rows travel after each piece: m0's shard rank 0 keeps rows [0, 2) (2 rows), shard
// rank 1 none (its elements start inside row 1); m1 and m2 have one row, kept by the shard rank
// holding its first element.
TEST(ExchangeLayout, TwoByTwoWithRows) {
  const auto m = two_by_two();
  const std::vector<bool> all{true, true, true};
  const ExchangeLayout r3 = layout_exchange(m, all, 3, 4, all, 2);
  EXPECT_EQ(r3.gather.recv_counts, (Counts{0, 0, 6, 0}));   // 4 + 2 rows
  EXPECT_EQ(r3.gather.send_counts, (Counts{0, 0, 3, 0}));   // m2: 2 + its row
  EXPECT_EQ(r3.scatter.send_counts, (Counts{6, 2, 6, 0}));  // shard rank 1 keeps no row of m0
  EXPECT_EQ(r3.scatter_send_offset[0], (Counts{0, 6, 8, -1}));
  const ExchangeLayout r0 = layout_exchange(m, all, 0, 4, all, 2);
  EXPECT_EQ(r0.scatter.send_counts, (Counts{0, 0, 6, 0}));  // m1: 5 + its row
  EXPECT_EQ(r0.scatter.recv_counts, (Counts{0, 0, 0, 6}));
  // Only m2 carries rows: m0's and m1's pieces shrink back.
  const ExchangeLayout only_m2 = layout_exchange(m, all, 3, 4, {false, false, true}, 2);
  EXPECT_EQ(only_m2.scatter.send_counts, (Counts{4, 2, 4, 0}));
  EXPECT_EQ(only_m2.gather.send_counts, (Counts{0, 0, 3, 0}));
}

// On any mesh, what each rank sends a peer is what the peer expects from it, in both exchanges;
// the gather never leaves a replica; every rank of every replica other than the owner receives
// its piece of every active matrix it holds, once.
TEST(ExchangeLayout, PeersAgreeOnEveryMesh) {
  struct Mesh {
    int replicas;
    std::vector<MatrixPlacement> matrices;
  };
  // 3x2: shard rank 1 holds nothing of m1; m2 is 1 x 7. 2x3: shard rank 2 holds nothing at all;
  // m1's owner (world rank 4) holds none of it.
  const std::vector<Mesh> meshes{
      {3,
       {MatrixPlacement{5, {{0, 3}, {3, 8}}, 4}, MatrixPlacement{2, {{0, 6}, {6, 6}}, 3},
        MatrixPlacement{0, {{0, 4}, {4, 7}}, 7}, MatrixPlacement{3, {{0, 0}, {0, 2}}, 1}}},
      {2,
       {MatrixPlacement{1, {{0, 2}, {2, 6}, {6, 6}}, 2},
        MatrixPlacement{4, {{0, 5}, {5, 5}, {5, 5}}, 5},
        MatrixPlacement{3, {{0, 1}, {1, 3}, {3, 3}}, 3}}},
  };
  for (const Mesh& mesh : meshes) {
    const int size = mesh.matrices.front().shard_size();
    const int world = mesh.replicas * size;
    const size_t n = mesh.matrices.size();
    for (const std::vector<bool>& rows :
         std::vector<std::vector<bool>>{{}, std::vector<bool>(n, true)}) {
      std::vector<bool> active(n, true);
      active[1] = false;
      for (const std::vector<bool>& on : {std::vector<bool>(n, true), active}) {
        std::vector<ExchangeLayout> x;
        for (int r = 0; r < world; ++r) {
          x.push_back(layout_exchange(mesh.matrices, on, r, world, rows, mesh.replicas));
        }
        for (int s = 0; s < world; ++s) {
          for (int d = 0; d < world; ++d) {
            EXPECT_EQ(x[s].gather.send_counts[d], x[d].gather.recv_counts[s]);
            EXPECT_EQ(x[s].scatter.send_counts[d], x[d].scatter.recv_counts[s]);
            if (s / size != d / size) {
              EXPECT_EQ(x[s].gather.send_counts[d], 0);
            }
          }
        }
        for (size_t j = 0; j < n; ++j) {
          const MatrixPlacement& p = mesh.matrices[j];
          for (int q = 0; q < world; ++q) {
            const bool gets = on[j] && q != p.owner && p.held_numel(q % size) > 0;
            EXPECT_EQ(x[q].scatter_recv_offset[j] >= 0, gets) << "matrix " << j << " rank " << q;
            EXPECT_EQ(x[p.owner].scatter_send_offset[j][q] >= 0, gets);
            const bool sends = gets && q / size == p.owner / size;
            EXPECT_EQ(x[q].gather_send_offset[j] >= 0, sends) << "matrix " << j << " rank " << q;
            EXPECT_EQ(x[p.owner].gather_recv_offset[j][q] >= 0, sends);
          }
        }
      }
    }
  }
}

TEST(ExchangeLayout, RefusesBadInput) {
  const auto m = three_matrices();
  testing::expect_error(
      [&] {
        layout_exchange(m, {true, true}, 0, 3);
      },
      {"layout_exchange", "2 active flags for 3 matrices"});
  testing::expect_error(
      [&] {
        layout_exchange(m, {true, true, true}, 3, 3);
      },
      {"layout_exchange", "rank 3 is outside the world of 3"});
  testing::expect_error(
      [&] {
        layout_exchange(m, {true, true, true}, 0, 2);
      },
      {"layout_exchange", "matrix 0 has held ranges for 3 ranks", "world of 2"});
  std::vector<MatrixPlacement> bad_owner = m;
  bad_owner[1].owner = 5;
  testing::expect_error(
      [&] {
        layout_exchange(bad_owner, {true, true, true}, 0, 3);
      },
      {"layout_exchange", "matrix 1 has owner 5", "world of 3"});
  testing::expect_error(
      [&] {
        layout_exchange(m, {true, true, true}, 0, 3, {}, 2);
      },
      {"layout_exchange", "2 replicas do not divide the world of 3"});
  testing::expect_error(
      [&] {
        layout_exchange(m, {true, true, true}, 0, 6, {}, 3);
      },
      {"layout_exchange", "matrix 0 has held ranges for 3 ranks", "3 replica(s) of 2"});
}

}  // namespace
}  // namespace fsdp_muon::detail
