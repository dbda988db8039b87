// NorMuon in single-device Muon (docs/DESIGN.md §4, "NorMuon"): the normalization against the
// reference math of the NorMuon paper and microsoft/dion's NorMuon (written out here in float64
// from their description), hand cases with closed-form answers, full Muon steps, state and
// checkpoints, Gram/AOL options through Muon.

#include <cmath>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/newton_schulz/newton_schulz.h>

#include "common/check.h"
#include "muon/muon_math.h"
#include "muon/muon_test_util.h"

namespace fsdp_muon {
namespace {

using test::expect_error;

// The reference, one matrix O (rows × cols) and its row second moment v, in float64:
//   norm = ‖O‖_F;  m_i = mean_j O_ij²;  v ← lerp(v, m, 1 − β2) = v + (1 − β2)·(m − v)
//   N_ij = O_ij / (√v_i + ε);  N ← N · (norm / max(‖N‖_F, ε))
torch::Tensor reference_normuon(const torch::Tensor& o, torch::Tensor& v, double beta2,
                                double eps) {
  const torch::Tensor norm = o.norm();
  const torch::Tensor m = (o * o).mean(-1);
  v = torch::lerp(v, m, 1.0 - beta2);
  torch::Tensor n = o / (v.sqrt() + eps).unsqueeze(-1);
  const torch::Tensor n_norm = n.norm().clamp_min(eps);
  return n * (norm / n_norm);
}

TEST(NorMuonNormalize, MatchesTheReferenceOverStepsInFloat64) {
  const MuonOptions options = MuonOptions().normalization(Normalization::kNorMuon);
  for (const auto& [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{3, 5}, {5, 3}, {1, 7}, {7, 1}}) {
    torch::manual_seed(rows * 10 + cols);
    torch::Tensor v_lib = torch::zeros({rows}, torch::kDouble);
    torch::Tensor v_ref = torch::zeros({rows}, torch::kDouble);
    for (int step = 0; step < 4; ++step) {
      const torch::Tensor o = torch::randn({rows, cols}, torch::kDouble);
      const torch::Tensor got = detail::muon_normuon_normalize(o, v_lib, options);
      const torch::Tensor want = reference_normuon(o, v_ref, 0.95, 1e-8);
      EXPECT_LE((got - want).abs().max().item<double>(), 1e-10)
          << rows << "x" << cols << " " << step;
      EXPECT_LE((v_lib - v_ref).abs().max().item<double>(), 1e-10) << rows << "x" << cols;
    }
  }
}

TEST(NorMuonNormalize, HandCasesWithClosedFormAnswers) {
  const MuonOptions options =
      MuonOptions().normalization(Normalization::kNorMuon).normuon_beta2(0.5).normuon_eps(1e-300);
  // Rows of different sizes and a zero row. First step: v = 0.5·m, every nonzero row divided by
  // √(0.5·m_i), i.e. brought to one RMS; then all of it rescaled to ‖O‖_F. So each nonzero row
  // ends with RMS ‖O‖_F / √(nonzero rows · cols) and its own direction; the zero row stays zero.
  const torch::Tensor o =
      torch::tensor({3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 1.0}, torch::kDouble).reshape({3, 3});
  torch::Tensor v = torch::zeros({3}, torch::kDouble);
  const torch::Tensor got = detail::muon_normuon_normalize(o, v, options);
  const double norm = std::sqrt(9.0 + 16.0 + 3.0);
  const double rms = norm / std::sqrt(2.0 * 3.0);
  // Row 0 (3, 4, 0) has RMS 5/√3; row 2 (1, -1, 1) has RMS 1.
  const torch::Tensor want =
      torch::tensor({3.0 / (5.0 / std::sqrt(3.0)) * rms, 4.0 / (5.0 / std::sqrt(3.0)) * rms, 0.0,
                     0.0, 0.0, 0.0, rms, -rms, rms},
                    torch::kDouble)
          .reshape({3, 3});
  EXPECT_LE((got - want).abs().max().item<double>(), 1e-12) << got;
  EXPECT_LE(std::abs(v[0].item<double>() - 0.5 * 25.0 / 3.0), 1e-14);
  EXPECT_EQ(v[1].item<double>(), 0.0);
  EXPECT_LE(std::abs(v[2].item<double>() - 0.5), 1e-15);
  // Second step with the same O: v = 0.5·v + 0.5·m = m exactly; the rows come out the same.
  const torch::Tensor again = detail::muon_normuon_normalize(o, v, options);
  EXPECT_LE((again - want).abs().max().item<double>(), 1e-12);
  EXPECT_LE(std::abs(v[0].item<double>() - 0.75 * 25.0 / 3.0), 1e-14);
  // The Frobenius norm is kept whatever v holds.
  v.fill_(7.0);
  EXPECT_LE(std::abs(detail::muon_normuon_normalize(o, v, options).norm().item<double>() - norm),
            1e-12);
  // A zero update stays zero (the ε clamps keep 0/0 out).
  torch::Tensor v0 = torch::zeros({2}, torch::kDouble);
  const torch::Tensor zero =
      detail::muon_normuon_normalize(torch::zeros({2, 4}, torch::kDouble), v0,
                                     MuonOptions().normalization(Normalization::kNorMuon));
  EXPECT_EQ(zero.abs().max().item<double>(), 0.0);
}

// Full Muon steps with NorMuon against: our momentum (same operations as Muon, so U is the same
// bits), our Newton–Schulz (tested on its own), then the reference normalization, the scale and
// the learning rate in float64.
TEST(MuonNorMuon, StepsMatchTheReferenceInFloat64) {
  for (NsMethod method : {NsMethod::kStandard, NsMethod::kGram}) {
    const MuonOptions options =
        MuonOptions(0.05)
            .momentum(0.9)
            .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat).method(method))
            .normalization(Normalization::kNorMuon)
            .normuon_beta2(0.9);
    torch::manual_seed(3);
    std::vector<torch::Tensor> params{torch::randn({6, 4}, torch::kDouble),
                                      torch::randn({4, 6}, torch::kDouble),
                                      torch::randn({1, 5}, torch::kDouble)};
    std::vector<torch::Tensor> reference;
    for (auto& p : params) {
      reference.push_back(p.clone());
      p.set_requires_grad(true);
    }
    std::vector<torch::Tensor> momentum, variance;
    for (const auto& p : reference) {
      momentum.push_back(torch::zeros_like(p));
      variance.push_back(torch::zeros({p.size(0)}, torch::kDouble));
    }
    Muon opt(params, options);
    for (int step = 0; step < 4; ++step) {
      for (size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor g = torch::randn(params[i].sizes(), torch::kDouble);
        params[i].mutable_grad() = g.clone();
        const torch::Tensor g_scaled = g.mul(1.0 - 0.9);
        momentum[i].mul_(0.9);
        momentum[i].add_(g_scaled);
        const torch::Tensor u = g_scaled.add(momentum[i].mul(0.9));
        const torch::Tensor o = newton_schulz(u, options.newton_schulz());
        const torch::Tensor n = reference_normuon(o, variance[i], 0.9, 1e-8);
        const double scale = std::sqrt(
            std::max(1.0, static_cast<double>(u.size(0)) / static_cast<double>(u.size(1))));
        reference[i] -= 0.05 * scale * n;
      }
      opt.step();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_LE((params[i].detach() - reference[i]).abs().max().item<double>(), 1e-10)
            << "param " << i << " step " << step << " " << to_string(method);
        const auto& state =
            static_cast<const MuonParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
        EXPECT_LE((state.normuon_variance() - variance[i]).abs().max().item<double>(), 1e-10);
      }
    }
  }
}

