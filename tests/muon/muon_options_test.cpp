// MuonOptions: defaults, validation messages, archive round trip, scale formulas.

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/serialize/archive.h>

#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/muon/muon_options.h>

#include "muon/muon_math.h"
#include "muon/muon_option_fields.h"
#include "muon/muon_test_util.h"

namespace fsdp_muon {
namespace {

using test::expect_error;

TEST(MuonOptions, DefaultsAreTheDesignDefaults) {
  const MuonOptions o;
  EXPECT_EQ(o.lr(), 0.02);
  EXPECT_EQ(o.momentum(), 0.95);
  EXPECT_TRUE(o.nesterov());
  EXPECT_EQ(o.weight_decay(), 0.0);
  EXPECT_EQ(o.weight_decay_method(), WeightDecayMethod::kDecoupled);
  EXPECT_EQ(o.newton_schulz().steps(), 5);
  EXPECT_EQ(o.newton_schulz().coefficients(), NsCoefficients::kQuintic);
  EXPECT_TRUE(o.newton_schulz().custom_coefficients().empty());
  EXPECT_EQ(o.scale_mode(), ScaleMode::kShapeScaling);
  EXPECT_EQ(o.extra_scale_factor(), 1.0);
  EXPECT_EQ(o.newton_schulz().eps(), 1e-7);
  EXPECT_EQ(o.newton_schulz().compute_dtype(), at::kBFloat16);
  EXPECT_FALSE(o.skip_non_matrix());
  EXPECT_EQ(o.newton_schulz().method(), NsMethod::kStandard);
  EXPECT_EQ(o.newton_schulz().gram_restarts(), NsRestartList{2});
  EXPECT_EQ(o.newton_schulz().preconditioning(), NsPreconditioning::kNone);
  EXPECT_EQ(o.normalization(), Normalization::kNone);
  EXPECT_EQ(o.normuon_beta2(), 0.95);
  EXPECT_EQ(o.normuon_eps(), 1e-8);
  EXPECT_EQ(o.matrix_layout(), MatrixLayout::whole());
  EXPECT_EQ(MuonOptions(0.5).lr(), 0.5);
  EXPECT_NO_THROW(o.validate());
}

TEST(MuonOptions, GetSetLr) {
  MuonOptions o(0.1);
  torch::optim::OptimizerOptions& base = o;
  EXPECT_EQ(base.get_lr(), 0.1);
  base.set_lr(0.25);
  EXPECT_EQ(o.lr(), 0.25);
}

TEST(MuonOptions, ValidationNamesTheOptionAndTheFix) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect_error([] { MuonOptions(-1.0).validate(); }, {"lr", "-1", ">= 0"});
  expect_error([&] { MuonOptions(nan).validate(); }, {"lr"});
  expect_error([] { MuonOptions().weight_decay(-0.1).validate(); }, {"weight_decay", ">= 0"});
  expect_error([] { MuonOptions().momentum(1.0).validate(); }, {"momentum", "[0, 1)"});
  expect_error([] { MuonOptions().momentum(-0.5).validate(); }, {"momentum", "[0, 1)"});
  expect_error([] { MuonOptions().newton_schulz(NewtonSchulzOptions().steps(0)).validate(); },
               {"newton_schulz().steps() 0", "at least 1",
                ".newton_schulz(NewtonSchulzOptions().steps(5))"});
  expect_error([] { MuonOptions().newton_schulz(NewtonSchulzOptions().eps(0.0)).validate(); },
               {"eps", "> 0"});
  expect_error([] { MuonOptions().newton_schulz(NewtonSchulzOptions().eps(-1e-7)).validate(); },
               {"eps", "> 0"});
  // Finite but past what the compute dtypes hold: named here, not as an ATen conversion error at
  // the first step (issue 32, item 7).
  expect_error([] { MuonOptions().newton_schulz(NewtonSchulzOptions().eps(1e300)).validate(); },
               {"invalid newton_schulz().eps()", "at most"});
  expect_error([] { MuonOptions().normuon_eps(1e300).validate(); },
               {"invalid normuon_eps", "at most"});
  expect_error(
      [] { MuonOptions().newton_schulz(NewtonSchulzOptions().eps(std::nan(""))).validate(); },
      {"invalid newton_schulz().eps()"});
  EXPECT_NO_THROW(
      MuonOptions().newton_schulz(NewtonSchulzOptions().eps(3e38)).normuon_eps(3e38).validate());
  expect_error(
      [] {
        MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kHalf)).validate();
      },
      {"newton_schulz().compute_dtype()", "at::kBFloat16", "at::kFloat"});
  expect_error(
      [] {
        MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kDouble)).validate();
      },
      {"compute_dtype"});
  expect_error([&] { MuonOptions().extra_scale_factor(inf).validate(); },
               {"extra_scale_factor", "finite"});
  expect_error([&] { MuonOptions().extra_scale_factor(nan).validate(); }, {"extra_scale_factor"});
  expect_error(
      [] {
        MuonOptions()
            .newton_schulz(NewtonSchulzOptions().coefficients(NsCoefficients::kCubic5).steps(6))
            .validate();
      },
      {"cubic5"});
  // Messages start with the options class, and name the option as MuonOptions spells it
  // (newton_schulz().steps, not steps).
  expect_error([] { MuonOptions(-1.0).validate(); }, {"fsdp_muon::MuonOptions: invalid lr -1"});
  expect_error(
      [] {
        MuonOptions()
            .newton_schulz(NewtonSchulzOptions().coefficients(NsCoefficients::kCubic5).steps(6))
            .validate();
      },
      {"fsdp_muon::MuonOptions: the cubic5 schedule is defined for exactly 5 steps",
       "set newton_schulz().steps(5)"});
  expect_error(
      [&] {
        MuonOptions()
            .newton_schulz(NewtonSchulzOptions().custom_coefficients({{1.0, nan, 0.0}}))
            .validate();
      },
      {"custom_coefficients"});
  expect_error([] { MuonOptions().normuon_beta2(1.0).validate(); },
               {"fsdp_muon::MuonOptions: invalid normuon_beta2 1", "[0, 1)"});
  expect_error([] { MuonOptions().normuon_beta2(-0.1).validate(); }, {"normuon_beta2"});
  expect_error([] { MuonOptions().normuon_eps(0.0).validate(); }, {"normuon_eps", "> 0"});
  expect_error([&] { MuonOptions().normuon_eps(nan).validate(); }, {"normuon_eps"});
  expect_error([] { MuonOptions().normalization(static_cast<Normalization>(4)).validate(); },
               {"normalization has an unknown value 4"});
  expect_error(
      [] {
        MuonOptions()
            .newton_schulz(NewtonSchulzOptions().method(NsMethod::kGram).gram_restarts({5}))
            .validate();
      },
      {"fsdp_muon::MuonOptions: newton_schulz().gram_restarts[0] = 5", "newton_schulz().steps = 5",
       "[1, newton_schulz().steps - 1]"});
  expect_error(
      [] {
        MuonOptions()
            .newton_schulz(NewtonSchulzOptions().method(NsMethod::kGram).steps(2))
            .validate();
      },
      {"newton_schulz().gram_restarts[0] = 2", "newton_schulz().gram_restarts({})"});
  expect_error(
      [] {
        MuonOptions()
            .newton_schulz(NewtonSchulzOptions().method(static_cast<NsMethod>(9)))
            .validate();
      },
      {"fsdp_muon::MuonOptions: the Newton-Schulz method has an unknown value 9"});
  // Boundaries that are valid.
  EXPECT_NO_THROW(
      MuonOptions().normuon_beta2(0.0).normalization(Normalization::kNorMuon).validate());
  EXPECT_NO_THROW(
      MuonOptions()
          .newton_schulz(NewtonSchulzOptions().method(NsMethod::kGram).steps(2).gram_restarts({}))
          .validate());
  EXPECT_NO_THROW(MuonOptions(0.0)
                      .momentum(0.0)
                      .weight_decay(0.0)
                      .newton_schulz(NewtonSchulzOptions().steps(1))
                      .validate());
  EXPECT_NO_THROW(MuonOptions()
                      .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
                      .extra_scale_factor(-2.0)
                      .validate());
}

