// The construction agreement of FsdpParameterGroup on its own: the description a rank gives of
// the group it built, the sentence that names the first difference between two ranks'
// descriptions, and agree_on_group where every rank agrees (a transport-free communicator).

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/agreement.h"
#include "common/local_communicator.h"
#include "common/test_util.h"
#include "fsdp/group_agreement.h"

namespace fsdp_muon {
namespace {

using fsdp::first_difference;
using Lines = std::vector<std::string>;

const std::string kOptions =
    "options: name '', compute_dtype default, main_dtype Float, reduce_dtype default, "
    "alignment_bytes 16, broadcast_from_rank0 true, sharding_strategy optim, prefetch true, "
    "mesh 1x1";

TEST(GroupAgreement, DescribesOptionsThenEachParameterInOrder) {
  const std::vector<std::pair<std::string, at::Tensor>> params{
      {"w", torch::zeros({2, 3})}, {"b", torch::zeros({3}, torch::kDouble)}};
  EXPECT_EQ(fsdp::describe_group(params, FsdpParameterGroupOptions(), "1x1"),
            (Lines{"ok", kOptions, "'w' [2, 3] Float", "'b' [3] Double"}));
  const Lines named =
      fsdp::describe_group(params,
                           FsdpParameterGroupOptions()
                               .name("block")
                               .compute_dtype(at::kBFloat16)
                               .sharding_strategy(ShardingStrategy::kOptimGradsParams)
                               .prefetch(false),
                           "2x3");
  EXPECT_EQ(named[1],
            "options: name 'block', compute_dtype BFloat16, main_dtype Float, reduce_dtype "
            "default, alignment_bytes 16, broadcast_from_rank0 true, sharding_strategy "
            "optim_grads_params, prefetch false, mesh 2x3");
}

TEST(GroupAgreement, LinesSurviveJoinAndSplit) {
  const Lines lines{"ok", kOptions, "'a' [1] Float", ""};
  EXPECT_EQ(detail::join_lines(lines), "ok\n" + kOptions + "\n'a' [1] Float\n\n");
  EXPECT_EQ(detail::split_lines(detail::join_lines(lines)), lines);
  EXPECT_TRUE(detail::split_lines("").empty());
}

TEST(GroupAgreement, FirstDifferenceNamesTheOptions) {
  const Lines zero{"ok", "options: A", "'w' [2] Float"};
  const Lines other{"ok", "options: B", "'w' [3] Float"};
  // The options come first: a parameter that differs too is not mentioned.
  EXPECT_EQ(first_difference(zero, other, 2), "rank 0 has options: A; rank 2 has options: B");
}

TEST(GroupAgreement, FirstDifferenceNamesTheFirstParameterThatDiffers) {
  const Lines zero{"ok", kOptions, "'a' [4] Float", "'b' [2, 3] Float", "'c' [1] Float"};
  const Lines other{"ok", kOptions, "'a' [4] Float", "'b' [3, 2] Float", "'c' [5] Float"};
  EXPECT_EQ(first_difference(zero, other, 1),
            "parameter #1: rank 0 has 'b' [2, 3] Float, rank 1 has 'b' [3, 2] Float (rank 0 has "
            "3 parameters, rank 1 3)");
}

TEST(GroupAgreement, FirstDifferenceNamesAMissingParameter) {
  const Lines zero{"ok", kOptions, "'a' [4] Float", "'b' [2] Float"};
  const Lines fewer{"ok", kOptions, "'a' [4] Float"};
  EXPECT_EQ(first_difference(zero, fewer, 3),
            "parameter #1: rank 0 has 'b' [2] Float, rank 3 has no parameter (rank 0 has 2 "
            "parameters, rank 3 1)");
  EXPECT_EQ(first_difference(fewer, zero, 3),
            "parameter #1: rank 0 has no parameter, rank 3 has 'b' [2] Float (rank 0 has 1 "
            "parameters, rank 3 2)");
}

TEST(GroupAgreement, FirstDifferenceReportsARankThatFailed) {
  const Lines ok{"ok", kOptions, "'a' [4] Float"};
  const Lines failed{"error", "fsdp_muon::FsdpParameterGroup: parameter 'a' is on cuda:0"};
  EXPECT_EQ(first_difference(ok, failed, 2),
            "rank 2 could not build its group: fsdp_muon::FsdpParameterGroup: parameter 'a' is "
            "on cuda:0");
  // Rank 0's own failure comes first when both failed.
  EXPECT_EQ(first_difference(Lines{"error", "zero's"}, Lines{"error", "two's"}, 2),
            "rank 0 could not build its group: zero's");
  EXPECT_EQ(first_difference(Lines{"error"}, ok, 1), "rank 0 could not build its group: ");
}

TEST(GroupAgreement, FirstDifferenceOfBadDescriptions) {
  const Lines ok{"ok", kOptions};
  EXPECT_EQ(first_difference(Lines{}, ok, 1), "the ranks' descriptions are unreadable");
  EXPECT_EQ(first_difference(ok, Lines{"garbage"}, 1), "the ranks' descriptions are unreadable");
  // Equal lines (two texts whose hashes collided, or a caller's mistake).
  EXPECT_EQ(first_difference(ok, ok, 1), "the descriptions differ only in their hash");
}

// FsdpMuon's descriptions: one "<key> = <value>" per line, the first differing key named.
TEST(GroupAgreement, FirstDifferentEntryNamesTheKeyAndBothValues) {
  const Lines zero{"world = 2", "group 0 lr = 0x1p-6 (0.015625)",
                   "group 0 newton_schulz.steps = 5"};
  const Lines other{"world = 2", "group 0 lr = 0x1p-7 (0.0078125)",
                    "group 0 newton_schulz.steps = 6"};
  EXPECT_EQ(detail::first_different_entry(zero, other, 3),
            "group 0 lr: rank 0 has 0x1p-6 (0.015625), rank 3 has 0x1p-7 (0.0078125)");
  // Shifted lines (a parameter group more on one rank) are quoted whole; a missing one is
  // "nothing".
  EXPECT_EQ(detail::first_different_entry(Lines{"a = 1", "b = 2"}, Lines{"a = 1", "c = 2"}, 1),
            "line 2: rank 0 has 'b = 2', rank 1 has 'c = 2'");
  EXPECT_EQ(detail::first_different_entry(Lines{"a = 1"}, Lines{"a = 1", "b = 2"}, 1),
            "line 2: rank 0 has nothing, rank 1 has 'b = 2'");
  EXPECT_EQ(detail::first_different_entry(zero, zero, 1),
            "the descriptions differ only in their hash");
}

TEST(GroupAgreement, AgreeingRanksPassAndAnAgreedErrorIsThrown) {
  testing::LocalCommunicator one;
  testing::LocalCommunicator two_of_four(/*rank=*/2, /*size=*/4);  // every rank as this one
  for (Communicator* comm : std::vector<Communicator*>{&one, &two_of_four}) {
    SCOPED_TRACE(comm->size());
    EXPECT_NO_THROW(fsdp::agree_on_group(*comm, {"ok", kOptions, "'a' [4] Float"}, "who: "));
    // Every rank failed alike: each throws its own message, as it is.
    testing::expect_error(
        [&] {
          fsdp::agree_on_group(*comm, {"error", "fsdp_muon::FsdpParameterGroup: no parameters"},
                               "who: ");
        },
        {"fsdp_muon::FsdpParameterGroup: no parameters"});
  }
}

}  // namespace
}  // namespace fsdp_muon
