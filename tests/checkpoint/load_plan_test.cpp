// plan_load on its own: which saved rank files a rank opens, and which element ranges of which
// entries it reads into where, when a checkpoint saved at world size 4 loads at world size 2
// (this process plays one rank of two, with a transport-free communicator). Every expected read
// is worked out by hand from the two layouts in the comments.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "checkpoint/load_plan.h"
#include "checkpoint/rank_file.h"
#include "common/check.h"
#include "common/local_communicator.h"
#include "common/test_util.h"

namespace fsdp_muon::checkpoint {
namespace {

// The live model: one group of 'a' {5} and 'b' {2, 3} in fp32 at world size 2. Alignment 16
// bytes = 4 elements: 'a' at [0, 5), 'b' at [8, 14), padded to 16, shards of 8. Rank 0 holds
// all of 'a' and none of 'b'; rank 1 all of 'b' and none of 'a'.
ModelIndex live_model(int rank, std::shared_ptr<FsdpParameterGroup>& group) {
  auto comm = std::make_shared<testing::LocalCommunicator>(rank, 2);
  group = std::make_shared<FsdpParameterGroup>(
      std::vector<std::pair<std::string, at::Tensor>>{{"a", torch::zeros({5})},
                                                      {"b", torch::zeros({2, 3})}},
      comm, FsdpParameterGroupOptions().name("g"));
  return index_model({group});
}

// A save at world size 4 whose layout differs from the live one: 'a' at [0, 5), 'b' at [5, 11),
// padded to 12, shards of 3. Saved rank r held [3r, 3r + 3): 'a' [0, 3) on rank 0 and [3, 5) on
// rank 1; 'b' [0, 1) on rank 1, [1, 4) on rank 2, [4, 6) on rank 3.
SavedMeta saved_meta(int world_size, int64_t padded, std::vector<SavedParam> params) {
  SavedMeta saved;
  saved.path = "/nowhere/manifest";
  saved.version = 2;
  saved.world_size = world_size;
  SavedGroup group;
  group.name = "g";
  group.padded_numel = padded;
  group.shard_numel = padded / world_size;
  for (size_t i = 0; i < params.size(); ++i) saved.by_name[params[i].name] = {0, i};
  group.params = std::move(params);
  saved.groups.push_back(std::move(group));
  return saved;
}

SavedMeta saved_at_four() { return saved_meta(4, 12, {{"a", {5}, 5, 0}, {"b", {2, 3}, 6, 5}}); }

// An AdamW save of 'a' and 'b' with state `keys` for 'b' (at step 3) and none for 'a', and the
// live AdamW over the same parameters.
SavedMeta saved_with_adamw(const std::vector<std::string>& keys) {
  SavedMeta saved = saved_at_four();
  SavedOptimizer adamw;
  adamw.kind = kind_name(OptimizerKind::kAdamW);
  adamw.param_groups = {{"a", "b"}};
  adamw.state["b"] = SavedState{3, keys};
  saved.optimizers.push_back(adamw);
  return saved;
}

OptimizerEntry live_adamw() {
  OptimizerEntry entry;
  entry.kind = OptimizerKind::kAdamW;
  entry.param_groups = {{ParamRef{0, 0}, ParamRef{0, 1}}};
  return entry;
}

struct Expected {
  std::string key;
  int64_t first;
  int64_t count;
  int64_t dst_offset;  // where in the parameter's held buffer the read lands
};

void expect_reads(const LoadPlan& plan, int saved_rank, const at::Tensor& buffer,
                  const std::vector<Expected>& expected) {
  SCOPED_TRACE("saved rank " + std::to_string(saved_rank));
  ASSERT_EQ(plan.reads_by_saved_rank.count(saved_rank), 1u);
  const std::vector<RangeRead>& reads = plan.reads_by_saved_rank.at(saved_rank);
  ASSERT_EQ(reads.size(), expected.size());
  for (size_t i = 0; i < reads.size(); ++i) {
    EXPECT_EQ(reads[i].key, expected[i].key);
    EXPECT_EQ(reads[i].first, expected[i].first);
    EXPECT_EQ(reads[i].count, expected[i].count);
    ASSERT_EQ(reads[i].dst.numel(), expected[i].count);
    EXPECT_TRUE(reads[i].dst.is_alias_of(buffer));
    EXPECT_EQ(reads[i].dst.data_ptr<float>(), buffer.data_ptr<float>() + expected[i].dst_offset);
  }
}

std::vector<int> ranks_read(const LoadPlan& plan) {
  std::vector<int> ranks;
  for (const auto& [rank, reads] : plan.reads_by_saved_rank) ranks.push_back(rank);
  return ranks;
}

TEST(LoadPlan, RankOneReadsItsParameterFromTheThreeSavedRanksThatHeldIt) {
  std::shared_ptr<FsdpParameterGroup> group;
  const ModelIndex model = live_model(/*rank=*/1, group);
  ASSERT_EQ(group->held_range(1), (std::pair<int64_t, int64_t>{0, 6}));
  const LoadPlan plan = plan_load(saved_at_four(), model, {});
  ASSERT_EQ(plan.weights.size(), 1u);
  ASSERT_EQ(plan.weights[0].size(), 2u);
  EXPECT_EQ(plan.weights[0][0].numel(), 0);  // holds none of 'a'
  const at::Tensor& b = plan.weights[0][1];
  EXPECT_EQ(b.numel(), 6);
  EXPECT_EQ(b.scalar_type(), at::kFloat);  // the main dtype
  // Saved rank 0 held only 'a': its file is never opened.
  EXPECT_EQ(ranks_read(plan), (std::vector<int>{1, 2, 3}));
  // Each entry is the saved rank's own slice of 'b': reads start at its element 0.
  expect_reads(plan, 1, b, {{"w:b", 0, 1, 0}});
  expect_reads(plan, 2, b, {{"w:b", 0, 3, 1}});
  expect_reads(plan, 3, b, {{"w:b", 0, 2, 4}});
  EXPECT_TRUE(plan.states.empty());
}

TEST(LoadPlan, RankZeroReadsOnlyTheFilesThatHeldWhatItHolds) {
  std::shared_ptr<FsdpParameterGroup> group;
  const ModelIndex model = live_model(/*rank=*/0, group);
  const LoadPlan plan = plan_load(saved_at_four(), model, {});
  const at::Tensor& a = plan.weights[0][0];
  EXPECT_EQ(a.numel(), 5);
  EXPECT_EQ(plan.weights[0][1].numel(), 0);
  EXPECT_EQ(ranks_read(plan), (std::vector<int>{0, 1}));
  expect_reads(plan, 0, a, {{"w:a", 0, 3, 0}});
  expect_reads(plan, 1, a, {{"w:a", 0, 2, 3}});
}

TEST(LoadPlan, ASavedRankHoldingTheMiddleOfAParameterIsReadFromItsOffset) {
  // Saved at world size 2 with shards of 4 and 'b' alone at [2, 8): saved rank 0 held 'b'
  // [0, 2), rank 1 held 'b' [2, 6). Live with 4-byte alignment: 'b' at [0, 6), shards of 3, so
  // rank 1 holds 'b' [3, 6): all of it lies on saved rank 1, whose entry starts at 'b' element 2.
  const SavedMeta saved = saved_meta(2, 8, {{"b", {2, 3}, 6, 2}});
  auto comm = std::make_shared<testing::LocalCommunicator>(1, 2);
  auto group = std::make_shared<FsdpParameterGroup>(
      std::vector<std::pair<std::string, at::Tensor>>{{"b", torch::zeros({2, 3})}}, comm,
      FsdpParameterGroupOptions().alignment_bytes(4));
  ASSERT_EQ(group->held_range(0), (std::pair<int64_t, int64_t>{3, 6}));
  const LoadPlan plan = plan_load(saved, index_model({group}), {});
  const at::Tensor& b = plan.weights[0][0];
  EXPECT_EQ(b.numel(), 3);
  EXPECT_EQ(ranks_read(plan), (std::vector<int>{1}));
  // 'b' [3, 6) is saved rank 1's entry (which starts at 'b' element 2) from its element 1.
  expect_reads(plan, 1, b, {{"w:b", 1, 3, 0}});
}

TEST(LoadPlan, OptimizerStateIsPlannedLikeTheWeightsAndAbsentStateStaysEngaged) {
  std::shared_ptr<FsdpParameterGroup> group;
  const ModelIndex model = live_model(/*rank=*/1, group);
  const LoadPlan plan =
      plan_load(saved_with_adamw({"exp_avg", "exp_avg_sq"}), model, {live_adamw()});
  ASSERT_EQ(plan.states.size(), 1u);
  ASSERT_EQ(plan.states[0].size(), 2u);
  // 'a' has no saved state: engaged and absent, so loading removes any the optimizer made.
  ASSERT_TRUE(plan.states[0][0].has_value());
  EXPECT_FALSE(plan.states[0][0]->present);
  const ParamState& b = *plan.states[0][1];
  EXPECT_TRUE(b.present);
  EXPECT_EQ(b.step, 3);
  ASSERT_EQ(b.tensors.size(), 2u);
  EXPECT_EQ(b.tensors[0].first, "exp_avg");
  EXPECT_EQ(b.tensors[1].first, "exp_avg_sq");
  // Saved rank 2's reads: the weight slice, then each state tensor's, in plan order, all of
  // the same range.
  const auto& reads = plan.reads_by_saved_rank.at(2);
  ASSERT_EQ(reads.size(), 3u);
  EXPECT_EQ(reads[0].key, "w:b");
  for (const RangeRead& read : reads) {
    EXPECT_EQ(read.first, 0);
    EXPECT_EQ(read.count, 3);
  }
  EXPECT_EQ(reads[1].key, state_entry_key(0, "b", "exp_avg"));
  EXPECT_EQ(reads[2].key, state_entry_key(0, "b", "exp_avg_sq"));
  EXPECT_TRUE(reads[1].dst.is_alias_of(b.tensors[0].second));
  EXPECT_TRUE(reads[2].dst.is_alias_of(b.tensors[1].second));
}

TEST(LoadPlan, RefusesStateTheOptimizerDoesNotKeep) {
  FSDP_MUON_API_SCOPE("test");  // load_checkpoint's in the library
  std::shared_ptr<FsdpParameterGroup> group;
  const ModelIndex model = live_model(/*rank=*/1, group);
  testing::expect_error(
      [&] { plan_load(saved_with_adamw({"momentum_buffer"}), model, {live_adamw()}); },
      {"fsdp_muon::test: /nowhere/manifest has optimizer state 'momentum_buffer' "
       "for 'b', which a adamw optimizer does not keep"});
}

}  // namespace
}  // namespace fsdp_muon::checkpoint