TEST(MuonOptions, MuonConstructorRejectsInvalidOptions) {
  auto w = torch::zeros({4, 4}, torch::requires_grad());
  expect_error([&] { Muon({w}, MuonOptions(-0.1)); }, {"lr"});
  expect_error([&] { Muon({w}, MuonOptions().momentum(1.5)); }, {"momentum"});
  expect_error([&] { Muon({w}, MuonOptions().newton_schulz(NewtonSchulzOptions().steps(0))); },
               {"newton_schulz().steps()"});
  expect_error([&] { Muon({w}, MuonOptions().weight_decay(-1)); }, {"weight_decay"});
}

TEST(MuonOptions, ArchiveRoundTripKeepsEveryField) {
  const MuonOptions written =
      MuonOptions(0.125)
          .momentum(0.5)
          .nesterov(false)
          .weight_decay(0.01)
          .weight_decay_method(WeightDecayMethod::kPalm)
          .newton_schulz(NewtonSchulzOptions()
                             .steps(7)
                             .coefficients(NsCoefficients::kPolarExpress)
                             .custom_coefficients({{3.0, -3.2, 1.2}, {2.0, -1.5, 0.5}})
                             .eps(1e-9)
                             .compute_dtype(at::kFloat)
                             .method(NsMethod::kGram)
                             .gram_restarts({1, 4})
                             .preconditioning(NsPreconditioning::kAol))
          .scale_mode(ScaleMode::kMatchRmsAdamW)
          .extra_scale_factor(0.75)
          .skip_non_matrix(true)
          .normalization(Normalization::kNorMuon)
          .normuon_beta2(0.9)
          .normuon_eps(1e-6)
          .matrix_layout(MatrixLayout::row_blocks({8, 2, 2}));
  torch::serialize::OutputArchive out;
  written.serialize(out);
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  MuonOptions read(0.0);
  EXPECT_FALSE(read == written);
  read.serialize(in);
  EXPECT_TRUE(read == written);

  // Defaults (empty custom list) survive too.
  torch::serialize::OutputArchive out2;
  MuonOptions().serialize(out2);
  std::stringstream bytes2;
  out2.save_to(bytes2);
  torch::serialize::InputArchive in2;
  in2.load_from(bytes2);
  MuonOptions read2(1.0);
  read2.normalization(Normalization::kNorMuon)
      .newton_schulz()
      .custom_coefficients({{1, 2, 3}})
      .gram_restarts({3});
  read2.serialize(in2);
  EXPECT_TRUE(read2 == MuonOptions());
}

