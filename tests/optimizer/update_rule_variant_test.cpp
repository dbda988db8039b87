// A Muon variant that lives in this test file alone (docs/DESIGN.md §10, "Add a Muon variant"):
// its update rule is declared here, with per-row state, and registered under a Normalization
// value of its own. Nothing else of the library names it, yet FsdpMuon at every world size equals
// single-device Muon with it bit for bit, its per-row state travels with the exchange, and a
// checkpoint saved at W = 2 resumes at W = 3 (resharding that state) on the same bits.

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "checkpoint/file_io.h"
#include "common/distributed_main.h"
#include "common/model_specs.h"
#include "common/test_util.h"
#include "muon/update_rule.h"

namespace fsdp_muon {
namespace {

using testing::Spec;
using testing::world;
using testing::world_ptr;

// The variant: each row divided by the root of an EMA of its mean square (NorMuon's per-row step
// without its Frobenius rescale), β = 0.5. Only ops that round once per element or reduce a
// whole row, so every owner computes Muon's bits.
at::Tensor row_rms(const at::Tensor& o, const at::Tensor& v, const MuonOptions&) {
  v.mul_(0.5);
  v.add_(o.mul(o).mean(-1).mul(0.5));
  return o.div(v.sqrt().add(1e-7).unsqueeze(-1));
}

constexpr auto kRowRms = static_cast<Normalization>(41);
const bool kRegistered = [] {
  detail::register_update_rule(kRowRms, detail::UpdateRule{"row_rms", true, &row_rms});
  return true;
}();

MuonOptions variant_options() {
  return MuonOptions(0.02)
      .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
      .normalization(kRowRms);
}

// Rows of one element, sizes no world size divides, a bias FsdpMuon does not hold.
const std::vector<Spec> kSpecs = {
    {"a", {5, 7}}, {"bias", {7}}, {"b", {1, 9}}, {"c", {13, 3}}, {"d", {6, 6}}};

struct Model {
  std::shared_ptr<FsdpParameterGroup> group;
  std::vector<at::Tensor> reference;  // full tensors, single-device Muon's
  std::vector<at::Tensor> matrices() const {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      if (kSpecs[i].shape.size() == 2) out.push_back(group->sharded_parameter(i));
    }
    return out;
  }
  std::vector<at::Tensor> reference_matrices() const {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      if (kSpecs[i].shape.size() == 2) out.push_back(reference[i]);
    }
    return out;
  }
};

Model make_model() {
  std::vector<std::pair<std::string, at::Tensor>> named;
  {
    testing::SeededRandom random(41);
    named = testing::random_parameters(kSpecs);
  }
  Model model;
  for (const auto& [name, t] : named) {
    model.reference.push_back(t.detach().clone().requires_grad_(true));
  }
  model.group = std::make_shared<FsdpParameterGroup>(
      std::move(named), world_ptr(),
      FsdpParameterGroupOptions().broadcast_from_rank0(false).name("g"));
  return model;
}

// The same full gradients on every rank (so their mean is themselves): this rank's slices to the
// shards, the whole to the reference.
void feed_gradients(Model& model, uint64_t seed) {
  model.group->zero_grad();
  testing::SeededRandom random(seed);
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    const at::Tensor full = at::randn(kSpecs[i].shape);
    const auto [first, second] = model.group->held_range(i);
    model.group->sharded_parameter(i).grad().copy_(full.reshape({-1}).slice(0, first, second));
    model.reference[i].mutable_grad() = full.clone();
  }
}

void expect_equal_to_reference(const Model& model, const std::string& when) {
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    if (kSpecs[i].shape.size() != 2) continue;
    const auto [first, second] = model.group->held_range(i);
    const at::Tensor want = model.reference[i].detach().reshape({-1}).slice(0, first, second);
    EXPECT_TRUE(at::equal(model.group->sharded_parameter(i).detach(), want))
        << testing::failure_prefix() << when << ": '" << kSpecs[i].name << "' differs";
  }
}

FSDP_MUON_WORLD_TEST(UpdateRuleVariant, FsdpMuonEqualsMuonBitwiseWithItsRowState) {
  ASSERT_TRUE(kRegistered);
  EXPECT_STREQ(to_string(kRowRms), "row_rms");
  Model model = make_model();
  FsdpMuon fsdp(model.matrices(), variant_options());
  Muon muon(model.reference_matrices(), variant_options());
  for (int step = 0; step < 3; ++step) {
    feed_gradients(model, 4100 + step);
    fsdp.step();
    muon.step();
    expect_equal_to_reference(model, "step " + std::to_string(step));
  }
  // The rule's state exists, one entry per row (the sharded one travels with the exchange where a
  // matrix spans ranks: without it the bits above would differ at W > 1).
  for (const at::Tensor& p : model.reference_matrices()) {
    const auto& state =
        static_cast<const MuonParamState&>(*muon.state().at(p.unsafeGetTensorImpl()));
    ASSERT_TRUE(state.normuon_variance().defined());
    EXPECT_EQ(state.normuon_variance().numel(), p.size(0));
  }
}

std::string checkpoint_dir() {
  const char* v = std::getenv("FSDP_MUON_UPDATE_RULE_CHECKPOINT_DIR");
  return v != nullptr ? v : "";
}

TEST(UpdateRuleVariant, SavedAtTwoRanksResumesAtThreeOnMuonsBits) {
  if (!testing::in_process()) GTEST_SKIP() << "in-process only";
  const std::string dir = checkpoint_dir();
  ASSERT_FALSE(dir.empty()) << "FSDP_MUON_UPDATE_RULE_CHECKPOINT_DIR is not set (CTest sets it)";
  checkpoint::remove_tree(dir);
  testing::on_world_of(2, [&] {
    Model model = make_model();
    FsdpMuon fsdp(model.matrices(), variant_options());
    for (int step = 0; step < 2; ++step) {
      feed_gradients(model, 4200 + step);
      fsdp.step();
    }
    save_checkpoint(dir, {model.group}, {&fsdp});
  });
  testing::on_world_of(3, [&] {
    Model model = make_model();  // initial weights; the load replaces them and the state
    FsdpMuon fsdp(model.matrices(), variant_options());
    load_checkpoint(dir, {model.group}, {&fsdp});
    // The reference runs all four steps from the start.
    Muon muon(model.reference_matrices(), variant_options());
    for (int step = 0; step < 4; ++step) {
      feed_gradients(model, 4200 + step);
      if (step >= 2) fsdp.step();
      muon.step();
    }
    expect_equal_to_reference(model, "two steps after resuming at W = 3");
  });
}

}  // namespace
}  // namespace fsdp_muon
