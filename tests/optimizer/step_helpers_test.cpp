// The step's pure helpers (docs/DESIGN.md §4, "Kernels per step" and "Batching"): buffers cut in
// one call, views kept across steps and remade when their tensor changes, and which owners batch
// Newton–Schulz under each NewtonSchulzBatching mode. No GPU is needed: a CUDA device is only a
// value here.

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fsdp_muon/optimizer/fsdp_muon.h>

#include "common/test_util.h"
#include "newton_schulz/newton_schulz_internal.h"
#include "optimizer/fsdp_muon_impl.h"
#include "optimizer/step_views.h"

namespace fsdp_muon::detail {
namespace {

TEST(StepViews, SlicesOfCutsInAnyOrderWithGapsAndEmptyRanges) {
  const at::Tensor flat = at::arange(10, at::kFloat);
  // Out of order, with a gap before, between and after, and an empty range.
  const std::vector<std::pair<int64_t, int64_t>> ranges = {{6, 3}, {1, 2}, {4, 0}, {3, 1}};
  const std::vector<at::Tensor> views = slices_of(flat, ranges);
  ASSERT_EQ(views.size(), ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ(views[i].numel(), ranges[i].second) << i;
    if (ranges[i].second == 0) continue;
    EXPECT_EQ(views[i].data_ptr<float>(), flat.data_ptr<float>() + ranges[i].first) << i;
  }
  EXPECT_TRUE(slices_of(flat, {}).empty());
}

TEST(StepViews, SlicesOfRefusesOverlapsAndRangesOutside) {
  const at::Tensor flat = at::zeros({10});
  testing::expect_error(
      [&] {
        slices_of(flat, {{0, 4}, {3, 2}});
      },
      {"internal error: slice [3, 5) of a 10-element buffer overlaps"});
  testing::expect_error(
      [&] {
        slices_of(flat, {{8, 3}});
      },
      {"slice [8, 11) of a 10-element buffer", "lies outside it"});
}

TEST(StepViews, PieceViewsAreKeptWhileTheTensorKeepsItsStorage) {
  PieceViews views;
  at::Tensor momentum = at::arange(12, at::kFloat);
  const at::Tensor first = views.get(3, momentum, 4, 5);
  EXPECT_EQ(first.data_ptr<float>(), momentum.data_ptr<float>() + 4);
  EXPECT_TRUE(views.get(3, momentum, 4, 5).is_same(first));  // kept, no new view
  // A checkpoint load replaces the tensor: the view follows the new storage.
  momentum = at::full({12}, 7.0);
  const at::Tensor second = views.get(3, momentum, 4, 5);
  EXPECT_FALSE(second.is_same(first));
  EXPECT_EQ(second.data_ptr<float>(), momentum.data_ptr<float>() + 4);
  EXPECT_TRUE(at::equal(second, at::full({5}, 7.0)));
  // Another piece of the same tensor, and another dtype, are other views.
  EXPECT_EQ(views.get(3, momentum, 0, 2).numel(), 2);
  EXPECT_EQ(views.get(3, momentum.to(at::kDouble), 0, 2).scalar_type(), at::kDouble);
}

TEST(NewtonSchulzBatchingDecision, EachModeOnEachDevice) {
  using K = MatrixLayout::Kind;
  const c10::Device cpu(c10::kCPU);
  const c10::Device cuda(c10::kCUDA, 0);
  const bool cpu_fp32_bitwise = batched_newton_schulz_is_bitwise(cpu, at::kFloat);
  for (const K kind : {K::kWhole, K::kRowBlocks, K::kBatched}) {
    SCOPED_TRACE(static_cast<int>(kind));
    for (const c10::Device& device : {cpu, cuda}) {
      for (const auto dtype : {at::kFloat, at::kBFloat16}) {
        EXPECT_TRUE(batches_newton_schulz(NewtonSchulzBatching::kAlways, device, dtype, kind));
        EXPECT_FALSE(batches_newton_schulz(NewtonSchulzBatching::kNever, device, dtype, kind));
        EXPECT_EQ(batches_newton_schulz(NewtonSchulzBatching::kWhereBitwise, device, dtype, kind),
                  batched_newton_schulz_is_bitwise(device, dtype));
      }
    }
    // kAuto: kWhereBitwise, and on CUDA the experts of a batched() layout whatever the dtype.
    EXPECT_EQ(batches_newton_schulz(NewtonSchulzBatching::kAuto, cpu, at::kFloat, kind),
              cpu_fp32_bitwise);
    EXPECT_FALSE(batches_newton_schulz(NewtonSchulzBatching::kAuto, cpu, at::kBFloat16, kind));
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      EXPECT_EQ(batches_newton_schulz(NewtonSchulzBatching::kAuto, cuda, dtype, kind),
                kind == K::kBatched);
    }
  }
  EXPECT_EQ(FsdpMuonConfig().batch_newton_schulz(), NewtonSchulzBatching::kAuto);
  EXPECT_STREQ(to_string(NewtonSchulzBatching::kAuto), "auto");
}

}  // namespace
}  // namespace fsdp_muon::detail
