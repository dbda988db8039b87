// layout_exchange on its own: the send and receive blocks of one group's gather for a
// hand-worked placement of three matrices on three ranks (owners that hold all, part or none of
// their matrix; a rank holding nothing of one), an inactive matrix, and bad input.

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
  EXPECT_EQ(r0.send_counts, (Counts{0, 2, 0}));
  EXPECT_EQ(r0.send_offset, (Counts{-1, -1, 0}));
  EXPECT_EQ(r0.send_numel, 2);
  EXPECT_EQ(r0.recv_counts, (Counts{0, 2, 0}));
  EXPECT_EQ(r0.recv_offset, (std::vector<Counts>{{-1, 0, -1}, {-1, -1, -1}, {-1, -1, -1}}));
  EXPECT_EQ(r0.recv_numel, 2);
  // Rank 1: blocks in rank order, so m0 (to owner 0) before m1 (to owner 2).
  const ExchangeLayout r1 = layout_exchange(m, all, 1, 3);
  EXPECT_EQ(r1.send_counts, (Counts{2, 0, 3}));
  EXPECT_EQ(r1.send_offset, (Counts{0, 2, -1}));
  EXPECT_EQ(r1.send_numel, 5);
  EXPECT_EQ(r1.recv_counts, (Counts{2, 0, 0}));  // all of m2, from rank 0
  EXPECT_EQ(r1.recv_offset[2], (Counts{0, -1, -1}));
  EXPECT_EQ(r1.recv_numel, 2);
  // Rank 2 sends nothing (it holds none of m0 and m2) and receives m1's 3 from rank 1.
  const ExchangeLayout r2 = layout_exchange(m, all, 2, 3);
  EXPECT_EQ(r2.send_counts, (Counts{0, 0, 0}));
  EXPECT_EQ(r2.send_numel, 0);
  EXPECT_EQ(r2.recv_counts, (Counts{0, 3, 0}));
  EXPECT_EQ(r2.recv_offset[1], (Counts{-1, 0, -1}));
  for (const ExchangeLayout* x : {&r0, &r1, &r2}) {
    EXPECT_TRUE(x->moves);  // the same on every rank
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
      for (int d = 0; d < 3; ++d) EXPECT_EQ(x[s].send_counts[d], x[d].recv_counts[s]);
    }
  }
}

TEST(ExchangeLayout, InactiveMatricesAreLeftOut) {
  const auto m = three_matrices();
  const std::vector<bool> active{true, false, true};
  const ExchangeLayout r1 = layout_exchange(m, active, 1, 3);
  EXPECT_EQ(r1.send_counts, (Counts{2, 0, 0}));  // m1 is inactive: nothing to owner 2
  EXPECT_EQ(r1.send_offset, (Counts{0, -1, -1}));
  const ExchangeLayout r2 = layout_exchange(m, active, 2, 3);
  EXPECT_EQ(r2.recv_numel, 0);
  EXPECT_EQ(r2.recv_offset[1], (Counts{-1, -1, -1}));
}

TEST(ExchangeLayout, NothingMovesWhenEveryOwnerHoldsItsWholeMatrix) {
  const std::vector<MatrixPlacement> m{MatrixPlacement{1, {{0, 0}, {0, 5}}},
                                       MatrixPlacement{0, {{0, 3}, {3, 3}}}};
  for (int r = 0; r < 2; ++r) {
    const ExchangeLayout x = layout_exchange(m, {true, true}, r, 2);
    EXPECT_FALSE(x.moves);
    EXPECT_EQ(x.send_numel, 0);
    EXPECT_EQ(x.recv_numel, 0);
  }
  // Only the active set counts: m0 split across ranks but inactive moves nothing either.
  const std::vector<MatrixPlacement> split{MatrixPlacement{0, {{0, 2}, {2, 4}}},
                                           MatrixPlacement{1, {{0, 0}, {0, 1}}}};
  EXPECT_FALSE(layout_exchange(split, {false, true}, 0, 2).moves);
  EXPECT_TRUE(layout_exchange(split, {true, true}, 0, 2).moves);
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
}

}  // namespace
}  // namespace fsdp_muon::detail