TEST(MuonNorMuon, VarianceIsLazyPerRowInTheParameterDtypeAndOnlyWithNorMuon) {
  auto w = torch::randn({5, 3}, torch::requires_grad());
  auto plain = torch::randn({5, 3}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      std::vector<torch::Tensor>{w},
      std::make_unique<MuonOptions>(MuonOptions().normalization(Normalization::kNorMuon)));
  groups.emplace_back(std::vector<torch::Tensor>{plain});
  Muon opt(groups);
  EXPECT_TRUE(opt.state().empty());
  w.mutable_grad() = torch::randn({5, 3});
  plain.mutable_grad() = torch::randn({5, 3});
  opt.step();
  const auto& s = static_cast<const MuonParamState&>(*opt.state().at(w.unsafeGetTensorImpl()));
  ASSERT_TRUE(s.normuon_variance().defined());
  EXPECT_EQ(s.normuon_variance().sizes(), torch::IntArrayRef({5}));
  EXPECT_EQ(s.normuon_variance().scalar_type(), torch::kFloat);
  EXPECT_GT(s.normuon_variance().min().item<double>(), 0.0);
  const auto& p = static_cast<const MuonParamState&>(*opt.state().at(plain.unsafeGetTensorImpl()));
  EXPECT_FALSE(p.normuon_variance().defined());
}