// Generated from the table every MuonOptions field is declared in (muon/muon_option_fields.h):
// a row added there is covered here without editing this test.
MuonOptions through_archive(const MuonOptions& written, MuonOptions read) {
  torch::serialize::OutputArchive out;
  written.serialize(out);
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  read.serialize(in);
  return read;
}

TEST(MuonOptionFields, EachFieldIsComparedWrittenReadAndAgreedOn) {
  const auto& fields = detail::muon_option_fields();
  const MuonOptions defaults;
  for (const auto& field : fields) {
    SCOPED_TRACE(field.name);
    MuonOptions changed;
    field.change(changed);
    EXPECT_FALSE(changed == defaults);
    EXPECT_FALSE(defaults == changed);
    EXPECT_FALSE(field.equal(changed, defaults));
    EXPECT_NE(field.text(changed), field.text(defaults));
    // Every other field still equal: the change touched this field alone.
    for (const auto& other : fields) {
      if (&other != &field) {
        EXPECT_TRUE(other.equal(changed, defaults)) << other.name;
      }
    }
    EXPECT_TRUE(through_archive(changed, MuonOptions()) == changed);
    // Read over a live value: the archive's value replaces it.
    EXPECT_TRUE(through_archive(defaults, changed) == defaults);
  }
}

TEST(MuonOptionFields, EveryFieldChangedAtOnceRoundTrips) {
  MuonOptions changed;
  for (const auto& field : detail::muon_option_fields()) field.change(changed);
  // A NewtonSchulzOptions with no setting at its default among them, and still valid.
  const NewtonSchulzOptions& ns = changed.newton_schulz();
  const NewtonSchulzOptions ns_defaults;
  EXPECT_NE(ns.steps(), ns_defaults.steps());
  EXPECT_NE(ns.coefficients(), ns_defaults.coefficients());
  EXPECT_NE(ns.custom_coefficients(), ns_defaults.custom_coefficients());
  EXPECT_NE(ns.eps(), ns_defaults.eps());
  EXPECT_NE(ns.compute_dtype(), ns_defaults.compute_dtype());
  EXPECT_NE(ns.method(), ns_defaults.method());
  EXPECT_NE(ns.gram_restarts(), ns_defaults.gram_restarts());
  EXPECT_NE(ns.preconditioning(), ns_defaults.preconditioning());
  EXPECT_NO_THROW(changed.validate());
  const MuonOptions read = through_archive(changed, MuonOptions());
  EXPECT_TRUE(read == changed);
  for (const auto& field : detail::muon_option_fields()) {
    EXPECT_TRUE(field.equal(read, changed)) << field.name;
    EXPECT_EQ(field.text(read), field.text(changed)) << field.name;
  }
}

