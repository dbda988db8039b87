// MatrixLayout in single-device Muon: row blocks and batched experts equal the same matrices as
// separate parameters bit for bit, the option's archive and equality, and the errors.

#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include <fsdp_muon/muon/matrix_layout.h>
#include <fsdp_muon/muon/muon.h>

#include "muon/muon_test_util.h"

namespace fsdp_muon {
namespace {

using test::expect_error;

struct Case {
  std::string name;
  MuonOptions options;
};

// The option sets every equality runs under: fp32 and bf16 Newton–Schulz, a scale that depends
// on the block's shape, weight decay, NorMuon (per-row state), Gram.
std::vector<Case> cases() {
  return {
      {"fp32", MuonOptions(0.05).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))},
      {"bf16 spectral wd", MuonOptions(0.05).scale_mode(ScaleMode::kSpectral).weight_decay(0.1)},
      {"fp32 normuon unit_rms", MuonOptions(0.05)
                                    .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
                                    .normalization(Normalization::kNorMuon)
                                    .scale_mode(ScaleMode::kUnitRmsNorm)
                                    .nesterov(false)},
      {"fp32 gram match_rms",
       MuonOptions(0.05)
           .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat).method(NsMethod::kGram))
           .scale_mode(ScaleMode::kMatchRmsAdamW)},
  };
}

void expect_bitwise(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(torch::equal(got, want))
      << what << ": max |diff| " << (got - want).abs().max().item<double>();
}

// Muon with row_blocks(rows) on one [sum(rows), cols] parameter against Muon on the blocks as
// separate parameters, over several steps with fresh gradients.
void check_row_blocks(const std::vector<int64_t>& rows, int64_t cols) {
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  for (const Case& c : cases()) {
    torch::manual_seed(7);
    torch::Tensor fused = torch::randn({total, cols}).requires_grad_();
    std::vector<torch::Tensor> parts;
    for (const torch::Tensor& part : fused.detach().split_with_sizes(rows, 0)) {
      parts.push_back(part.clone().requires_grad_());
    }
    MuonOptions blocked = c.options;
    blocked.matrix_layout(MatrixLayout::row_blocks(rows));
    Muon on_fused({fused}, blocked);
    Muon on_parts(parts, c.options);
    for (int step = 0; step < 4; ++step) {
      const torch::Tensor g = torch::randn({total, cols});
      fused.mutable_grad() = g.clone();
      const auto gs = g.split_with_sizes(rows, 0);
      for (size_t i = 0; i < parts.size(); ++i) parts[i].mutable_grad() = gs[i].clone();
      on_fused.step();
      on_parts.step();
      expect_bitwise(fused.detach(), torch::cat(parts, 0).detach(),
                     c.name + " step " + std::to_string(step));
    }
    if (c.options.normalization() == Normalization::kNorMuon) {
      // The parameter's per-row state is the blocks' states one after the other.
      std::vector<torch::Tensor> variances;
      for (const auto& p : parts) {
        variances.push_back(
            static_cast<const MuonParamState&>(*on_parts.state().at(p.unsafeGetTensorImpl()))
                .normuon_variance());
      }
      expect_bitwise(
          static_cast<const MuonParamState&>(*on_fused.state().at(fused.unsafeGetTensorImpl()))
              .normuon_variance(),
          torch::cat(variances), c.name + " NorMuon state");
    }
  }
}

TEST(MuonMatrixLayout, RowBlocksOfOneRowEqualSeparateParametersBitwise) {
  check_row_blocks({1, 1, 1, 1, 1}, 12);
}

TEST(MuonMatrixLayout, UnequalRowBlocksEqualSeparateParametersBitwise) {
  check_row_blocks({3, 9, 1, 5}, 7);  // wide, tall and one-row blocks in one parameter
}

TEST(MuonMatrixLayout, FusedQkvEqualsSeparateProjectionsBitwise) {
  check_row_blocks({16, 8, 8}, 16);  // GQA: q = 16 rows, k = v = 8
}

TEST(MuonMatrixLayout, PerHeadBlocksEqualSeparateParametersBitwise) {
  check_row_blocks({4, 4, 4, 4, 4, 4}, 10);  // same-shape blocks: the batched path where it applies
}

// batched() on [E, m, n] against E separate m x n parameters.
void check_batched(int64_t experts, int64_t m, int64_t n) {
  for (const Case& c : cases()) {
    torch::manual_seed(11);
    torch::Tensor fused = torch::randn({experts, m, n}).requires_grad_();
    std::vector<torch::Tensor> parts;
    for (int64_t e = 0; e < experts; ++e) {
      parts.push_back(fused.detach()[e].clone().requires_grad_());
    }
    MuonOptions batched = c.options;
    batched.matrix_layout(MatrixLayout::batched());
    Muon on_fused({fused}, batched);
    Muon on_parts(parts, c.options);
    for (int step = 0; step < 4; ++step) {
      const torch::Tensor g = torch::randn({experts, m, n});
      fused.mutable_grad() = g.clone();
      for (int64_t e = 0; e < experts; ++e) parts[e].mutable_grad() = g[e].clone();
      on_fused.step();
      on_parts.step();
      expect_bitwise(fused.detach(), torch::stack(parts).detach(),
                     c.name + " step " + std::to_string(step));
    }
  }
}

TEST(MuonMatrixLayout, BatchedEqualsSeparateMatricesBitwise) {
  check_batched(5, 6, 10);  // wide experts
  check_batched(3, 9, 4);   // tall experts
  check_batched(1, 1, 8);   // one expert of one row
}

