// FsdpMuon with matrix layouts across real processes (torchrun and mpirun, 1-4 ranks): fused QKV
// and per-row blocks, batched 3-D experts, against single-device Muon with the same layouts bit
// for bit; each block a matrix of its own in matrices(), the plan and the bytes; bad layouts an
// error on every rank; a checkpoint saved at W = 2 resumed at W = 3 (docs/DESIGN.md §3).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "checkpoint/file_io.h"
#include "common/distributed_main.h"
#include "common/model_specs.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using testing::expect_error;
using testing::Spec;
using testing::world;
using testing::world_ptr;

// Awkward at every world size up to 4: one-row blocks, blocks that no shard size divides,
// experts of one row, experts that (for W >= 3) no rank holds whole, 1-D parameters between.
std::vector<std::vector<Spec>> layout_specs() {
  return {{{"attn.qkv", {12, 5}}, {"attn.bias", {12}}, {"attn.heads", {4, 7}}, {"mlp.w", {5, 7}}},
          {{"experts.w1", {3, 4, 6}}, {"router", {3, 6}}, {"experts.w2", {3, 6, 4}}, {"norm", {6}}},
          {{"tall", {9, 3}}, {"experts.row", {5, 1, 9}}}};
}

// Which optimizer group (and so which layout) each parameter of layout_specs() belongs to; -1:
// not FsdpMuon's.
struct Assignment {
  std::string name;
  int param_group;
};
const std::vector<Assignment>& assignments() {
  static const std::vector<Assignment> a = {
      {"attn.qkv", 1}, {"attn.bias", -1}, {"attn.heads", 2}, {"mlp.w", 0}, {"experts.w1", 3},
      {"router", 0},   {"experts.w2", 3}, {"norm", -1},      {"tall", 4},  {"experts.row", 3},
  };
  return a;
}

std::vector<MatrixLayout> layouts() {
  return {MatrixLayout::whole(), MatrixLayout::row_blocks({6, 3, 3}),
          MatrixLayout::row_blocks({1, 1, 1, 1}), MatrixLayout::batched(),
          MatrixLayout::row_blocks({7, 2})};
}

struct Model {
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<std::vector<at::Tensor>> reference;  // full tensors, [group][parameter]
};

Model make_model(uint64_t seed) {
  const auto specs = layout_specs();
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> drawn;
  {
    testing::SeededRandom random(seed);
    for (const auto& group_specs : specs) drawn.push_back(testing::random_parameters(group_specs));
  }
  Model model;
  for (size_t g = 0; g < specs.size(); ++g) {
    auto named = std::move(drawn[g]);
    std::vector<at::Tensor> reference;
    for (const auto& [name, t] : named) reference.push_back(t.detach().clone().requires_grad_());
    model.groups.push_back(std::make_shared<FsdpParameterGroup>(
        std::move(named), world_ptr(),
        FsdpParameterGroupOptions().broadcast_from_rank0(false).name("g" + std::to_string(g))));
    model.reference.push_back(std::move(reference));
  }
  return model;
}

// The optimizer groups, over the sharded parameters or over the reference tensors.
std::vector<torch::optim::OptimizerParamGroup> param_groups(const Model& model, bool sharded,
                                                            const MuonOptions& options) {
  const auto all_layouts = layouts();
  std::vector<std::vector<at::Tensor>> members(all_layouts.size());
  size_t k = 0;
  for (size_t g = 0; g < model.groups.size(); ++g) {
    for (size_t i = 0; i < model.groups[g]->num_parameters(); ++i, ++k) {
      const int pg = assignments()[k].param_group;
      if (pg < 0) continue;
      members[pg].push_back(sharded ? model.groups[g]->sharded_parameter(i)
                                    : model.reference[g][i]);
    }
  }
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (size_t pg = 0; pg < members.size(); ++pg) {
    MuonOptions o = options;
    o.matrix_layout(all_layouts[pg]);
    out.emplace_back(members[pg], std::make_unique<MuonOptions>(o));
  }
  return out;
}

void feed_gradients(Model& model, uint64_t seed) {
  for (auto& group : model.groups) group->zero_grad();
  testing::SeededRandom random(seed);
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const at::Tensor full = at::randn(model.reference[g][i].sizes());
      const auto [first, second] = group->held_range(i);
      group->sharded_parameter(i).grad().copy_(full.reshape({-1}).slice(0, first, second));
      model.reference[g][i].mutable_grad() = full.clone();
    }
  }
}

