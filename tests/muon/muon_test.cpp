// Single-device Muon: against a float64 textbook implementation, per-group options, state
// round trips, and the errors promised at construction and at step.

#include <array>
#include <cmath>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp_muon/muon/muon.h>

#include "muon/muon_test_util.h"

namespace fsdp_muon {
namespace {

using test::expect_error;
using Tuple = std::array<double, 3>;

// ---- float64 textbook Muon (docs/DESIGN.md §4), written from the formulas, not from our code ----

std::vector<Tuple> textbook_schedule(NsCoefficients c, int64_t steps) {
  const std::vector<Tuple> quintic{{4.0848, -6.8946, 2.9270},
                                   {3.9505, -6.3029, 2.6377},
                                   {3.7418, -5.5913, 2.3037},
                                   {2.8769, -3.1427, 1.2046},
                                   {2.8366, -3.0525, 1.2012}};
  std::vector<Tuple> out;
  for (int64_t i = 0; i < steps; ++i) {
    if (c == NsCoefficients::kSimple) {
      out.push_back({3.4445, -4.7750, 2.0315});
    } else if (c == NsCoefficients::kQuintic) {
      out.push_back(quintic[static_cast<size_t>(i) % quintic.size()]);
    } else {
      ADD_FAILURE() << "textbook reference only knows simple and quintic";
    }
  }
  return out;
}

torch::Tensor textbook_ns(const torch::Tensor& u, const MuonOptions& o) {
  const bool tall = u.size(0) > u.size(1);
  torch::Tensor x = tall ? u.t() : u;
  x = x / std::max(x.norm().item<double>(), o.newton_schulz().eps());
  for (const Tuple& t :
       textbook_schedule(o.newton_schulz().coefficients(), o.newton_schulz().steps())) {
    const torch::Tensor a = x.mm(x.t());
    const torch::Tensor b = t[1] * a + t[2] * a.mm(a);
    x = t[0] * x + b.mm(x);
  }
  return tall ? x.t() : x;
}

double textbook_scale(double rows, double cols, ScaleMode mode) {
  switch (mode) {
    case ScaleMode::kSpectral:
      return std::sqrt(std::max(rows, cols));
    case ScaleMode::kShapeScaling:
      return std::sqrt(std::max(1.0, rows / cols));
    case ScaleMode::kUnitRmsNorm:
      return std::sqrt(rows / cols);
    case ScaleMode::kMatchRmsAdamW:
      return 0.2 * std::sqrt(std::max(rows, cols));
    case ScaleMode::kNone:
      return 1.0;
  }
  return 0.0;
}

void textbook_step(torch::Tensor& w, torch::Tensor& buf, torch::Tensor g, const MuonOptions& o) {
  const double lr = o.lr(), wd = o.weight_decay(), mu = o.momentum();
  switch (o.weight_decay_method()) {
    case WeightDecayMethod::kDecoupled:
      w = w - lr * wd * w;
      break;
    case WeightDecayMethod::kIndependent:
      w = w - wd * w;
      break;
    case WeightDecayMethod::kPalm:
      w = w - lr * lr * wd * w;
      break;
    case WeightDecayMethod::kL2:
      g = g + wd * w;
      break;
  }
  buf = mu * buf + (1 - mu) * g;
  const torch::Tensor u = o.nesterov() ? (1 - mu) * g + mu * buf : buf;
  const double scale = textbook_scale(static_cast<double>(w.size(0)),
                                      static_cast<double>(w.size(1)), o.scale_mode()) *
                       o.extra_scale_factor();
  w = w - lr * scale * textbook_ns(u, o);
}

struct RefCase {
  std::string name;
  MuonOptions options;
};

class MuonVsTextbook : public ::testing::TestWithParam<RefCase> {};

// fp32 parameters and fp32 Newton-Schulz against the same run in float64. The difference comes
// from fp32 rounding amplified by the NS polynomial (its slope at small singular values is
// about a^steps); measured max |diff| / (lr * scale * steps) is about 1e-6 for these shapes, and
// the bound 2e-5 leaves room for other BLAS builds while still catching any formula error (a
// wrong scale, momentum or decay is off by >= 1e-2 in these units).
TEST_P(MuonVsTextbook, FiveStepsMatchFloat64) {
  const MuonOptions o = GetParam().options;
  const std::vector<std::array<int64_t, 2>> shapes{{32, 32}, {24, 40}, {40, 24}};
  for (const auto& shape : shapes) {
    torch::manual_seed(1234);
    torch::Tensor w64 = torch::randn({shape[0], shape[1]}, torch::kDouble) * 0.1;
    torch::Tensor w = w64.to(torch::kFloat).set_requires_grad(true);
    w64 = w.detach().to(torch::kDouble);  // start from identical values
    torch::Tensor buf64 = torch::zeros_like(w64);
    Muon opt({w}, o);
    const int steps = 5;
    for (int s = 0; s < steps; ++s) {
      const torch::Tensor g = torch::randn({shape[0], shape[1]});
      w.mutable_grad() = g.clone();
      opt.step();
      textbook_step(w64, buf64, g.to(torch::kDouble), o);
    }
    const double unit = o.lr() *
                        textbook_scale(static_cast<double>(shape[0]), static_cast<double>(shape[1]),
                                       o.scale_mode()) *
                        std::abs(o.extra_scale_factor()) * steps;
    const double err = (w.detach().to(torch::kDouble) - w64).abs().max().item<double>() / unit;
    const double moved =
        (w64 - w.detach().to(torch::kDouble)).abs().max().item<double>();  // for the message
    std::cout << "[textbook] " << GetParam().name << " " << shape[0] << "x" << shape[1]
              << ": max |fp32 run - float64| / (lr*scale*steps) = " << err << "\n";
    EXPECT_LT(err, 2e-5) << GetParam().name << " shape " << shape[0] << "x" << shape[1]
                         << " relative error " << err << " (abs " << moved << ")";
    // The run really moved the parameters by about one update per step.
    auto& state = static_cast<MuonParamState&>(*opt.state().at(w.unsafeGetTensorImpl()));
    EXPECT_EQ(state.step(), steps);
  }
}

std::vector<RefCase> ref_cases() {
  const MuonOptions base = MuonOptions(0.02)
                               .newton_schulz(NewtonSchulzOptions().compute_dtype(torch::kFloat))
                               .weight_decay(0.1);
  std::vector<RefCase> cases;
  for (auto m : {WeightDecayMethod::kDecoupled, WeightDecayMethod::kIndependent,
                 WeightDecayMethod::kL2, WeightDecayMethod::kPalm}) {
    cases.push_back({std::string("wd_") + to_string(m), MuonOptions(base).weight_decay_method(m)});
  }
  cases.push_back({"no_nesterov", MuonOptions(base).nesterov(false)});
  cases.push_back({"no_weight_decay", MuonOptions(base).weight_decay(0.0)});
  for (auto s : {ScaleMode::kSpectral, ScaleMode::kShapeScaling, ScaleMode::kUnitRmsNorm,
                 ScaleMode::kMatchRmsAdamW, ScaleMode::kNone}) {
    cases.push_back({std::string("scale_") + to_string(s),
                     MuonOptions(base).scale_mode(s).lr(s == ScaleMode::kSpectral ? 1e-3 : 0.02)});
  }
  cases.push_back(
      {"simple_extra_scale",
       MuonOptions(base)
           .newton_schulz(
               NewtonSchulzOptions(base.newton_schulz()).coefficients(NsCoefficients::kSimple))
           .extra_scale_factor(0.5)});
  cases.push_back({"momentum_0_nesterov", MuonOptions(base).momentum(0.0)});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Modes, MuonVsTextbook, ::testing::ValuesIn(ref_cases()),
                         [](const ::testing::TestParamInfo<RefCase>& info) {
                           return info.param.name;
                         });

// ---- construction ----

TEST(Muon, NonMatrixParametersAreAnErrorListingTheirShapes) {
  auto w = torch::randn({4, 3}, torch::requires_grad());
  auto bias = torch::randn({4}, torch::requires_grad());
  auto conv = torch::randn({2, 3, 3, 3}, torch::requires_grad());
  expect_error(
      [&] {
        Muon({w, bias, conv}, MuonOptions());
      },
      {"2 are not", "parameter 1 shape [4]", "parameter 2 shape [2, 3, 3, 3]",
       "skip_non_matrix(true)", "AdamW"});
}

TEST(Muon, SkipNonMatrixWarnsOnceAndLeavesThemAlone) {
  auto w = torch::randn({4, 3}, torch::requires_grad());
  auto bias = torch::randn({4}, torch::requires_grad());
  auto scalar = torch::randn({}, torch::requires_grad());
  test::WarningCollector warnings;
  Muon opt({w, bias, scalar}, MuonOptions().skip_non_matrix(true));
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("parameter 1 shape [4]"), std::string::npos);
  EXPECT_NE(warnings.messages[0].find("parameter 2 shape []"), std::string::npos);
  const auto w0 = w.detach().clone(), b0 = bias.detach().clone();
  w.mutable_grad() = torch::randn({4, 3});
  bias.mutable_grad() = torch::randn({4});
  scalar.mutable_grad() = torch::randn({});
  opt.step();
  EXPECT_FALSE(torch::equal(w.detach(), w0));
  EXPECT_TRUE(torch::equal(bias.detach(), b0));
  EXPECT_EQ(opt.state().count(bias.unsafeGetTensorImpl()), 0u);
  EXPECT_EQ(warnings.messages.size(), 1u);  // nothing more at step
}

TEST(Muon, ComplexParameterIsAnError) {
  auto w = torch::randn({3, 3}, torch::dtype(torch::kComplexFloat).requires_grad(true));
  expect_error([&] { Muon({w}, MuonOptions()); }, {"complex"});
}

TEST(Muon, DuplicateParameterIsAnError) {
  auto w = torch::randn({3, 3}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{w});
  groups.emplace_back(std::vector<torch::Tensor>{w});
  expect_error([&] { Muon(groups, MuonOptions()); }, {"already in group 0"});
}

TEST(Muon, GroupWithOptionsOfAnotherOptimizerIsAnError) {
  auto w = torch::randn({3, 3}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{w},
                      std::make_unique<torch::optim::AdamWOptions>(0.1));
  expect_error([&] { Muon(groups, MuonOptions()); }, {"group 0", "MuonOptions"});
}

// ---- per-group options ----

// LibTorch 2.11's Optimizer::add_param_group copies a group's options as given, but some LibTorch
// releases (the "merge with defaults" change of pytorch#141884) replace the options of optimizer
// types they do not know with the optimizer's defaults. Either way each group must keep its own.
TEST(Muon, ParamGroupsKeepTheirOwnOptions) {
  torch::manual_seed(3);
  auto a = torch::randn({8, 6}, torch::requires_grad());
  auto b = torch::randn({6, 8}, torch::requires_grad());
  auto c = torch::randn({5, 5}, torch::requires_grad());
  const MuonOptions opts_a = MuonOptions(0.1)
                                 .momentum(0.8)
                                 .nesterov(false)
                                 .weight_decay(0.05)
                                 .weight_decay_method(WeightDecayMethod::kIndependent)
                                 .scale_mode(ScaleMode::kSpectral)
                                 .newton_schulz(NewtonSchulzOptions().compute_dtype(torch::kFloat));
  const MuonOptions opts_b = MuonOptions(0.003).newton_schulz(
      NewtonSchulzOptions().coefficients(NsCoefficients::kSimple).steps(3));
  const MuonOptions defaults = MuonOptions(0.05).momentum(0.5);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a}, std::make_unique<MuonOptions>(opts_a));
  groups.emplace_back(std::vector<torch::Tensor>{b}, std::make_unique<MuonOptions>(opts_b));
  Muon opt(groups, defaults);
  ASSERT_EQ(opt.param_groups().size(), 2u);
  EXPECT_TRUE(static_cast<MuonOptions&>(opt.param_groups()[0].options()) == opts_a);
  EXPECT_TRUE(static_cast<MuonOptions&>(opt.param_groups()[1].options()) == opts_b);

  // add_param_group afterwards: with options keeps them, without gets the defaults.
  const MuonOptions opts_c = MuonOptions(0.2).scale_mode(ScaleMode::kNone);
  opt.add_param_group({{c}, std::make_unique<MuonOptions>(opts_c)});
  auto d = torch::randn({4, 4}, torch::requires_grad());
  opt.add_param_group(torch::optim::OptimizerParamGroup({d}));
  EXPECT_TRUE(static_cast<MuonOptions&>(opt.param_groups()[2].options()) == opts_c);
  EXPECT_TRUE(static_cast<MuonOptions&>(opt.param_groups()[3].options()) == defaults);

  // And a step uses them: each parameter moves exactly as a one-group Muon with its options.
  std::vector<torch::Tensor> params{a, b, c, d};
  std::vector<MuonOptions> expected_opts{opts_a, opts_b, opts_c, defaults};
  std::vector<torch::Tensor> copies, grads;
  for (auto& p : params) {
    copies.push_back(p.detach().clone().set_requires_grad(true));
    grads.push_back(torch::randn(p.sizes()));
    p.mutable_grad() = grads.back().clone();
  }
  opt.step();
  for (size_t i = 0; i < params.size(); ++i) {
    Muon single({copies[i]}, expected_opts[i]);
    copies[i].mutable_grad() = grads[i].clone();
    single.step();
    EXPECT_TRUE(torch::equal(params[i].detach(), copies[i].detach())) << "group " << i;
  }
  // A failed add_param_group leaves the optimizer unchanged.
  auto e = torch::randn({3}, torch::requires_grad());
  expect_error([&] { opt.add_param_group(torch::optim::OptimizerParamGroup({e})); }, {"shape [3]"});
  EXPECT_EQ(opt.param_groups().size(), 4u);
}