TEST(MuonMatrixLayout, BlocksOfEachLayout) {
  EXPECT_EQ(MatrixLayout::whole().blocks({6, 4}, "w"), (std::vector<MatrixBlock>{{0, 6, 4}}));
  EXPECT_EQ(MatrixLayout::row_blocks({2, 1, 3}).blocks({6, 4}, "w"),
            (std::vector<MatrixBlock>{{0, 2, 4}, {8, 1, 4}, {12, 3, 4}}));
  EXPECT_EQ(MatrixLayout::batched().blocks({3, 2, 5}, "w"),
            (std::vector<MatrixBlock>{{0, 2, 5}, {10, 2, 5}, {20, 2, 5}}));
  EXPECT_EQ(MatrixLayout().to_string(), "whole");
  EXPECT_EQ(MatrixLayout::row_blocks({64, 16, 16}).to_string(), "row_blocks{64, 16, 16}");
  EXPECT_EQ(MatrixLayout::batched().to_string(), "batched");
  EXPECT_TRUE(MatrixLayout() == MatrixLayout::whole());
  EXPECT_FALSE(MatrixLayout::row_blocks({1, 2}) == MatrixLayout::row_blocks({2, 1}));
  EXPECT_FALSE(MatrixLayout::batched() == MatrixLayout::whole());
}

TEST(MuonMatrixLayout, OptionArchiveRoundTripAndEquality) {
  for (const MatrixLayout& layout :
       {MatrixLayout::row_blocks({5, 1, 1}), MatrixLayout::batched(), MatrixLayout::whole()}) {
    const MuonOptions written = MuonOptions(0.1).matrix_layout(layout);
    torch::serialize::OutputArchive out;
    written.serialize(out);
    std::stringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    MuonOptions read = MuonOptions(0.1).matrix_layout(MatrixLayout::row_blocks({9}));
    EXPECT_FALSE(read == written);
    read.serialize(in);
    EXPECT_TRUE(read == written) << layout.to_string();
    EXPECT_EQ(read.matrix_layout(), layout);
  }
  EXPECT_FALSE(MuonOptions() == MuonOptions().matrix_layout(MatrixLayout::batched()));
}

TEST(MuonMatrixLayout, InvalidLayoutsNameTheParameterAndTheFix) {
  const auto w = torch::zeros({6, 4}, torch::requires_grad());
  const auto experts = torch::zeros({3, 2, 4}, torch::requires_grad());
  expect_error(
      [] { MuonOptions().matrix_layout(MatrixLayout::row_blocks({})).validate(); },
      {"fsdp_muon::MuonOptions: ", "row_blocks{} has no blocks", "row_blocks({q, kv, kv})"});
  expect_error(
      [] {
        MuonOptions().matrix_layout(MatrixLayout::row_blocks({2, 0, 4})).validate();
      },
      {"row_blocks{2, 0, 4}", "block 1 of 0 rows", "at least one row"});
  expect_error(
      [] {
        MuonOptions().matrix_layout(MatrixLayout::row_blocks({3, -1})).validate();
      },
      {"block 1 of -1 rows"});
  expect_error(
      [&] {
        Muon({w}, MuonOptions().matrix_layout(MatrixLayout::row_blocks({2, 3})));
      },
      {"fsdp_muon::Muon: ", "parameter 0 of group 0", "6 rows", "row_blocks{2, 3}", "adds up to 5",
       "must add up"});
  expect_error([&] { Muon({w}, MuonOptions().matrix_layout(MatrixLayout::batched())); },
               {"parameter 0 of group 0", "[6, 4]", "batched", "3-D [E, m, n]"});
  expect_error(
      [&] {
        Muon({experts}, MuonOptions().matrix_layout(MatrixLayout::row_blocks({1, 1})));
      },
      {"parameter 0 of group 0", "[3, 2, 4]", "row_blocks{1, 1}", "2-D parameter"});
  // A 3-D parameter under whole(): not a matrix, with the layout that reads it as one.
  expect_error(
      [&] {
        Muon({w, experts});
      },
      {"only 2-D parameters", "[3, 2, 4]", "MatrixLayout::batched()", "skip_non_matrix"});
  // skip_non_matrix concerns whole() only: a layout that does not fit stays an error.
  expect_error(
      [&] {
        Muon({w}, MuonOptions().skip_non_matrix(true).matrix_layout(MatrixLayout::batched()));
      },
      {"batched"});
  // Edited after construction: caught at the next step, before anything changes.
  Muon muon({w}, MuonOptions().matrix_layout(MatrixLayout::row_blocks({3, 3})));
  w.mutable_grad() = torch::ones({6, 4});
  static_cast<MuonOptions&>(muon.param_groups()[0].options())
      .matrix_layout(MatrixLayout::row_blocks({4, 4}));
  expect_error([&] { muon.step(); }, {"adds up to 8"});
  EXPECT_TRUE(muon.state().empty());
}

TEST(MuonMatrixLayout, SkipNonMatrixSkipsThreeDParametersUnderWhole) {
  auto w = torch::randn({4, 4}).requires_grad_();
  auto experts = torch::randn({2, 2, 4}).requires_grad_();
  const torch::Tensor before = experts.detach().clone();
  test::WarningCollector warnings;
  Muon muon({w, experts}, MuonOptions().skip_non_matrix(true));
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("[2, 2, 4]"), std::string::npos) << warnings.messages[0];
  w.mutable_grad() = torch::ones({4, 4});
  experts.mutable_grad() = torch::ones({2, 2, 4});
  muon.step();
  EXPECT_TRUE(torch::equal(experts.detach(), before));
}

}  // namespace
}  // namespace fsdp_muon