void expect_matches_reference(const Model& model, const std::string& what) {
  for (size_t g = 0; g < model.groups.size(); ++g) {
    const auto& group = model.groups[g];
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const at::Tensor& ref = model.reference[g][i];
      const auto [first, second] = group->held_range(i);
      const at::Tensor expected = ref.detach().reshape({-1}).slice(0, first, second);
      const at::Tensor& shard = group->sharded_parameter(i);
      EXPECT_TRUE(at::equal(shard, expected))
          << what << ": shard of " << group->slot(i).name << " on rank " << world().rank()
          << " differs by " << (shard - expected).abs().max().item<double>();
      EXPECT_TRUE(at::equal(group->model_parameters()[i].detach(), ref.detach()))
          << what << ": model weight " << group->slot(i).name;
    }
  }
}

struct Case {
  std::string name;
  MuonOptions options;
  FsdpMuonConfig config;
};

std::vector<Case> cases() {
  const MuonOptions fp32 =
      MuonOptions(0.02).newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
  return {
      {"fp32 defaults", fp32, FsdpMuonConfig()},
      {"fp32 spectral wd, holders-only, one matrix per round, no overlap",
       MuonOptions(0.03)
           .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
           .scale_mode(ScaleMode::kSpectral)
           .weight_decay(0.1),
       FsdpMuonConfig().planner(OwnerPlanOptions()
                                    .owner_policy(OwnerPolicy::kHoldersOnly)
                                    .prefetch_budget_bytes(0)
                                    .overlap_communication(false))},
      {"fp32 gram unit_rms, any rank, never batched",
       MuonOptions(0.02)
           .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat).method(NsMethod::kGram))
           .scale_mode(ScaleMode::kUnitRmsNorm),
       FsdpMuonConfig()
           .planner(OwnerPlanOptions().owner_policy(OwnerPolicy::kAnyRank))
           .batch_newton_schulz(NewtonSchulzBatching::kNever)},
      {"bf16 no nesterov, windows", MuonOptions(0.02).nesterov(false),
       FsdpMuonConfig().planner(
           OwnerPlanOptions().owner_schedule(OwnerSchedule::kWindows).prefetch_budget_bytes(512))},
  };
}

FSDP_MUON_WORLD_TEST(FsdpMuonLayouts, EqualSingleDeviceMuonBitwise) {
  ASSERT_EQ(at::get_num_threads(), 1);
  uint64_t seed = 1;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Model model = make_model(seed);
    FsdpMuon fsdp(param_groups(model, true, c.options), c.options, c.config);
    Muon muon(param_groups(model, false, c.options), c.options);
    for (int step = 0; step < 4; ++step) {
      feed_gradients(model, 100 * seed + step);
      fsdp.step();
      muon.step();
    }
    expect_matches_reference(model, c.name);
    EXPECT_EQ(fsdp.last_step_stats().active_parameters,
              static_cast<int64_t>(fsdp.matrices().size()));
    // State stays per parameter and per element: each rank keeps its slice, counted once a step.
    for (const FsdpMuonMatrix& m : fsdp.matrices()) {
      const auto& state = static_cast<const MuonParamState&>(
          *fsdp.state().at(m.sharded_parameter.unsafeGetTensorImpl()));
      EXPECT_EQ(state.step(), 4) << m.name;
      EXPECT_EQ(state.momentum_buffer().numel(), m.sharded_parameter.numel()) << m.name;
    }
    ++seed;
  }
}

