// The elementwise math gives the same bits on any contiguous split of a parameter: the contract
// FsdpMuon relies on to match single-device Muon bitwise (see src/muon/muon_math.h).

#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <fsdp_muon/muon/muon_options.h>

#include "muon/muon_math.h"

namespace fsdp_muon {
namespace {

struct MathCase {
  WeightDecayMethod method;
  bool nesterov;
  c10::ScalarType dtype;
};

class MuonMathShards : public ::testing::TestWithParam<MathCase> {};

// Applies the elementwise steps to the whole flattened tensor and to pieces cut at offsets chosen
// to land on every alignment (odd starts, pieces shorter than one SIMD vector), for several
// steps, and requires identical bits.
TEST_P(MuonMathShards, PiecesEqualWholeBitwise) {
  const MathCase c = GetParam();
  const MuonOptions o = MuonOptions(0.03)
                            .momentum(0.9)
                            .nesterov(c.nesterov)
                            .weight_decay(0.07)
                            .weight_decay_method(c.method);
  const int64_t n = 1037;
  const std::vector<int64_t> cuts{0, 1, 4, 5, 13, 20, 21, 64, 100, 517, 1030, n};
  at::manual_seed(11);
  at::Tensor w_full = at::randn({n}).to(c.dtype);
  at::Tensor w_pieces = w_full.clone();
  at::Tensor b_full = at::zeros_like(w_full);
  at::Tensor b_pieces = at::zeros_like(w_full);
  for (int step = 0; step < 3; ++step) {
    const at::Tensor g = at::randn({n}).to(c.dtype);
    const at::Tensor g_before = g.clone();
    const at::Tensor u_full = detail::muon_momentum_input(w_full, g, b_full, o);
    const at::Tensor fake_update = u_full.mul(1.7);  // stands in for NS(U) * scale
    detail::muon_apply_update(w_full, fake_update, o);
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const int64_t lo = cuts[k];
      const int64_t len = cuts[k + 1] - lo;
      at::Tensor w = w_pieces.narrow(0, lo, len);
      at::Tensor b = b_pieces.narrow(0, lo, len);
      const at::Tensor u = detail::muon_momentum_input(w, g.narrow(0, lo, len), b, o);
      ASSERT_TRUE(at::equal(u, u_full.narrow(0, lo, len))) << "U differs in piece " << k;
      detail::muon_apply_update(w, fake_update.narrow(0, lo, len), o);
    }
    ASSERT_TRUE(at::equal(g, g_before)) << "the gradient was modified";
    ASSERT_TRUE(at::equal(b_full, b_pieces)) << "momentum differs at step " << step;
    ASSERT_TRUE(at::equal(w_full, w_pieces)) << "parameters differ at step " << step;
  }
}

std::vector<MathCase> math_cases() {
  std::vector<MathCase> cases;
  for (auto method : {WeightDecayMethod::kDecoupled, WeightDecayMethod::kIndependent,
                      WeightDecayMethod::kL2, WeightDecayMethod::kPalm}) {
    for (bool nesterov : {true, false}) {
      for (auto dtype : {at::kFloat, at::kBFloat16}) {
        cases.push_back({method, nesterov, dtype});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllModes, MuonMathShards, ::testing::ValuesIn(math_cases()),
                         [](const ::testing::TestParamInfo<MathCase>& info) {
                           return std::string(to_string(info.param.method)) +
                                  (info.param.nesterov ? "_nesterov_" : "_plain_") +
                                  (info.param.dtype == at::kFloat ? "fp32" : "bf16");
                         });

// The list form FsdpMuon's step uses (muon_momentum_inputs, muon_apply_updates: _foreach_ ops)
// against the single-tensor form on each piece: the same bits, on pieces of one buffer cut at odd
// offsets, lengths that are no multiple of 4 and one longer than a multi-tensor chunk (65536),
// which on CUDA take the unvectorized and the chunked paths of the multi-tensor kernels.
void expect_list_form_equals_each_piece(const c10::Device& device) {
  const std::vector<int64_t> cuts{0, 1, 6, 7, 19, 4116, 4117, 4117 + 70001, 4117 + 70003};
  const int64_t n = cuts.back();
  for (const MathCase& c : math_cases()) {
    SCOPED_TRACE(std::string(to_string(c.method)) + (c.nesterov ? " nesterov " : " plain ") +
                 (c.dtype == at::kFloat ? "fp32" : "bf16"));
    const MuonOptions o = MuonOptions(0.03)
                              .momentum(0.9)
                              .nesterov(c.nesterov)
                              .weight_decay(0.07)
                              .weight_decay_method(c.method);
    at::manual_seed(12);
    const auto options = at::TensorOptions().dtype(c.dtype).device(device);
    at::Tensor w_list = at::randn({n}).to(options);
    at::Tensor w_each = w_list.clone();
    at::Tensor b_list = at::randn({n}).to(options);
    at::Tensor b_each = b_list.clone();
    const at::Tensor g = at::randn({n}).to(options);
    const at::Tensor update = at::randn({n}).to(options);
    std::vector<at::Tensor> w, gs, b, ups;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      w.push_back(w_list.narrow(0, cuts[k], cuts[k + 1] - cuts[k]));
      gs.push_back(g.narrow(0, cuts[k], cuts[k + 1] - cuts[k]));
      b.push_back(b_list.narrow(0, cuts[k], cuts[k + 1] - cuts[k]));
      ups.push_back(update.narrow(0, cuts[k], cuts[k + 1] - cuts[k]));
    }
    const std::vector<at::Tensor> u_list = detail::muon_momentum_inputs(w, gs, b, o);
    detail::muon_apply_updates(w, ups, o);
    ASSERT_EQ(u_list.size(), w.size());
    for (size_t k = 0; k < w.size(); ++k) {
      at::Tensor wk = w_each.narrow(0, cuts[k], cuts[k + 1] - cuts[k]);
      at::Tensor bk = b_each.narrow(0, cuts[k], cuts[k + 1] - cuts[k]);
      const at::Tensor u = detail::muon_momentum_input(wk, gs[k], bk, o);
      detail::muon_apply_update(wk, ups[k], o);
      EXPECT_TRUE(at::equal(u_list[k], u)) << "U of piece " << k;
    }
    EXPECT_TRUE(at::equal(b_list, b_each)) << "momentum";
    EXPECT_TRUE(at::equal(w_list, w_each)) << "parameters";
  }
}

TEST(MuonMathLists, ListFormEqualsEachPieceBitwise) {
  expect_list_form_equals_each_piece(c10::Device(c10::kCPU));
}

TEST(MuonMathListsCuda, ListFormEqualsEachPieceBitwise) {
  if (!torch::cuda::is_available()) {
    std::cout << "[  SKIPPED ] no CUDA device: the multi-tensor kernels are checked on a GPU\n";
    GTEST_SKIP() << "no CUDA device visible";
  }
  expect_list_form_equals_each_piece(c10::Device(c10::kCUDA, 0));
}

TEST(MuonMath, MomentumInputFormulas) {
  // Exact small numbers: mu = 0.5, G = 2, B0 = 4 -> B = 3; Nesterov U = 1 + 1.5 = 2.5.
  const MuonOptions o = MuonOptions(0.1).momentum(0.5);
  at::Tensor w = at::full({2, 2}, 1.0);
  at::Tensor g = at::full({2, 2}, 2.0);
  at::Tensor b = at::full({2, 2}, 4.0);
  at::Tensor u = detail::muon_momentum_input(w, g, b, o);
  EXPECT_TRUE(at::equal(b, at::full({2, 2}, 3.0)));
  EXPECT_TRUE(at::equal(u, at::full({2, 2}, 2.5)));
  // Without Nesterov U is a copy of B, not an alias.
  at::Tensor b2 = at::full({2, 2}, 4.0);
  at::Tensor u2 =
      detail::muon_momentum_input(w, g, b2, MuonOptions(0.1).momentum(0.5).nesterov(false));
  EXPECT_TRUE(at::equal(u2, b2));
  EXPECT_NE(u2.data_ptr(), b2.data_ptr());
  u2.add_(1.0);
  EXPECT_TRUE(at::equal(b2, at::full({2, 2}, 3.0)));
}

TEST(MuonMath, WeightDecayModes) {
  // lr = 0.5, wd = 0.25: decoupled 1 - 0.125, independent 1 - 0.25, palm 1 - 0.0625.
  auto run = [](WeightDecayMethod m) {
    at::Tensor w = at::full({1, 3}, 8.0);
    at::Tensor g = at::zeros({1, 3});
    at::Tensor b = at::zeros({1, 3});
    const at::Tensor u = detail::muon_momentum_input(
        w, g, b, MuonOptions(0.5).momentum(0.0).weight_decay(0.25).weight_decay_method(m));
    return std::make_pair(w, u);
  };
  EXPECT_TRUE(at::equal(run(WeightDecayMethod::kDecoupled).first, at::full({1, 3}, 7.0)));
  EXPECT_TRUE(at::equal(run(WeightDecayMethod::kIndependent).first, at::full({1, 3}, 6.0)));
  EXPECT_TRUE(at::equal(run(WeightDecayMethod::kPalm).first, at::full({1, 3}, 7.5)));
  // L2 leaves W alone and feeds wd * W = 2 into the gradient (mu = 0: U = G + 2).
  const auto l2 = run(WeightDecayMethod::kL2);
  EXPECT_TRUE(at::equal(l2.first, at::full({1, 3}, 8.0)));
  EXPECT_TRUE(at::equal(l2.second, at::full({1, 3}, 2.0)));
}

TEST(MuonMath, ApplyUpdate) {
  at::Tensor w = at::full({3, 2}, 1.0);
  detail::muon_apply_update(w, at::full({3, 2}, 4.0), MuonOptions(0.25));
  EXPECT_TRUE(at::equal(w, at::zeros({3, 2})));
}

// FsdpMuon's batched orthogonalize phase: a 3-D batch gets the 2-D update of each matrix, scale
// included (the scale is a single-rounding mul, so where bits hold for Newton–Schulz — fp32,
// one thread, docs/DESIGN.md §4 "Batching" — they hold for the update), and anything else is
// refused.
TEST(MuonMath, OrthogonalizedUpdateOfABatchIsEachMatrixsUpdate) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  for (ScaleMode mode : {ScaleMode::kSpectral, ScaleMode::kShapeScaling, ScaleMode::kUnitRmsNorm}) {
    const MuonOptions options = MuonOptions(0.02)
                                    .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
                                    .scale_mode(mode);
    for (const std::vector<int64_t>& shape :
         std::vector<std::vector<int64_t>>{{5, 3, 7}, {4, 7, 3}, {3, 1, 9}, {6, 16, 24}}) {
      at::manual_seed(shape[1] * 31 + shape[2]);
      const at::Tensor u = at::randn(shape);
      const at::Tensor batch = detail::muon_orthogonalized_update(u, options);
      ASSERT_EQ(batch.sizes(), u.sizes());
      for (int64_t i = 0; i < shape[0]; ++i) {
        EXPECT_TRUE(at::equal(batch[i], detail::muon_orthogonalized_update(u[i], options)))
            << at::IntArrayRef(shape) << " entry " << i;
      }
    }
  }
  at::set_num_threads(threads);
  try {
    detail::muon_orthogonalized_update(at::randn({2, 2, 3, 4}), MuonOptions());
    ADD_FAILURE() << "a 4-D tensor was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("2-D matrix or a 3-D batch"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace fsdp_muon