// The table has one row for each NewtonSchulzOptions setting, named as MuonOptions spells it.
TEST(MuonOptionFields, NamesAreTheSpellingAndCoverNewtonSchulz) {
  std::vector<std::string> names;
  for (const auto& field : detail::muon_option_fields()) names.push_back(field.name);
  EXPECT_EQ(names, (std::vector<std::string>{"lr",
                                             "momentum",
                                             "nesterov",
                                             "weight_decay",
                                             "weight_decay_method",
                                             "newton_schulz.steps",
                                             "newton_schulz.coefficients",
                                             "newton_schulz.custom_coefficients",
                                             "newton_schulz.eps",
                                             "newton_schulz.compute_dtype",
                                             "newton_schulz.method",
                                             "newton_schulz.gram_restarts",
                                             "newton_schulz.preconditioning",
                                             "scale_mode",
                                             "extra_scale_factor",
                                             "skip_non_matrix",
                                             "normalization",
                                             "normuon_beta2",
                                             "normuon_eps",
                                             "matrix_layout"}));
}

// The archive keys are the checkpoint format: exactly those MuonOptions wrote before
// NewtonSchulzOptions became one field (tests/checkpoint/data/v1 was written with them).
TEST(MuonOptionFields, ArchiveKeysAreTheCheckpointFormat) {
  torch::serialize::OutputArchive out;
  MuonOptions().serialize(out);
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  std::vector<std::string> keys = in.keys();
  std::sort(keys.begin(), keys.end());
  std::vector<std::string> expected = {"lr",
                                       "momentum",
                                       "nesterov",
                                       "weight_decay",
                                       "weight_decay_method",
                                       "ns_steps",
                                       "coefficients",
                                       "custom_coefficients",
                                       "scale_mode",
                                       "extra_scale_factor",
                                       "eps",
                                       "ns_dtype",
                                       "skip_non_matrix",
                                       "ns_method",
                                       "gram_restarts",
                                       "ns_preconditioning",
                                       "normalization",
                                       "normuon_beta2",
                                       "normuon_eps",
                                       "matrix_layout",
                                       "matrix_layout_rows"};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(keys, expected);
}