FSDP_MUON_WORLD_TEST(FsdpMuonLayouts, EveryBlockIsAMatrixOfItsOwn) {
  const int me = world().rank();
  const int w = world().size();
  Model model = make_model(5);
  const MuonOptions options =
      MuonOptions().newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat));
  FsdpMuon fsdp(param_groups(model, true, options), options,
                // Given rates: the rounds, and so which blocks share a batched call (checked
                // below), must not depend on what calibration measures on a loaded machine.
                FsdpMuonConfig()
                    .planner(OwnerPlanOptions().owner_policy(OwnerPolicy::kHoldersOnly))
                    .rates(CostRates()));
  // Plan order: FSDP group, then parameter, then block.
  const std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> expected = {
      {"attn.qkv[0]", 6, 5, 0},    {"attn.qkv[1]", 3, 5, 30},    {"attn.qkv[2]", 3, 5, 45},
      {"attn.heads[0]", 1, 7, 0},  {"attn.heads[1]", 1, 7, 7},   {"attn.heads[2]", 1, 7, 14},
      {"attn.heads[3]", 1, 7, 21}, {"mlp.w", 5, 7, 0},           {"experts.w1[0]", 4, 6, 0},
      {"experts.w1[1]", 4, 6, 24}, {"experts.w1[2]", 4, 6, 48},  {"router", 3, 6, 0},
      {"experts.w2[0]", 6, 4, 0},  {"experts.w2[1]", 6, 4, 24},  {"experts.w2[2]", 6, 4, 48},
      {"tall[0]", 7, 3, 0},        {"tall[1]", 2, 3, 21},        {"experts.row[0]", 1, 9, 0},
      {"experts.row[1]", 1, 9, 9}, {"experts.row[2]", 1, 9, 18}, {"experts.row[3]", 1, 9, 27},
      {"experts.row[4]", 1, 9, 36}};
  ASSERT_EQ(fsdp.matrices().size(), expected.size());
  size_t planned = 0;
  for (const auto& round : fsdp.owner_plan().rounds) planned += round.size();
  EXPECT_EQ(planned, expected.size());
  bool some_expert_held_whole_by_nobody = false;
  for (size_t k = 0; k < expected.size(); ++k) {
    const FsdpMuonMatrix& m = fsdp.matrices()[k];
    const auto& [name, rows, cols, offset] = expected[k];
    EXPECT_EQ(m.name, name);
    EXPECT_EQ(m.rows, rows) << name;
    EXPECT_EQ(m.cols, cols) << name;
    EXPECT_EQ(m.offset, offset) << name;
    EXPECT_GE(m.owner, 0) << name;
    EXPECT_LT(m.owner, w) << name;
    // Holders-only: the owner holds part of the block itself, not just of its parameter.
    const auto [first, second] = m.group->held_range(m.index, m.owner);
    EXPECT_LT(std::max(first, m.offset), std::min(second, m.offset + rows * cols))
        << name << " is owned by rank " << m.owner << ", which holds none of it";
    bool whole_somewhere = false;
    for (int r = 0; r < w; ++r) {
      const auto [a, b] = m.group->held_range(m.index, r);
      whole_somewhere |= a <= m.offset && m.offset + rows * cols <= b;
    }
    if (name.rfind("experts.w", 0) == 0 && !whole_somewhere)
      some_expert_held_whole_by_nobody = true;
  }
  if (w >= 3) {
    EXPECT_TRUE(some_expert_held_whole_by_nobody) << "the specs no longer split an expert";
  }
  // The parameter's first block answers owner_of.
  EXPECT_EQ(fsdp.owner_of(model.groups[1]->sharded_parameter(0)), fsdp.matrices()[8].owner);
  // Bytes are counted per block: under holders-only the communicator's counters are the plan's.
  feed_gradients(model, 51);
  fsdp.step();
  const FsdpMuonStepStats& stats = fsdp.last_step_stats();
  EXPECT_EQ(stats.gather_bytes, fsdp.owner_plan().gather_bytes_per_rank[me]);
  EXPECT_EQ(stats.scatter_bytes, fsdp.owner_plan().scatter_bytes_per_rank[me]);
  if (w <= 2) {
    // Same-shape blocks of one optimizer group a rank owns in one round share a call.
    EXPECT_LT(stats.newton_schulz_calls, stats.orthogonalized_matrices);
  }
}