TEST(MuonNorMuon, SaveLoadRoundTripContinuesIdentically) {
  const MuonOptions options = MuonOptions(0.03)
                                  .newton_schulz(NewtonSchulzOptions()
                                                     .compute_dtype(at::kFloat)
                                                     .method(NsMethod::kGram)
                                                     .preconditioning(NsPreconditioning::kAol)
                                                     .steps(4))
                                  .normalization(Normalization::kNorMuon);
  torch::manual_seed(4);
  const torch::Tensor init = torch::randn({6, 9});
  std::vector<torch::Tensor> grads;
  for (int s = 0; s < 5; ++s) grads.push_back(torch::randn({6, 9}));
  auto w = init.clone().set_requires_grad(true);
  Muon opt({w}, options);
  std::stringstream bytes;
  for (int s = 0; s < 5; ++s) {
    w.mutable_grad() = grads[s].clone();
    opt.step();
    if (s == 2) {
      torch::serialize::OutputArchive archive;
      opt.save(archive);
      archive.save_to(bytes);
    }
  }
  // Resume from step 3 with an optimizer built with default options: the archive brings the
  // options and the variance back.
  auto resumed = init.clone().set_requires_grad(true);
  {
    Muon replay({resumed}, options);
    for (int s = 0; s < 3; ++s) {
      resumed.mutable_grad() = grads[s].clone();
      replay.step();
    }
  }
  Muon opt2({resumed}, MuonOptions());
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  opt2.load(in);
  const auto& loaded = static_cast<const MuonOptions&>(opt2.param_groups()[0].options());
  EXPECT_TRUE(loaded == options);
  for (int s = 3; s < 5; ++s) {
    resumed.mutable_grad() = grads[s].clone();
    opt2.step();
  }
  EXPECT_TRUE(torch::equal(resumed.detach(), w.detach()));
}

// A batch's normalization, one call for every matrix, gives each the bits of its 2-D call on one
// CPU thread (where FsdpMuon batches by default), in fp32 and bf16, over shapes with rows of one,
// odd widths and sizes past a vector's length; the variance too.
TEST(NorMuonNormalize, ABatchIsEachMatrixBitwiseOnOneThread) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const MuonOptions options = MuonOptions().normalization(Normalization::kNorMuon);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
             {5, 3, 7}, {4, 7, 3}, {3, 1, 9}, {6, 16, 24}, {2, 129, 65}, {3, 96, 256}}) {
      torch::manual_seed(shape[1] * 7 + shape[2]);
      const torch::Tensor o = torch::randn(shape).to(dtype);
      torch::Tensor v_batch = torch::rand({shape[0], shape[1]}).to(dtype);
      std::vector<torch::Tensor> v_one;
      for (int64_t i = 0; i < shape[0]; ++i) v_one.push_back(v_batch[i].clone());
      const torch::Tensor batch = detail::muon_normuon_normalize(o, v_batch, options);
      for (int64_t i = 0; i < shape[0]; ++i) {
        const torch::Tensor one = detail::muon_normuon_normalize(o[i], v_one[i], options);
        EXPECT_TRUE(torch::equal(batch[i], one)) << dtype << " " << o.sizes() << " matrix " << i;
        EXPECT_TRUE(torch::equal(v_batch[i], v_one[i])) << dtype << " " << o.sizes() << " " << i;
      }
    }
  }
  at::set_num_threads(threads);
}

TEST(MuonNorMuon, BatchedUpdateEqualsOneMatrixAtATime) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);  // where batches are bitwise (docs/DESIGN.md §4, "Batching")
  const MuonOptions options = MuonOptions()
                                  .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
                                  .normalization(Normalization::kNorMuon);
  torch::manual_seed(5);
  const torch::Tensor u = torch::randn({3, 4, 7});
  torch::Tensor v_batch = torch::rand({3, 4});
  std::vector<torch::Tensor> v_one;
  for (int64_t i = 0; i < 3; ++i) v_one.push_back(v_batch[i].clone());
  const torch::Tensor batch = detail::muon_orthogonalized_update(u, options, v_batch);
  for (int64_t i = 0; i < 3; ++i) {
    const torch::Tensor one = detail::muon_orthogonalized_update(u[i], options, v_one[i]);
    EXPECT_TRUE(torch::equal(batch[i], one)) << i;
    EXPECT_TRUE(torch::equal(v_batch[i], v_one[i])) << i;
  }
  at::set_num_threads(threads);
}

TEST(MuonNorMuon, VarianceMustMatchTheNormalization) {
  FSDP_MUON_API_SCOPE("Muon");  // the math's errors name the optimizer that calls it
  const torch::Tensor u = torch::randn({4, 6});
  expect_error(
      [&] {
        detail::muon_orthogonalized_update(u, MuonOptions().normalization(Normalization::kNorMuon));
      },
      {"fsdp_muon::Muon: per-row state is missing but the update rule is 'normuon'"});
  expect_error([&] { detail::muon_orthogonalized_update(u, MuonOptions(), torch::zeros({4})); },
               {"per-row state is given but the update rule is 'none'"});
  expect_error(
      [&] {
        detail::muon_orthogonalized_update(u, MuonOptions().normalization(Normalization::kNorMuon),
                                           torch::zeros({6}));
      },
      {"one entry per row"});
}

}  // namespace
}  // namespace fsdp_muon