// An archive as the release before NewtonSchulzOptions became one field wrote it (its keys and
// encodings, by hand): the settings land in newton_schulz().
TEST(MuonOptions, AnArchiveOfTheOldLayoutFillsNewtonSchulz) {
  torch::serialize::OutputArchive out;
  out.write("lr", c10::IValue(0.03));
  out.write("ns_steps", c10::IValue(int64_t{4}));
  out.write("coefficients", c10::IValue(static_cast<int64_t>(NsCoefficients::kPolarExpress)));
  out.write(
      "custom_coefficients",
      c10::IValue(at::tensor(std::vector<double>{3.0, -3.2, 1.2}, at::kDouble).reshape({1, 3})));
  out.write("eps", c10::IValue(1e-6));
  out.write("ns_dtype", c10::IValue(static_cast<int64_t>(at::kFloat)));
  out.write("ns_method", c10::IValue(static_cast<int64_t>(NsMethod::kGram)));
  out.write("gram_restarts", c10::IValue(at::tensor(std::vector<int64_t>{1, 3}, at::kLong)));
  out.write("ns_preconditioning", c10::IValue(static_cast<int64_t>(NsPreconditioning::kAol)));
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  MuonOptions read;
  read.serialize(in);
  EXPECT_EQ(read.lr(), 0.03);
  const NewtonSchulzOptions& ns = read.newton_schulz();
  EXPECT_EQ(ns.steps(), 4);
  EXPECT_EQ(ns.coefficients(), NsCoefficients::kPolarExpress);
  EXPECT_EQ(ns.custom_coefficients(), (NsCoefficientList{{3.0, -3.2, 1.2}}));
  EXPECT_EQ(ns.eps(), 1e-6);
  EXPECT_EQ(ns.compute_dtype(), at::kFloat);
  EXPECT_EQ(ns.method(), NsMethod::kGram);
  EXPECT_EQ(ns.gram_restarts(), (NsRestartList{1, 3}));
  EXPECT_EQ(ns.preconditioning(), NsPreconditioning::kAol);
  // An enum outside its bounds names the key.
  torch::serialize::OutputArchive bad;
  bad.write("ns_method", c10::IValue(int64_t{7}));
  std::stringstream bad_bytes;
  bad.save_to(bad_bytes);
  torch::serialize::InputArchive bad_in;
  bad_in.load_from(bad_bytes);
  expect_error([&] { MuonOptions().serialize(bad_in); },
               {"archive entry 'ns_method' holds 7", "0..2"});
}

TEST(MuonOptions, ArchiveWithoutTheNewFieldsKeepsTheirDefaults) {
  // An archive written before the method, gram_restarts, preconditioning and NorMuon existed:
  // write everything, then read it through an archive that only has the old keys.
  torch::serialize::OutputArchive out;
  out.write("lr", c10::IValue(0.5));
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  MuonOptions read = MuonOptions()
                         .newton_schulz(NewtonSchulzOptions().method(NsMethod::kGram))
                         .normalization(Normalization::kNorMuon);
  read.serialize(in);
  EXPECT_EQ(read.lr(), 0.5);
  EXPECT_EQ(read.newton_schulz().method(),
            NsMethod::kGram);  // untouched, as for every other absent key
  EXPECT_EQ(read.normalization(), Normalization::kNorMuon);
}

// NewtonSchulzOptions is one field: set whole (the rest of MuonOptions untouched), or one of its
// settings in place through the reference, which leaves its other settings as they were.
TEST(MuonOptions, NewtonSchulzIsOneField) {
  const NewtonSchulzOptions set = NewtonSchulzOptions()
                                      .steps(8)
                                      .coefficients(NsCoefficients::kCans)
                                      .custom_coefficients({{2, -1.5, 0.5}})
                                      .eps(1e-5)
                                      .compute_dtype(at::kFloat)
                                      .method(NsMethod::kAuto)
                                      .gram_restarts({1, 3})
                                      .preconditioning(NsPreconditioning::kAol);
  MuonOptions o = MuonOptions(0.5).newton_schulz(set);
  EXPECT_EQ(o.lr(), 0.5);
  const NewtonSchulzOptions& ns = o.newton_schulz();
  EXPECT_EQ(ns.steps(), 8);
  EXPECT_EQ(ns.coefficients(), NsCoefficients::kCans);
  ASSERT_EQ(ns.custom_coefficients().size(), 1u);
  EXPECT_EQ(ns.custom_coefficients()[0][1], -1.5);
  EXPECT_EQ(ns.eps(), 1e-5);
  EXPECT_EQ(ns.compute_dtype(), at::kFloat);
  EXPECT_EQ(ns.method(), NsMethod::kAuto);
  EXPECT_EQ(ns.gram_restarts(), (NsRestartList{1, 3}));
  EXPECT_EQ(ns.preconditioning(), NsPreconditioning::kAol);
  o.newton_schulz().steps(4);
  EXPECT_EQ(o.newton_schulz().steps(), 4);
  EXPECT_EQ(o.newton_schulz().compute_dtype(), at::kFloat);
  EXPECT_EQ(o.newton_schulz().method(), NsMethod::kAuto);
  // MuonOptions' defaults are NewtonSchulzOptions' own.
  EXPECT_TRUE(MuonOptions() == MuonOptions().newton_schulz(NewtonSchulzOptions()));
}