FSDP_MUON_WORLD_TEST(FsdpMuonLayouts, BadLayoutsAreAnErrorOnEveryRank) {
  Model model = make_model(9);
  const auto q = model.groups[0]->sharded_parameter(0);        // attn.qkv [12, 5]
  const auto experts = model.groups[1]->sharded_parameter(0);  // experts.w1 [3, 4, 6]
  const auto w = model.groups[0]->sharded_parameter(3);        // mlp.w [5, 7]
  const auto with = [](std::vector<at::Tensor> params, MatrixLayout layout, bool skip = false) {
    return std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
        std::move(params),
        std::make_unique<MuonOptions>(
            MuonOptions().matrix_layout(std::move(layout)).skip_non_matrix(skip)))};
  };
  expect_error(
      [&] {
        FsdpMuon(with({q}, MatrixLayout::row_blocks({6, 3})));
      },
      {"fsdp_muon::FsdpMuon: ", "'attn.qkv'", "12 rows", "row_blocks{6, 3}", "adds up to 9"});
  expect_error(
      [&] {
        FsdpMuon(with({q}, MatrixLayout::row_blocks({6, 0, 6})));
      },
      {"row_blocks{6, 0, 6}", "at least one row"});
  expect_error([&] { FsdpMuon(with({w}, MatrixLayout::batched())); },
               {"'mlp.w'", "[5, 7]", "batched", "3-D [E, m, n]"});
  expect_error(
      [&] {
        FsdpMuon(with({experts}, MatrixLayout::row_blocks({1, 1, 1})));
      },
      {"'experts.w1'", "[3, 4, 6]", "2-D parameter"});
  expect_error(
      [&] {
        FsdpMuon(with({w, experts}, MatrixLayout::whole()));
      },
      {"only 2-D parameters", "'experts.w1' [3, 4, 6]", "MatrixLayout::batched()"});
  // skip_non_matrix concerns whole() only: a layout that does not fit stays an error, and a 3-D
  // parameter under whole() is left out.
  expect_error([&] { FsdpMuon(with({w}, MatrixLayout::batched(), true)); }, {"'mlp.w'", "batched"});
  {
    FsdpMuon skipping(with({w, experts}, MatrixLayout::whole(), true));
    ASSERT_EQ(skipping.matrices().size(), 1u);
    EXPECT_EQ(skipping.matrices()[0].name, "mlp.w");
    EXPECT_EQ(skipping.owner_of(experts), -1);
  }
  // Ranks that construct different (each valid) layouts: the construction agreement names them.
  if (world().size() > 1) {
    const MatrixLayout mine = world().rank() == 1 ? MatrixLayout::row_blocks({4, 4, 4})
                                                  : MatrixLayout::row_blocks({6, 3, 3});
    expect_error([&] { FsdpMuon(with({q}, mine)); },
                 {"the ranks constructed different optimizers", "rank(s) 1", "matrix_layout",
                  "row_blocks{4, 4, 4}", "row_blocks{6, 3, 3}"});
  }
  // A layout edited after construction no longer matches the plan: the next step says so on
  // every rank, before anything changes.
  {
    FsdpMuon fsdp(with({q}, MatrixLayout::row_blocks({6, 3, 3})));
    feed_gradients(model, 91);
    const at::Tensor before = q.clone();
    static_cast<MuonOptions&>(fsdp.param_groups()[0].options())
        .matrix_layout(MatrixLayout::row_blocks({6, 6}));
    expect_error([&] { fsdp.step(); },
                 {"matrix_layout of parameter group 0 is now row_blocks{6, 6}",
                  "made for row_blocks{6, 3, 3}", "construct a new FsdpMuon"});
    EXPECT_TRUE(at::equal(q, before));
  }
}

// ---- checkpoints: the layout in the manifest, state per element, so resharding just works ----

std::string env_dir() {
  const char* v = std::getenv("FSDP_MUON_LAYOUTS_CHECKPOINT_DIR");
  if (v == nullptr || *v == '\0') {
    ADD_FAILURE() << "FSDP_MUON_LAYOUTS_CHECKPOINT_DIR is not set (CTest sets it)";
    return "";
  }
  return v;
}

const MuonOptions& checkpoint_options() {
  static const MuonOptions options =
      MuonOptions(0.02)
          .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
          .weight_decay(0.05);
  return options;
}

// The single-device reference of the checkpoint tests: `steps` steps from seed 17.
void train_reference(Model& model, Muon& muon, int first, int last) {
  for (int step = first; step <= last; ++step) {
    feed_gradients(model, 1700 + step);
    muon.step();
  }
}

// Saved by a W = 2 job after 3 steps (the fixture of the resume test).
FSDP_MUON_WORLD_TEST(FsdpMuonLayoutsCheckpointSave, SavesAfterThreeSteps) {
  const std::string dir = env_dir();
  ASSERT_FALSE(dir.empty());
  if (world().rank() == 0) checkpoint::remove_tree(dir);
  world().barrier();
  Model model = make_model(17);
  FsdpMuon fsdp(param_groups(model, true, checkpoint_options()), checkpoint_options());
  Muon muon(param_groups(model, false, checkpoint_options()), checkpoint_options());
  for (int step = 1; step <= 3; ++step) {
    feed_gradients(model, 1700 + step);
    fsdp.step();
    muon.step();
  }
  expect_matches_reference(model, "before saving");
  save_checkpoint(dir, model.groups, {&fsdp});
}