// ---- step ----

TEST(Muon, ParametersWithoutGradientAreSkipped) {
  auto a = torch::randn({4, 4}, torch::requires_grad());
  auto b = torch::randn({4, 4}, torch::requires_grad());
  Muon opt({a, b}, MuonOptions());
  const auto b0 = b.detach().clone();
  a.mutable_grad() = torch::randn({4, 4});
  opt.step();
  EXPECT_TRUE(torch::equal(b.detach(), b0));
  EXPECT_EQ(opt.state().count(b.unsafeGetTensorImpl()), 0u);
  EXPECT_EQ(opt.state().count(a.unsafeGetTensorImpl()), 1u);
}

TEST(Muon, MomentumIsLazyAndHasTheParameterDtype) {
  auto w32 = torch::randn({6, 4}, torch::requires_grad());
  auto w16 = torch::randn({4, 6}, torch::dtype(torch::kBFloat16).requires_grad(true));
  Muon opt({w32, w16}, MuonOptions());
  EXPECT_TRUE(opt.state().empty());
  w32.mutable_grad() = torch::randn({6, 4});
  w16.mutable_grad() = torch::randn({4, 6}).to(torch::kBFloat16);
  const auto w16_before = w16.detach().clone();
  opt.step();
  auto& s32 = static_cast<MuonParamState&>(*opt.state().at(w32.unsafeGetTensorImpl()));
  auto& s16 = static_cast<MuonParamState&>(*opt.state().at(w16.unsafeGetTensorImpl()));
  EXPECT_EQ(s32.momentum_buffer().scalar_type(), torch::kFloat);
  EXPECT_EQ(s16.momentum_buffer().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(s16.momentum_buffer().sizes(), w16.sizes());
  EXPECT_EQ(w16.scalar_type(), torch::kBFloat16);
  EXPECT_FALSE(torch::equal(w16.detach(), w16_before));
  EXPECT_EQ(s32.step(), 1);
}

TEST(Muon, SparseGradientIsAnErrorAndChangesNothing) {
  auto a = torch::randn({4, 4}, torch::requires_grad());
  auto b = torch::randn({4, 4}, torch::requires_grad());
  Muon opt({a, b}, MuonOptions());
  const auto a0 = a.detach().clone();
  a.mutable_grad() = torch::randn({4, 4});
  b.mutable_grad() = torch::randn({4, 4}).to_sparse();
  expect_error([&] { opt.step(); }, {"fsdp_muon::Muon: parameter 1 of group 0", "sparse"});
  EXPECT_TRUE(torch::equal(a.detach(), a0));  // checked before anything moved
  EXPECT_TRUE(opt.state().empty());
}

TEST(Muon, ComplexGradientIsAnError) {
  auto a = torch::randn({4, 4}, torch::requires_grad());
  Muon opt({a}, MuonOptions());
  a.mutable_grad() = torch::randn({4, 4}, torch::kComplexFloat);
  expect_error([&] { opt.step(); }, {"complex"});
}

TEST(Muon, L2DecayDoesNotTouchTheUsersGradient) {
  auto a = torch::randn({4, 6}, torch::requires_grad());
  Muon opt({a}, MuonOptions().weight_decay(0.5).weight_decay_method(WeightDecayMethod::kL2));
  const auto g = torch::randn({4, 6});
  a.mutable_grad() = g.clone();
  opt.step();
  EXPECT_TRUE(torch::equal(a.grad(), g));
}

TEST(Muon, StepWithClosureReturnsTheLossAndUsesItsGradients) {
  torch::manual_seed(5);
  auto w = torch::randn({3, 5}, torch::requires_grad());
  auto w_ref = w.detach().clone().set_requires_grad(true);
  const auto x = torch::randn({7, 5});
  Muon opt({w}, MuonOptions());
  Muon ref({w_ref}, MuonOptions());
  auto loss = opt.step([&] {
    opt.zero_grad();
    auto l = x.mm(w.t()).pow(2).sum();
    l.backward();
    return l;
  });
  auto l_ref = x.mm(w_ref.t()).pow(2).sum();
  l_ref.backward();
  ref.step();
  EXPECT_EQ(loss.item<float>(), l_ref.item<float>());
  EXPECT_TRUE(torch::equal(w.detach(), w_ref.detach()));
}

TEST(Muon, LrChangesThroughTheBaseInterfaceTakeEffect) {
  auto a = torch::randn({4, 4}, torch::requires_grad());
  auto b = a.detach().clone().set_requires_grad(true);
  Muon opt_a({a}, MuonOptions(0.1));
  Muon opt_b({b}, MuonOptions(0.05));
  opt_a.param_groups()[0].options().set_lr(0.05);  // what an LR scheduler does
  const auto g = torch::randn({4, 4});
  a.mutable_grad() = g.clone();
  b.mutable_grad() = g.clone();
  opt_a.step();
  opt_b.step();
  EXPECT_TRUE(torch::equal(a.detach(), b.detach()));
}

// ---- save / load ----

TEST(Muon, SaveLoadRoundTripContinuesIdentically) {
  torch::manual_seed(9);
  auto make_params = [] {
    torch::manual_seed(10);
    return std::vector<torch::Tensor>{torch::randn({6, 4}, torch::requires_grad()),
                                      torch::randn({4, 6}, torch::requires_grad()),
                                      torch::randn({5, 5}, torch::requires_grad())};
  };
  auto make_groups = [](const std::vector<torch::Tensor>& p) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{p[0], p[1]},
                        std::make_unique<MuonOptions>(MuonOptions(0.03).weight_decay(0.1)));
    groups.emplace_back(std::vector<torch::Tensor>{p[2]},
                        std::make_unique<MuonOptions>(MuonOptions(0.01).nesterov(false)));
    return groups;
  };
  std::vector<std::vector<torch::Tensor>> grads(5);
  for (auto& step : grads) {
    step = {torch::randn({6, 4}), torch::randn({4, 6}), torch::randn({5, 5})};
  }
  auto run_steps = [&](Muon& opt, std::vector<torch::Tensor>& p, int from, int to) {
    for (int s = from; s < to; ++s) {
      for (size_t i = 0; i < p.size(); ++i) {
        p[i].mutable_grad() = grads[s][i].clone();
      }
      opt.step();
    }
  };

  auto first = make_params();
  std::stringstream bytes;
  {
    Muon opt(make_groups(first), MuonOptions());
    run_steps(opt, first, 0, 3);
    // Options edited before saving (an LR schedule); loading must bring them back.
    opt.param_groups()[1].options().set_lr(0.02);
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(bytes);
  }
  // Fresh parameters with the saved values, and an optimizer built with other options.
  auto resumed = make_params();
  for (size_t i = 0; i < resumed.size(); ++i) {
    torch::NoGradGuard no_grad;
    resumed[i].copy_(first[i]);
  }
  std::vector<torch::optim::OptimizerParamGroup> other_groups;
  other_groups.emplace_back(std::vector<torch::Tensor>{resumed[0], resumed[1]});
  other_groups.emplace_back(std::vector<torch::Tensor>{resumed[2]});
  Muon opt_resumed(other_groups, MuonOptions(0.5));
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  opt_resumed.load(in);
  EXPECT_TRUE(static_cast<MuonOptions&>(opt_resumed.param_groups()[0].options()) ==
              MuonOptions(0.03).weight_decay(0.1));
  EXPECT_TRUE(static_cast<MuonOptions&>(opt_resumed.param_groups()[1].options()) ==
              MuonOptions(0.02).nesterov(false));
  for (const auto& p : resumed) {
    auto& st = static_cast<MuonParamState&>(*opt_resumed.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(st.step(), 3);
  }
  // The uninterrupted run: same schedule (group 1 switches to lr 0.02 after step 3).
  auto straight = make_params();
  Muon opt_straight(make_groups(straight), MuonOptions());
  run_steps(opt_straight, straight, 0, 3);
  opt_straight.param_groups()[1].options().set_lr(0.02);
  run_steps(opt_straight, straight, 3, 5);
  run_steps(opt_resumed, resumed, 3, 5);
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_TRUE(torch::equal(resumed[i].detach(), straight[i].detach())) << "parameter " << i;
  }
  // The archive helpers of LibTorch (torch::save / torch::load on an optimizer) work too.
  std::stringstream bytes2;
  torch::save(opt_resumed, bytes2);
  auto again = make_params();
  Muon opt_again(make_groups(again), MuonOptions());
  torch::load(opt_again, bytes2);
  for (size_t i = 0; i < again.size(); ++i) {
    const auto& a =
        static_cast<MuonParamState&>(*opt_again.state().at(again[i].unsafeGetTensorImpl()));
    const auto& b =
        static_cast<MuonParamState&>(*opt_resumed.state().at(resumed[i].unsafeGetTensorImpl()));
    EXPECT_TRUE(a == b);
    EXPECT_EQ(a.step(), 5);
  }
}

}  // namespace
}  // namespace fsdp_muon