TEST(MuonOptions, EnumNames) {
  EXPECT_STREQ(to_string(ScaleMode::kSpectral), "spectral");
  EXPECT_STREQ(to_string(ScaleMode::kShapeScaling), "shape_scaling");
  EXPECT_STREQ(to_string(ScaleMode::kUnitRmsNorm), "unit_rms_norm");
  EXPECT_STREQ(to_string(ScaleMode::kMatchRmsAdamW), "match_rms_adamw");
  EXPECT_STREQ(to_string(ScaleMode::kNone), "none");
  EXPECT_STREQ(to_string(WeightDecayMethod::kDecoupled), "decoupled");
  EXPECT_STREQ(to_string(WeightDecayMethod::kIndependent), "independent");
  EXPECT_STREQ(to_string(WeightDecayMethod::kL2), "l2");
  EXPECT_STREQ(to_string(WeightDecayMethod::kPalm), "palm");
  EXPECT_STREQ(to_string(Normalization::kNone), "none");
  EXPECT_STREQ(to_string(Normalization::kNorMuon), "normuon");
}

TEST(MuonScale, FormulasForSquareWideAndTall) {
  using detail::muon_scale;
  // square 64x64, wide 16x64 (out < in), tall 64x16 (out > in)
  EXPECT_DOUBLE_EQ(muon_scale(64, 64, ScaleMode::kSpectral), 8.0);
  EXPECT_DOUBLE_EQ(muon_scale(16, 64, ScaleMode::kSpectral), 8.0);
  EXPECT_DOUBLE_EQ(muon_scale(64, 16, ScaleMode::kSpectral), 8.0);
  EXPECT_DOUBLE_EQ(muon_scale(64, 64, ScaleMode::kShapeScaling), 1.0);
  EXPECT_DOUBLE_EQ(muon_scale(16, 64, ScaleMode::kShapeScaling), 1.0);
  EXPECT_DOUBLE_EQ(muon_scale(64, 16, ScaleMode::kShapeScaling), 2.0);
  EXPECT_DOUBLE_EQ(muon_scale(64, 64, ScaleMode::kUnitRmsNorm), 1.0);
  EXPECT_DOUBLE_EQ(muon_scale(16, 64, ScaleMode::kUnitRmsNorm), 0.5);
  EXPECT_DOUBLE_EQ(muon_scale(64, 16, ScaleMode::kUnitRmsNorm), 2.0);
  EXPECT_DOUBLE_EQ(muon_scale(64, 64, ScaleMode::kMatchRmsAdamW), 1.6);
  EXPECT_DOUBLE_EQ(muon_scale(16, 64, ScaleMode::kMatchRmsAdamW), 1.6);
  EXPECT_DOUBLE_EQ(muon_scale(64, 16, ScaleMode::kMatchRmsAdamW), 1.6);
  EXPECT_DOUBLE_EQ(muon_scale(16, 64, ScaleMode::kNone), 1.0);
  EXPECT_DOUBLE_EQ(muon_scale(64, 16, ScaleMode::kNone), 1.0);
}

}  // namespace
}  // namespace fsdp_muon