// Loaded by a job of another world size: continues exactly like the uninterrupted reference; a
// job constructed with another layout is refused, naming both.
FSDP_MUON_WORLD_TEST(FsdpMuonLayoutsCheckpointResume, ContinuesAtAnotherWorldSize) {
  const std::string dir = env_dir();
  ASSERT_FALSE(dir.empty());
  ASSERT_TRUE(latest_checkpoint(dir).has_value()) << "run the save test first (its fixture)";
  {
    Model other = make_model(18);
    auto groups = param_groups(other, true, checkpoint_options());
    static_cast<MuonOptions&>(groups[1].options()).matrix_layout(MatrixLayout::row_blocks({4, 8}));
    FsdpMuon fsdp(groups, checkpoint_options());
    expect_error([&] { load_checkpoint(dir, other.groups, {&fsdp}); },
                 {"fsdp_muon::load_checkpoint: optimizer 0, param group 1",
                  "saved with matrix_layout row_blocks{6, 3, 3}", "row_blocks{4, 8}"});
  }
  Model model = make_model(12345);  // other values: the load must replace them
  FsdpMuon fsdp(param_groups(model, true, checkpoint_options()), checkpoint_options());
  load_checkpoint(dir, model.groups, {&fsdp});
  Model reference = make_model(17);
  Muon muon(param_groups(reference, false, checkpoint_options()), checkpoint_options());
  train_reference(reference, muon, 1, 3);
  for (size_t g = 0; g < model.groups.size(); ++g) model.reference[g] = reference.reference[g];
  expect_matches_reference(model, "after loading");
  for (int step = 4; step <= 6; ++step) {
    feed_gradients(model, 1700 + step);
    fsdp.step();
    muon.step();
  }
  expect_matches_reference(model, "3 steps after resuming");
}

// NorMuon keeps one value per row: of each expert's rows for a batched 3-D parameter (E x m x n
// read as E·m rows). Saved by 2 ranks, loaded by 3, exported and imported at 3: the next steps
// equal single-device Muon with NorMuon, bit for bit. In-process only: it runs two world sizes.
TEST(FsdpMuonLayoutsNorMuon, BatchedExpertsCheckpointReshardAndExport) {
  if (!testing::in_process()) GTEST_SKIP() << "in-process: saves at W=2, loads at W=3";
  const std::string base = env_dir();
  ASSERT_FALSE(base.empty());
  const std::string dir = base + "/normuon";
  const MuonOptions options =
      MuonOptions(checkpoint_options()).normalization(Normalization::kNorMuon);
  testing::on_world_of(2, [&] {
    if (world().rank() == 0) checkpoint::remove_tree(dir);
    world().barrier();
    Model model = make_model(17);
    FsdpMuon fsdp(param_groups(model, true, options), options);
    Muon muon(param_groups(model, false, options), options);
    for (int step = 1; step <= 3; ++step) {
      feed_gradients(model, 1700 + step);
      fsdp.step();
      muon.step();
    }
    expect_matches_reference(model, "NorMuon before saving");
    save_checkpoint(dir + "/sharded", model.groups, {&fsdp});
    export_full_checkpoint(dir + "/full.pt", model.groups, {&fsdp});
  });
  testing::on_world_of(3, [&] {
    Model reference = make_model(17);
    Muon muon(param_groups(reference, false, options), options);
    train_reference(reference, muon, 1, 3);
    Model loaded = make_model(12345);  // other values: the load must replace them
    FsdpMuon from_sharded(param_groups(loaded, true, options), options);
    load_checkpoint(dir + "/sharded", loaded.groups, {&from_sharded});
    Model imported = make_model(54321);
    FsdpMuon from_full(param_groups(imported, true, options), options);
    import_full_checkpoint(dir + "/full.pt", imported.groups, {&from_full});
    for (Model* m : {&loaded, &imported}) {
      for (size_t g = 0; g < m->groups.size(); ++g) m->reference[g] = reference.reference[g];
    }
    expect_matches_reference(loaded, "NorMuon after loading at W=3");
    expect_matches_reference(imported, "NorMuon after importing at W=3");
    for (int step = 4; step <= 6; ++step) {
      feed_gradients(loaded, 1700 + step);
      from_sharded.step();
      feed_gradients(imported, 1700 + step);  // the same gradients on the shared reference
      from_full.step();
      muon.step();
    }
    expect_matches_reference(loaded, "NorMuon 3 steps after loading");
    expect_matches_reference(imported, "NorMuon 3 steps after importing");
  });
}

}  // namespace
}  // namespace fsdp_muon
