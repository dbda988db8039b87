// Checkpoints across real processes (CTest starts this under torchrun and mpirun).
//
// CheckpointSave.*   (world size 4, a CTest fixture): 3 steps of FsdpMuon + AdamW, then a sharded
//                    checkpoint and a full export into $FSDP_MUON_CHECKPOINT_DIR, plus a plain
//                    text reference of the export for the Python check.
// CheckpointResume.* (world sizes 1-4): loads that checkpoint into a differently initialized
//                    model with fresh optimizers, runs 3 more steps, and must equal an
//                    uninterrupted 6-step single-device run bit for bit (fp32 Newton–Schulz).
// CheckpointFailures.* (own scratch folder): interrupted saves, bad inputs, export/import, broken
//                    `latest`, failed saves and their retry, rank files of another save; every
//                    rank loads the checkpoint rank 0 resolved, saves into a checkpoint folder,
//                    save agreement, another job's checkpoints, failed folder fsyncs.
// CheckpointCorruptionSave.* (world size 2, a CTest fixture): two saves of the same state with
//                    small checksum chunks, and a full export of it.
// CheckpointCorruption.* (world sizes 1-3): every file of that checkpoint with bytes flipped
//                    must fail to load on every rank; the intact one loads. Also a checkpoint of
//                    format version 1 (tests/checkpoint/data/v1) still loads.
//
// Gradients are the same full tensors on every rank, written into the gradient shards, so the
// single-device reference (Muon + AdamW on full tensors) sees exactly what the shards see.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/serialize.h>

#include <fsdp_muon/checkpoint/checkpoint.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "checkpoint/failure_injection.h"
#include "checkpoint/file_io.h"
#include "common/distributed_main.h"
#include "common/model_specs.h"
#include "common/test_util.h"
#include "muon/row_state.h"

namespace fsdp_muon {
namespace {

// No std::filesystem: libtorch.so exports a copy of parts of it that crashes (see file_io.h).
using checkpoint::is_directory;
using checkpoint::join_path;
using checkpoint::list_directory;
using checkpoint::path_exists;
using checkpoint::remove_tree;

int64_t file_size(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return static_cast<int64_t>(st.st_size);
}

void copy_tree(const std::string& from, const std::string& to) {
  checkpoint::make_directories(to);
  for (const std::string& name : list_directory(from)) {
    const std::string src = join_path(from, name);
    if (is_directory(src)) {
      copy_tree(src, join_path(to, name));
    } else {
      const std::vector<char> bytes = checkpoint::read_whole_file(src);
      std::ofstream(join_path(to, name), std::ios::binary).write(bytes.data(), bytes.size());
    }
  }
}
using testing::expect_error;
using testing::Spec;
using testing::world;
using testing::world_ptr;

// Awkward shapes: sizes no world size up to 4 divides, a row and a column of 1, 1-D parameters
// between matrices, a matrix trained by AdamW, ranks that hold nothing of some parameters.
std::vector<std::vector<Spec>> specs(bool renamed = false, bool reshaped = false) {
  return {{{renamed ? "blk0.w1x" : "blk0.w1", {5, reshaped ? 8 : 7}},
           {"blk0.b1", {7}},
           {"blk0.row", {1, 9}},
           {"blk0.w2", {13, 3}}},
          {{"blk1.w", {3, 11}}, {"blk1.norm", {5}}, {"blk1.big", {17, 6}}},
          {{"head.embed", {7, 5}}, {"head.col", {9, 1}}, {"head.bias", {3}}}};
}

bool muon_param(const std::string& name, size_t dim) { return dim == 2 && name != "head.embed"; }

const MuonOptions kMuon = MuonOptions(0.02).weight_decay(0.01).newton_schulz(
    NewtonSchulzOptions().compute_dtype(at::kFloat));
const torch::optim::AdamWOptions kAdamW = torch::optim::AdamWOptions(0.01).weight_decay(0.01);

// FSDP_MUON_CHECKPOINT_NORMUON=1 (the NorMuon fixtures): NorMuon in both Muon groups, with Gram
// and AOL in the first, so its per-row state is saved, resharded and loaded.
bool with_normuon() {
  const char* v = std::getenv("FSDP_MUON_CHECKPOINT_NORMUON");
  return v != nullptr && std::string(v) == "1";
}

std::vector<torch::optim::OptimizerParamGroup> muon_groups(const std::vector<at::Tensor>& p) {
  const size_t half = p.size() / 2;
  MuonOptions first = kMuon;
  MuonOptions second = kMuon;
  second.lr(0.01).nesterov(false);
  if (with_normuon()) {
    first.normalization(Normalization::kNorMuon)
        .newton_schulz()
        .method(NsMethod::kGram)
        .preconditioning(NsPreconditioning::kAol);
    second.normalization(Normalization::kNorMuon).normuon_beta2(0.9);
  }
  return {torch::optim::OptimizerParamGroup({p.begin(), p.begin() + half},
                                            std::make_unique<MuonOptions>(first)),
          torch::optim::OptimizerParamGroup({p.begin() + half, p.end()},
                                            std::make_unique<MuonOptions>(second))};
}

std::vector<torch::optim::OptimizerParamGroup> adamw_groups(const std::vector<at::Tensor>& p) {
  auto second = kAdamW;
  second.weight_decay(0.0).amsgrad(true).betas({0.8, 0.99});
  return {torch::optim::OptimizerParamGroup({p.begin(), p.begin() + 2},
                                            std::make_unique<torch::optim::AdamWOptions>(kAdamW)),
          torch::optim::OptimizerParamGroup({p.begin() + 2, p.end()},
                                            std::make_unique<torch::optim::AdamWOptions>(second))};
}

// The sharded model and its optimizers.
struct Sharded {
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::unique_ptr<FsdpMuon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
  std::vector<torch::optim::Optimizer*> optimizers() { return {muon.get(), adamw.get()}; }
};

Sharded make_sharded(uint64_t seed, bool renamed = false, bool reshaped = false) {
  Sharded s;
  const auto all = specs(renamed, reshaped);
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> drawn;
  {
    testing::SeededRandom random(seed);
    for (const auto& group_specs : all) drawn.push_back(testing::random_parameters(group_specs));
  }
  std::vector<at::Tensor> matrices, others;
  for (size_t g = 0; g < all.size(); ++g) {
    std::vector<std::pair<std::string, at::Tensor>> named = std::move(drawn[g]);
    auto options =
        FsdpParameterGroupOptions().broadcast_from_rank0(false).name("g" + std::to_string(g));
    // A bf16 compute group: its model weights are the rounded main weights.
    if (g == 1) options.compute_dtype(at::kBFloat16);
    if (g == 1) {
      for (auto& [name, t] : named) t = t.detach().to(at::kBFloat16).requires_grad_(true);
    }
    auto group = std::make_shared<FsdpParameterGroup>(std::move(named), world_ptr(), options);
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const auto& slot = group->slot(i);
      (muon_param(slot.name, slot.shape.size()) ? matrices : others)
          .push_back(group->sharded_parameter(i));
    }
    s.groups.push_back(group);
  }
  s.muon = std::make_unique<FsdpMuon>(muon_groups(matrices), kMuon);
  s.adamw = std::make_unique<torch::optim::AdamW>(adamw_groups(others), kAdamW);
  return s;
}

// The single-device reference: full fp32 tensors, Muon + AdamW.
struct Reference {
  std::vector<std::pair<std::string, at::Tensor>> params;  // model order
  std::unique_ptr<Muon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;

  const at::Tensor& operator[](const std::string& name) const {
    for (const auto& [n, t] : params) {
      if (n == name) return t;
    }
    throw std::runtime_error("no parameter " + name);
  }
};

Reference make_reference(uint64_t seed) {
  testing::SeededRandom random(seed);  // the reference runs no collective
  Reference r;
  std::vector<at::Tensor> matrices, others;
  const auto all = specs();
  for (size_t g = 0; g < all.size(); ++g) {
    for (const Spec& spec : all[g]) {
      at::Tensor t = at::randn(spec.shape).mul_(0.5);
      // The sharded model's group 1 starts from bf16 values (its module tensors are bf16).
      if (g == 1) t = t.to(at::kBFloat16).to(at::kFloat);
      t.requires_grad_(true);
      r.params.emplace_back(spec.name, t);
      (muon_param(spec.name, spec.shape.size()) ? matrices : others).push_back(t);
    }
  }
  r.muon = std::make_unique<Muon>(muon_groups(matrices), kMuon);
  r.adamw = std::make_unique<torch::optim::AdamW>(adamw_groups(others), kAdamW);
  return r;
}

// Step `step` (1-based) with the same full gradients for both; lr changes at step 2, as a
// schedule would, so a resumed run must restore the options too.
void train_step(Sharded* s, Reference* r, int step) {
  if (step == 2) {
    if (s) {
      s->adamw->param_groups()[0].options().set_lr(0.007);
      s->muon->param_groups()[1].options().set_lr(0.015);
    }
    if (r) {
      r->adamw->param_groups()[0].options().set_lr(0.007);
      r->muon->param_groups()[1].options().set_lr(0.015);
    }
  }
  std::vector<at::Tensor> grads;
  {
    testing::SeededRandom random(1000 + step);
    for (const auto& group_specs : specs()) {
      for (const Spec& spec : group_specs) grads.push_back(at::randn(spec.shape));
    }
  }
  if (r) {
    for (size_t k = 0; k < r->params.size(); ++k)
      r->params[k].second.mutable_grad() = grads[k].clone();
    r->adamw->step();
    r->muon->step();
  }
  if (s) {
    size_t k = 0;
    for (auto& group : s->groups) {
      group->zero_grad();
      for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
        const auto [a, b] = group->held_range(i);
        group->sharded_parameter(i).grad().copy_(grads[k].reshape({-1}).slice(0, a, b));
      }
    }
    s->adamw->step();
    s->muon->step();
    // Group 2 holds only AdamW parameters apart from head.col: FsdpMuon refreshes the groups it
    // touched; refreshing all is harmless and keeps this independent of which those are.
    for (auto& group : s->groups) group->refresh_model_weights();
  }
}

// Every shard and model weight equals the reference's slice; so do the optimizer states.
void expect_equal(const Sharded& s, const Reference& r, const std::string& what) {
  const int me = world().rank();
  for (const auto& group : s.groups) {
    const auto model = group->model_parameters();
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const std::string& name = group->slot(i).name;
      const at::Tensor full = r[name].detach();
      const auto [a, b] = group->held_range(i);
      const at::Tensor expected = full.reshape({-1}).slice(0, a, b);
      const at::Tensor& shard = group->sharded_parameter(i);
      EXPECT_TRUE(at::equal(shard, expected))
          << what << ": shard of " << name << " on rank " << me << " of " << world().size()
          << " differs by " << (shard - expected).abs().max().item<double>();
      EXPECT_TRUE(at::equal(model[i].detach(), full.to(group->compute_dtype())))
          << what << ": model weight " << name << " on rank " << me;
    }
  }
}

void expect_states_equal(Sharded& s, const Reference& r, const std::string& what) {
  for (const auto& group : s.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const std::string& name = group->slot(i).name;
      const at::Tensor& p = group->sharded_parameter(i);
      const auto [a, b] = group->held_range(i);
      const at::Tensor& ref = r[name];
      auto slice = [&](const at::Tensor& t) { return t.reshape({-1}).slice(0, a, b); };
      if (muon_param(name, group->slot(i).shape.size())) {
        auto& mine = static_cast<MuonParamState&>(*s.muon->state().at(p.unsafeGetTensorImpl()));
        auto& theirs = static_cast<MuonParamState&>(*r.muon->state().at(ref.unsafeGetTensorImpl()));
        EXPECT_EQ(mine.step(), theirs.step()) << what << " " << name;
        EXPECT_TRUE(at::equal(mine.momentum_buffer(), slice(theirs.momentum_buffer())))
            << what << ": momentum of " << name;
        // NorMuon: this rank keeps the rows whose first element it holds (docs/DESIGN.md §6).
        ASSERT_EQ(mine.normuon_variance().defined(), theirs.normuon_variance().defined())
            << what << " " << name;
        if (theirs.normuon_variance().defined()) {
          const auto [first, last] = detail::rows_starting_in({a, b}, ref.size(1));
          EXPECT_TRUE(
              at::equal(mine.normuon_variance(), theirs.normuon_variance().slice(0, first, last)))
              << what << ": NorMuon state of " << name << " on rank " << world().rank();
        }
      } else {
        auto& mine = static_cast<torch::optim::AdamWParamState&>(
            *s.adamw->state().at(p.unsafeGetTensorImpl()));
        auto& theirs = static_cast<torch::optim::AdamWParamState&>(
            *r.adamw->state().at(ref.unsafeGetTensorImpl()));
        EXPECT_EQ(mine.step(), theirs.step()) << what << " " << name;
        EXPECT_TRUE(at::equal(mine.exp_avg(), slice(theirs.exp_avg()))) << what << " " << name;
        EXPECT_TRUE(at::equal(mine.exp_avg_sq(), slice(theirs.exp_avg_sq())))
            << what << " " << name;
        EXPECT_EQ(mine.max_exp_avg_sq().defined(), theirs.max_exp_avg_sq().defined()) << name;
        if (theirs.max_exp_avg_sq().defined()) {
          EXPECT_TRUE(at::equal(mine.max_exp_avg_sq(), slice(theirs.max_exp_avg_sq()))) << name;
        }
      }
    }
  }
}

std::string env_dir(const char* var) {
  const char* v = std::getenv(var);
  if (v == nullptr || *v == '\0') {
    ADD_FAILURE() << var << " is not set (CTest sets it)";
    return "";
  }
  return v;
}

// ---- the fixture: save at world size 4 ----

void write_reference_text(const Reference& r, const std::string& path) {
  std::ofstream out(path);
  auto write = [&](const std::string& key, const at::Tensor& t) {
    const at::Tensor flat = t.detach().reshape({-1}).to(at::kDouble).contiguous();
    out << key << '\t';
    for (int64_t d = 0; d < t.dim(); ++d) out << (d ? "," : "") << t.size(d);
    out << '\t' << (t.scalar_type() == at::kLong ? "int64" : "float32") << '\t';
    const double* v = flat.data_ptr<double>();
    char buf[64];
    for (int64_t k = 0; k < flat.numel(); ++k) {
      std::snprintf(buf, sizeof(buf), "%a", v[k]);
      out << (k ? " " : "") << buf;
    }
    out << '\n';
  };
  for (const auto& [name, t] : r.params) {
    write(name, t);
    auto m = r.muon->state().find(t.unsafeGetTensorImpl());
    if (m != r.muon->state().end()) {
      auto& st = static_cast<MuonParamState&>(*m->second);
      write(name + ".momentum_buffer", st.momentum_buffer());
      if (st.normuon_variance().defined()) {
        write(name + ".normuon_variance", st.normuon_variance());
      }
      write(name + ".step", at::scalar_tensor(st.step(), at::kLong));
    }
    auto a = r.adamw->state().find(t.unsafeGetTensorImpl());
    if (a != r.adamw->state().end()) {
      auto& st = static_cast<torch::optim::AdamWParamState&>(*a->second);
      write(name + ".exp_avg", st.exp_avg());
      write(name + ".exp_avg_sq", st.exp_avg_sq());
      if (st.max_exp_avg_sq().defined()) write(name + ".max_exp_avg_sq", st.max_exp_avg_sq());
      write(name + ".step", at::scalar_tensor(st.step(), at::kLong));
    }
  }
}

FSDP_MUON_WORLD_TEST(CheckpointSave, ShardedCheckpointAndExportAfterThreeSteps) {
  const std::string dir = env_dir("FSDP_MUON_CHECKPOINT_DIR");
  ASSERT_FALSE(dir.empty());
  if (world().rank() == 0) remove_tree(dir);
  world().barrier();
  Sharded s = make_sharded(7);
  Reference r = make_reference(7);
  for (int step = 1; step <= 3; ++step) train_step(&s, &r, step);
  expect_equal(s, r, "before saving");

  const std::string folder = save_checkpoint(dir + "/sharded", s.groups, s.optimizers());
  EXPECT_EQ(folder, dir + "/sharded/ckpt-000001");
  EXPECT_EQ(latest_checkpoint(dir + "/sharded"), folder);
  EXPECT_TRUE(path_exists(folder + "/manifest.pt"));
  for (int rank = 0; rank < world().size(); ++rank) {
    char name[64];
    std::snprintf(name, sizeof(name), "/rank-%05d-of-%05d.bin", rank, world().size());
    EXPECT_TRUE(path_exists(folder + name)) << name;
  }
  export_full_checkpoint(dir + "/export.pt", s.groups, s.optimizers());
  if (world().rank() == 0) write_reference_text(r, dir + "/export_reference.txt");
  world().barrier();
  if (with_normuon()) {
    // The full export holds NorMuon's whole per-row state; an import gives each rank its rows.
    Sharded t = make_sharded(99);
    import_full_checkpoint(dir + "/export.pt", t.groups, t.optimizers());
    expect_equal(t, r, "imported");
    expect_states_equal(t, r, "imported");
  }
}

// ---- loads at world sizes 1-4 ----

FSDP_MUON_WORLD_TEST(CheckpointResume, ContinuesLikeAnUninterruptedRun) {
  const std::string dir = env_dir("FSDP_MUON_CHECKPOINT_DIR");
  ASSERT_FALSE(dir.empty());
  ASSERT_TRUE(latest_checkpoint(dir + "/sharded").has_value())
      << "run the checkpoint_save test first (it is this test's CTest fixture)";
  Sharded s = make_sharded(12345);  // other initial values: the load must replace them
  Reference r = make_reference(7);
  for (int step = 1; step <= 3; ++step) train_step(nullptr, &r, step);

  load_checkpoint(dir + "/sharded", s.groups, s.optimizers());
  expect_equal(s, r, "after loading");
  expect_states_equal(s, r, "after loading");
  EXPECT_DOUBLE_EQ(s.adamw->param_groups()[0].options().get_lr(), 0.007);
  EXPECT_DOUBLE_EQ(s.muon->param_groups()[1].options().get_lr(), 0.015);
  EXPECT_TRUE(
      static_cast<torch::optim::AdamWOptions&>(s.adamw->param_groups()[1].options()).amsgrad());

  for (int step = 4; step <= 6; ++step) train_step(&s, &r, step);
  expect_equal(s, r, "6 steps with a reload after 3");
  expect_states_equal(s, r, "after 6 steps");
}

// At world size 2, rank 0 holds the first half of every group, which the saved ranks 0 and 1 of 4
// held: with saved rank 3's file gone it must not notice, only rank 1 does.
FSDP_MUON_WORLD_TEST(CheckpointResume, ReadsOnlyTheRankFilesItsShardsOverlap) {
  if (world().size() != 2) GTEST_SKIP() << "runs at world size 2";
  const std::string dir = env_dir("FSDP_MUON_CHECKPOINT_DIR");
  const auto saved = latest_checkpoint(dir + "/sharded");
  ASSERT_TRUE(saved.has_value());
  const std::string partial = dir + "/partial_w2";
  if (world().rank() == 0) {
    remove_tree(partial);
    copy_tree(*saved, partial);
    ASSERT_EQ(::unlink((partial + "/rank-00003-of-00004.bin").c_str()), 0);
  }
  world().barrier();
  Sharded s = make_sharded(12345);
  expect_error([&] { load_checkpoint(partial, s.groups, s.optimizers()); },
               {world().rank() == 0 ? "fsdp_muon::load_checkpoint failed on rank 1 of 2: "
                                      "fsdp_muon::load_checkpoint: missing rank file "
                                    : "fsdp_muon::load_checkpoint: missing rank file ",
                "rank-00003-of-00004.bin (saved rank 3 of 4)"},
               "a saved rank file only rank 1 needs");
}

// ---- failures ----

std::string scratch(const std::string& leaf) {
  const std::string base = env_dir("FSDP_MUON_CHECKPOINT_SCRATCH");
  const std::string dir = base + "/" + leaf;
  if (world().rank() == 0) remove_tree(dir);
  world().barrier();
  return dir;
}

struct Snapshot {
  std::vector<at::Tensor> shards;
  std::vector<at::Tensor> momentum;
  std::vector<int64_t> steps;
};

Snapshot snapshot(Sharded& s) {
  Snapshot snap;
  for (const auto& group : s.groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i) {
      const at::Tensor& p = group->sharded_parameter(i);
      snap.shards.push_back(p.detach().clone());
      if (!muon_param(group->slot(i).name, group->slot(i).shape.size())) continue;
      auto& st = static_cast<MuonParamState&>(*s.muon->state().at(p.unsafeGetTensorImpl()));
      snap.momentum.push_back(st.momentum_buffer().clone());
      snap.steps.push_back(st.step());
    }
  }
  return snap;
}

void expect_snapshot(Sharded& s, const Snapshot& want, const std::string& what) {
  const Snapshot have = snapshot(s);
  ASSERT_EQ(have.shards.size(), want.shards.size());
  for (size_t k = 0; k < have.shards.size(); ++k) {
    EXPECT_TRUE(at::equal(have.shards[k], want.shards[k])) << what << ": shard " << k;
  }
  ASSERT_EQ(have.momentum.size(), want.momentum.size());
  for (size_t k = 0; k < have.momentum.size(); ++k) {
    EXPECT_TRUE(at::equal(have.momentum[k], want.momentum[k])) << what << ": momentum " << k;
    EXPECT_EQ(have.steps[k], want.steps[k]) << what;
  }
}

// Every file under `dir` whose name contains `needle`, recursively.
std::vector<std::string> files_named(const std::string& dir, const std::string& needle) {
  std::vector<std::string> found;
  for (const std::string& name : list_directory(dir)) {
    const std::string path = join_path(dir, name);
    if (is_directory(path)) {
      for (const std::string& f : files_named(path, needle)) found.push_back(f);
    } else if (name.find(needle) != std::string::npos) {
      found.push_back(path);
    }
  }
  return found;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

FSDP_MUON_WORLD_TEST(CheckpointFailures, InterruptedSaveLeavesThePreviousCheckpointLoadable) {
  const int me = world().rank();
  const int last = world().size() - 1;
  const std::string dir = scratch("interrupted");
  Sharded s = make_sharded(7);
  for (int step = 1; step <= 2; ++step) train_step(&s, nullptr, step);
  const std::string first = save_checkpoint(dir, s.groups, s.optimizers());
  const Snapshot saved = snapshot(s);
  train_step(&s, nullptr, 3);

  // The last rank dies half-way through its rank file.
  if (me == last) detail::set_checkpoint_failure_injection(0);
  expect_error([&] { save_checkpoint(dir, s.groups, s.optimizers()); },
               {me == last ? "fsdp_muon::save_checkpoint: injected failure while writing"
                           : "fsdp_muon::save_checkpoint failed on rank",
                "rank-"},
               "rank file write failure");
  EXPECT_EQ(latest_checkpoint(dir), first);
  EXPECT_TRUE(path_exists(dir + "/ckpt-000002"));
  EXPECT_FALSE(path_exists(dir + "/ckpt-000002/manifest.pt"));

  // Rank 0 dies half-way through the manifest: every rank file is complete, but the
  // checkpoint is not.
  if (me == 0) detail::set_checkpoint_failure_injection(1);
  expect_error([&] { save_checkpoint(dir, s.groups, s.optimizers()); }, {"manifest.pt"},
               "manifest write failure");
  EXPECT_EQ(latest_checkpoint(dir), first);
  EXPECT_FALSE(path_exists(dir + "/ckpt-000003/manifest.pt"));
  expect_error([&] { load_checkpoint(dir + "/ckpt-000003", s.groups, s.optimizers()); },
               {"is an incomplete checkpoint", "no manifest.pt"}, "loading the incomplete one");

  // The previous checkpoint loads, bit for bit.
  load_checkpoint(dir, s.groups, s.optimizers());
  expect_snapshot(s, saved, "after the interrupted saves");

  // The next good save cleans up the leftovers and keeps the last two complete ones.
  train_step(&s, nullptr, 3);
  const std::string next = save_checkpoint(dir, s.groups, s.optimizers());
  EXPECT_EQ(next, dir + "/ckpt-000004");
  EXPECT_EQ(latest_checkpoint(dir), next);
  world().barrier();
  EXPECT_TRUE(path_exists(first + "/manifest.pt"));
  EXPECT_FALSE(path_exists(dir + "/ckpt-000002"));
  EXPECT_FALSE(path_exists(dir + "/ckpt-000003"));
  save_checkpoint(dir, s.groups, s.optimizers(), SaveCheckpointOptions().keep_last(1));
  world().barrier();
  EXPECT_FALSE(path_exists(first));
  EXPECT_FALSE(path_exists(next));
  EXPECT_TRUE(path_exists(dir + "/ckpt-000005/manifest.pt"));
}

FSDP_MUON_WORLD_TEST(CheckpointFailures, BadInputsGiveMessagesThatNameTheProblem) {
  const int me = world().rank();
  const int w = world().size();
  const std::string dir = scratch("bad");
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string folder = save_checkpoint(dir + "/good", s.groups, s.optimizers());
  char last_file[64];
  std::snprintf(last_file, sizeof(last_file), "rank-%05d-of-%05d.bin", w - 1, w);
  if (me == 0) {
    for (const char* leaf : {"truncated", "missing", "bad_manifest"}) {
      copy_tree(folder, dir + "/" + leaf);
    }
    const std::string victim = dir + "/truncated/" + last_file;
    ASSERT_EQ(::truncate(victim.c_str(), file_size(victim) / 2), 0);
    ASSERT_EQ(::unlink((dir + "/missing/" + last_file).c_str()), 0);
    const std::string manifest = dir + "/bad_manifest/manifest.pt";
    ASSERT_EQ(::truncate(manifest.c_str(), file_size(manifest) - 100), 0);
    checkpoint::make_directories(dir + "/empty");
  }
  world().barrier();
  const Snapshot before = snapshot(s);

  expect_error([&] { load_checkpoint(dir + "/truncated", s.groups, s.optimizers()); },
               {"is truncated", last_file}, "truncated rank file");
  // Only the last rank needs its own file at the same world size: the others report its error.
  const std::string on_last = "fsdp_muon::load_checkpoint failed on rank " + std::to_string(w - 1) +
                              " of " + std::to_string(w);
  expect_error(
      [&] { load_checkpoint(dir + "/missing", s.groups, s.optimizers()); },
      {"missing rank file", last_file, me == w - 1 ? "this rank needs its shards" : on_last},
      "missing rank file");
  expect_error([&] { load_checkpoint(dir + "/bad_manifest", s.groups, s.optimizers()); },
               {"manifest.pt is truncated or corrupt"}, "truncated manifest");
  expect_error([&] { load_checkpoint(dir + "/empty", s.groups, s.optimizers()); },
               {"no checkpoint in"}, "empty folder");
  {
    Sharded other = make_sharded(7, /*renamed=*/true);
    expect_error([&] { load_checkpoint(dir + "/good", other.groups, other.optimizers()); },
                 {"is a checkpoint of another model",
                  "parameter 'blk0.w1x' (shape [5, 7]) is not in the checkpoint",
                  "checkpoint parameter 'blk0.w1' (shape [5, 7]) is not in this model"},
                 "renamed parameter");
  }
  {
    Sharded other = make_sharded(7, /*renamed=*/false, /*reshaped=*/true);
    expect_error([&] { load_checkpoint(dir + "/good", other.groups, other.optimizers()); },
                 {"parameter 'blk0.w1' has shape [5, 7] in the checkpoint but [5, 8] in this "
                  "model"},
                 "reshaped parameter");
  }
  expect_error(
      [&] {
        load_checkpoint(dir + "/good", s.groups, {s.adamw.get(), s.muon.get()});
      },
      {"optimizer 0 is 'fsdp_muon' in the checkpoint but 'adamw' here"}, "swapped optimizers");
  expect_error([&] { load_checkpoint(dir + "/good", s.groups, {s.muon.get()}); },
               {"holds 2 optimizer(s) [fsdp_muon, adamw] but 1 were given"}, "one optimizer");
  {
    torch::optim::RMSprop rms(s.groups[1]->sharded_parameters());
    expect_error([&] { save_checkpoint(dir + "/x", s.groups, {&rms}); },
                 {"optimizer 0 is of an unsupported type", "torch::optim::AdamW"},
                 "unsupported optimizer");
  }
  {
    at::Tensor stray = at::zeros({3}, at::kFloat);
    torch::optim::AdamW foreign(std::vector<at::Tensor>{stray});
    expect_error([&] { save_checkpoint(dir + "/x", s.groups, {&foreign}); },
                 {"is not a sharded parameter of the given FsdpParameterGroups"},
                 "foreign parameter");
  }
  // Nothing was changed by the failed loads.
  expect_snapshot(s, before, "after the failed loads");
}

// Python writes a dict of tensors with torch.save (rank 0), every rank waits for it.
void python_save(const std::string& code) {
  if (world().rank() == 0) {
    const char* python = std::getenv("FSDP_MUON_PYTHON");
    ASSERT_NE(python, nullptr) << "FSDP_MUON_PYTHON is not set";
    const std::string script = env_dir("FSDP_MUON_CHECKPOINT_SCRATCH") + "/write.py";
    std::ofstream(script) << "import torch\n" << code << "\n";
    const std::string cmd = std::string(python) + " " + script;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  world().barrier();
}

FSDP_MUON_WORLD_TEST(CheckpointFailures, ExportImportRoundTripAndPythonWeights) {
  const std::string dir = scratch("import");
  Sharded s = make_sharded(7);
  for (int step = 1; step <= 2; ++step) train_step(&s, nullptr, step);
  export_full_checkpoint(dir + "/full.pt", s.groups, s.optimizers());

  // Weights and optimizer state come back exactly; training continues identically.
  Sharded t = make_sharded(99);
  t.adamw->param_groups()[0].options().set_lr(0.007);
  t.muon->param_groups()[1].options().set_lr(0.015);
  import_full_checkpoint(dir + "/full.pt", t.groups, t.optimizers());
  expect_snapshot(t, snapshot(s), "after import");
  train_step(&s, nullptr, 3);
  train_step(&t, nullptr, 3);
  expect_snapshot(t, snapshot(s), "one step after import");

  // Weights trained elsewhere: a plain dict Python saved, weights only.
  std::string code = "names = {";
  for (const auto& group_specs : specs()) {
    for (const Spec& spec : group_specs) {
      code += "'" + spec.name + "': (";
      for (int64_t d : spec.shape) code += std::to_string(d) + ",";
      code += "), ";
    }
  }
  code +=
      "}\n"
      "d = {n: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) / 100 + i"
      " for i, (n, s) in enumerate(names.items())}\n";
  python_save(code + "torch.save(d, '" + dir + "/py.pt')\n" +
              "bad = dict(d); del bad['blk1.norm']; torch.save(bad, '" + dir +
              "/py_missing.pt')\n" +
              "bad = dict(d); bad['blk0.w2'] = torch.zeros(3, 13); torch.save(bad, '" + dir +
              "/py_shape.pt')\n" +
              "bad = dict(d); bad['blk0.w1.exp_avg'] = torch.zeros(5, 7); "
              "torch.save(bad, '" +
              dir + "/py_extra.pt')\n" +
              "bad = dict(d); bad['head.bias.exp_avg'] = torch.zeros(3); torch.save(bad, '" + dir +
              "/py_partial.pt')\n");
  Sharded u = make_sharded(5);
  train_step(&u, nullptr, 1);
  import_full_checkpoint(dir + "/py.pt", u.groups, u.optimizers());
  int64_t k = 0;
  for (const auto& group : u.groups) {
    const auto model = group->model_parameters();
    for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
      const auto& slot = group->slot(i);
      const at::Tensor full = at::arange(slot.numel, at::kFloat).reshape(slot.shape) / 100 + k;
      const auto [a, b] = group->held_range(i);
      EXPECT_TRUE(at::equal(group->sharded_parameter(i), full.reshape({-1}).slice(0, a, b)))
          << slot.name;
      EXPECT_TRUE(at::equal(model[i].detach(), full.to(group->compute_dtype()))) << slot.name;
    }
  }
  expect_error([&] { import_full_checkpoint(dir + "/py_missing.pt", u.groups, u.optimizers()); },
               {"has no tensor 'blk1.norm'", "shape [5]"}, "missing name");
  expect_error([&] { import_full_checkpoint(dir + "/py_shape.pt", u.groups, u.optimizers()); },
               {"tensor 'blk0.w2' has shape [3, 13] but the parameter has shape [13, 3]"},
               "misshaped");
  expect_error([&] { import_full_checkpoint(dir + "/py_extra.pt", u.groups, u.optimizers()); },
               {"name no parameter of this model or state of its optimizers: 'blk0.w1.exp_avg'"},
               "state a Muon parameter cannot have");
  expect_error([&] { import_full_checkpoint(dir + "/py_partial.pt", u.groups, u.optimizers()); },
               {"has optimizer state of 'head.bias' for a adamw optimizer but lacks "
                "'head.bias.exp_avg_sq', 'head.bias.max_exp_avg_sq', 'head.bias.step'"},
               "partial AdamW state");
  if (world().rank() == 0) {
    std::ofstream(dir + "/garbage.pt") << "not a pickle";
  }
  world().barrier();
  expect_error([&] { import_full_checkpoint(dir + "/garbage.pt", u.groups, u.optimizers()); },
               {"is not a readable torch.save / pickle file"}, "garbage");
}

// ---- broken `latest`, failed saves, mixed saves, user state ----

std::string rank_file(int rank, int world_size) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank-%05d-of-%05d.bin", rank, world_size);
  return name;
}

// The README's resume pattern must throw on a checkpoint it cannot use, not start afresh (and
// then let the next saves prune the good checkpoints).
FSDP_MUON_WORLD_TEST(CheckpointFailures, BrokenLatestIsAnErrorNotAFreshStart) {
  const int me = world().rank();
  const std::string dir = scratch("broken_latest");
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  // No checkpoint: no root, or only what a first save that crashed left.
  EXPECT_EQ(latest_checkpoint(dir), std::nullopt);
  world().barrier();
  if (me == 0) {
    checkpoint::make_directories(dir + "/ckpt-000001");
    write_text(dir + "/ckpt-000001/" + rank_file(0, world().size()), "half a file");
  }
  world().barrier();
  EXPECT_EQ(latest_checkpoint(dir), std::nullopt);
  world().barrier();

  const std::string first = save_checkpoint(dir, s.groups, s.optimizers());
  EXPECT_EQ(first, dir + "/ckpt-000002");
  EXPECT_FALSE(path_exists(dir + "/ckpt-000001")) << "the crashed save's leftovers";
  train_step(&s, nullptr, 2);
  const std::string second = save_checkpoint(dir, s.groups, s.optimizers());
  const Snapshot saved = snapshot(s);
  train_step(&s, nullptr, 3);
  const Snapshot before = snapshot(s);
  const std::string latest = dir + "/latest";
  const std::vector<char> good = checkpoint::read_whole_file(latest);
  const std::string good_text(good.begin(), good.end());
  const std::string second_id = good_text.substr(good_text.find(' ') + 1);  // with its newline
  world().barrier();

  struct Case {
    std::string what;
    std::function<void()> make;  // rank 0
    std::vector<std::string> needles;
  };
  const std::string manifest = second + "/manifest.pt";
  const std::vector<Case> cases = {
      {"empty", [&] { write_text(latest, ""); }, {"latest is empty"}},
      {"garbage", [&] { write_text(latest, "\x01\x7fgarbage\n"); }, {"latest is corrupt"}},
      {"two lines", [&] { write_text(latest, good_text + good_text); }, {"latest is corrupt"}},
      {"a missing folder",
       [&] { write_text(latest, "ckpt-000009 " + second_id); },
       {"names 'ckpt-000009'", "ckpt-000009 does not exist"}},
      {"an incomplete folder",
       [&] { ASSERT_EQ(std::rename(manifest.c_str(), (manifest + ".away").c_str()), 0); },
       {"manifest.pt does not exist", "incomplete"}},
      {"another save's folder",
       [&] { write_text(latest, "ckpt-000002 " + second_id); },
       {"names 'ckpt-000002' of save", "is of save"}},
      {"no save id", [&] { write_text(latest, "ckpt-000003\n"); }, {"without a save id"}},
  };
  for (const Case& c : cases) {
    if (me == 0) c.make();
    world().barrier();
    std::vector<std::string> needles = c.needles;
    needles.push_back(latest);
    needles.insert(needles.begin(), "fsdp_muon::latest_checkpoint: ");
    expect_error(
        [&] {
          if (auto ckpt = latest_checkpoint(dir)) load_checkpoint(*ckpt, s.groups, s.optimizers());
        },
        needles, "resume pattern, latest with " + c.what);
    needles.front() = "fsdp_muon::load_checkpoint: ";
    expect_error([&] { load_checkpoint(dir, s.groups, s.optimizers()); }, needles,
                 "load_checkpoint, latest with " + c.what);
    world().barrier();
    if (me == 0) {
      write_text(latest, good_text);
      if (!path_exists(manifest)) std::rename((manifest + ".away").c_str(), manifest.c_str());
    }
    world().barrier();
  }
  expect_snapshot(s, before, "after the refused resumes");
  // Nothing was pruned; the pattern resumes from the newest.
  EXPECT_TRUE(path_exists(first + "/manifest.pt"));
  const auto ckpt = latest_checkpoint(dir);
  ASSERT_EQ(ckpt, second);
  load_checkpoint(*ckpt, s.groups, s.optimizers());
  expect_snapshot(s, saved, "resumed from the newest");
  // Without `latest` (a first save stopped between its manifest and `latest`): the newest
  // complete folder.
  world().barrier();
  if (me == 0) {
    ASSERT_EQ(::unlink(latest.c_str()), 0);
  }
  world().barrier();
  EXPECT_EQ(latest_checkpoint(dir), second);
}

// A write that fails as on a full disk: its temporary file goes at once, the incomplete folder
// with the next save, before that writes anything; no complete checkpoint is pruned for it.
FSDP_MUON_WORLD_TEST(CheckpointFailures, FailedSaveCleansUpAndARetrySucceeds) {
  const int me = world().rank();
  const int last = world().size() - 1;
  const std::string dir = scratch("disk_full");
  const auto keep_one = SaveCheckpointOptions().keep_last(1);
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string first = save_checkpoint(dir, s.groups, s.optimizers(), keep_one);
  train_step(&s, nullptr, 2);
  struct Failure {
    int rank;
    int64_t after;  // writes of that rank's save that succeed first
    std::string file;
  };
  for (const Failure& f :
       {Failure{last, 0, "rank-"}, Failure{0, 1, "manifest.pt"}, Failure{0, 2, dir + "/latest"}}) {
    if (me == f.rank)
      detail::set_checkpoint_failure_injection(f.after, InjectedFailure::kWriteError);
    expect_error(
        [&] { save_checkpoint(dir, s.groups, s.optimizers(), keep_one); },
        {me == f.rank ? "fsdp_muon::save_checkpoint: injected write error while writing"
                      : "fsdp_muon::save_checkpoint failed on rank " + std::to_string(f.rank),
         f.file},
        "a failed write of " + f.file);
    world().barrier();
    EXPECT_EQ(files_named(dir, ".tmp").size(), 0u) << "after the failed write of " << f.file;
    EXPECT_EQ(latest_checkpoint(dir), first) << f.file;
    EXPECT_TRUE(path_exists(first + "/manifest.pt")) << f.file;
    world().barrier();
  }
  const std::string retry = save_checkpoint(dir, s.groups, s.optimizers(), keep_one);
  world().barrier();
  EXPECT_EQ(latest_checkpoint(dir), retry);
  std::vector<std::string> names = list_directory(dir);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{retry.substr(dir.size() + 1), "latest"}));
  EXPECT_EQ(files_named(dir, ".tmp").size(), 0u);
  Sharded t = make_sharded(99);
  load_checkpoint(dir, t.groups, t.optimizers());
  expect_snapshot(t, snapshot(s), "loaded after the retry");
}

FSDP_MUON_WORLD_TEST(CheckpointFailures, RankFileOfAnotherSaveIsRefused) {
  const int me = world().rank();
  const int w = world().size();
  const std::string dir = scratch("mixed");
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const auto keep_all = SaveCheckpointOptions().keep_last(0);
  const std::string a = save_checkpoint(dir, s.groups, s.optimizers(), keep_all);
  const std::string b = save_checkpoint(dir, s.groups, s.optimizers(), keep_all);
  const std::string name = rank_file(0, w);
  // The same state twice: only the save id tells the two files apart.
  EXPECT_EQ(file_size(a + "/" + name), file_size(b + "/" + name));
  if (me == 0) {
    copy_tree(b, dir + "/mixed");
    const std::vector<char> bytes = checkpoint::read_whole_file(a + "/" + name);
    std::ofstream(dir + "/mixed/" + name, std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    copy_tree(b, dir + "/folder");
    ASSERT_EQ(::unlink((dir + "/folder/" + name).c_str()), 0);
    checkpoint::make_directories(dir + "/folder/" + name);
  }
  world().barrier();
  Sharded t = make_sharded(99);
  train_step(&t, nullptr, 1);  // snapshot() reads the optimizer state a step creates
  const Snapshot before = snapshot(t);
  expect_error([&] { load_checkpoint(dir + "/mixed", t.groups, t.optimizers()); },
               {"fsdp_muon::load_checkpoint", dir + "/mixed/" + name, "belongs to another save",
                "rank files of different saves cannot be mixed"},
               "a rank file of another save");
  expect_error([&] { load_checkpoint(dir + "/folder", t.groups, t.optimizers()); },
               {"fsdp_muon::load_checkpoint", dir + "/folder/" + name,
                "is a folder where a checkpoint file should be"},
               "a folder for a rank file");
  expect_snapshot(t, before, "after the refused loads");
}

FSDP_MUON_WORLD_TEST(CheckpointFailures, UserStateTravelsWithTheCheckpoint) {
  const std::string dir = scratch("user_state");
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  CheckpointUserState user;
  user.ints["step"] = 1;
  user.ints["negative"] = -7;
  user.strings["run"] = "alpha beta\n";
  save_checkpoint(dir, s.groups, s.optimizers(), SaveCheckpointOptions().user_state(user));
  Sharded t = make_sharded(99);
  const CheckpointUserState back = load_checkpoint(dir, t.groups, t.optimizers());
  EXPECT_EQ(back.ints, user.ints);
  EXPECT_EQ(back.strings, user.strings);
  CheckpointUserState clash;
  clash.ints["k"] = 1;
  clash.strings["k"] = "x";
  expect_error(
      [&] {
        save_checkpoint(dir, s.groups, s.optimizers(), SaveCheckpointOptions().user_state(clash));
      },
      {"user_state key 'k' is both an integer and a string"}, "a key in both maps");
}

// Every MuonOptions field travels with the checkpoint, the Newton-Schulz method, restarts,
// preconditioning and NorMuon's settings included: a load installs each param group's saved
// options over the live ones (README, Checkpoints), on every rank alike, and training goes on.
FSDP_MUON_WORLD_TEST(CheckpointFailures, EveryMuonOptionTravelsWithTheCheckpoint) {
  const std::string dir = scratch("muon_options");
  Sharded s = make_sharded(8);
  // Changed alike on every rank after construction, as a schedule would.
  static_cast<MuonOptions&>(s.muon->param_groups()[0].options())
      .normuon_beta2(0.9)
      .normuon_eps(1e-6)
      .scale_mode(ScaleMode::kSpectral)
      .extra_scale_factor(0.75)
      .newton_schulz()
      .method(NsMethod::kGram)
      .gram_restarts({1, 3})
      .preconditioning(NsPreconditioning::kAol)
      .steps(4);
  static_cast<MuonOptions&>(s.muon->param_groups()[1].options())
      .weight_decay_method(WeightDecayMethod::kPalm)
      .momentum(0.9)
      .newton_schulz()
      .method(NsMethod::kAuto)
      .custom_coefficients({{3.0, -3.2, 1.2}, {2.5, -2.0, 0.5}})
      .eps(1e-6);
  train_step(&s, nullptr, 1);
  save_checkpoint(dir, s.groups, s.optimizers());
  Sharded t = make_sharded(99);
  const auto options_of = [](const FsdpMuon& muon, size_t g) {
    return static_cast<const MuonOptions&>(muon.param_groups()[g].options());
  };
  for (size_t g = 0; g < 2; ++g) EXPECT_FALSE(options_of(*t.muon, g) == options_of(*s.muon, g));
  load_checkpoint(dir, t.groups, t.optimizers());
  for (size_t g = 0; g < 2; ++g) {
    EXPECT_TRUE(options_of(*t.muon, g) == options_of(*s.muon, g)) << "param group " << g;
  }
  EXPECT_EQ(options_of(*t.muon, 0).newton_schulz().gram_restarts(), (NsRestartList{1, 3}));
  EXPECT_EQ(options_of(*t.muon, 0).newton_schulz().preconditioning(), NsPreconditioning::kAol);
  EXPECT_EQ(options_of(*t.muon, 0).normuon_eps(), 1e-6);
  EXPECT_EQ(options_of(*t.muon, 1).newton_schulz().custom_coefficients().size(), 2u);
  // The loaded run and the saved one take the same next step (FsdpMuon's per-step option check
  // passes: every rank installed the same options).
  train_step(&s, nullptr, 2);
  train_step(&t, nullptr, 2);
  for (size_t g = 0; g < s.groups.size(); ++g) {
    EXPECT_TRUE(at::equal(s.groups[g]->main_weight_shard(), t.groups[g]->main_weight_shard()))
        << "group " << g;
  }
}

// ---- second pass: load agreement, nested saves, save agreement, jobs, folder fsync ----

std::string read_text(const std::string& path) {
  const std::vector<char> bytes = checkpoint::read_whole_file(path);
  return std::string(bytes.begin(), bytes.end());
}

CheckpointUserState step_state(int64_t step) {
  CheckpointUserState user;
  user.ints["step"] = step;
  return user;
}

// A save that moves `latest` between rank 0's read of it and the other ranks' reads must not
// make the ranks load different checkpoints: rank 0 resolves it, every rank loads that one.
FSDP_MUON_WORLD_TEST(CheckpointFailures, EveryRankLoadsTheCheckpointRank0Resolved) {
  const int me = world().rank();
  const std::string dir = scratch("load_agreement");
  const auto keep_all = SaveCheckpointOptions().keep_last(0);
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  save_checkpoint(dir, s.groups, s.optimizers(),
                  SaveCheckpointOptions(keep_all).user_state(step_state(1)));
  const Snapshot first = snapshot(s);
  const std::string first_latest = read_text(dir + "/latest");
  train_step(&s, nullptr, 2);
  save_checkpoint(dir, s.groups, s.optimizers(),
                  SaveCheckpointOptions(keep_all).user_state(step_state(2)));
  const std::string second_latest = read_text(dir + "/latest");
  world().barrier();
  if (me == 0) write_text(dir + "/latest", first_latest);
  world().barrier();
  // Rank 0, right after reading `latest`, lets "the second save" publish; the other ranks read
  // `latest` (if they still do) only after that.
  const std::string published = dir + "/second_published";
  detail::set_checkpoint_latest_read_hook([&](bool after) {
    if (me == 0 && after) {
      write_text(dir + "/latest", second_latest);
      write_text(published, "yes");
    } else if (me != 0 && !after) {
      for (int k = 0; k < 3000 && !path_exists(published); ++k) ::usleep(10000);
    }
  });
  Sharded t = make_sharded(99);
  CheckpointUserState back;
  try {
    back = load_checkpoint(dir, t.groups, t.optimizers());
  } catch (const c10::Error& e) {
    ADD_FAILURE() << "rank " << me << ": " << e.what_without_backtrace();
  }
  detail::set_checkpoint_latest_read_hook({});
  EXPECT_EQ(back.ints["step"], 1) << "rank " << me << " loaded another save than rank 0";
  expect_snapshot(t, first, "the checkpoint rank 0 resolved");
  world().barrier();
}

// latest_checkpoint() is local: ranks that call it around a save get different folders, and
// load_checkpoint must refuse to mix them, on every rank.
FSDP_MUON_WORLD_TEST(CheckpointFailures, LoadRefusesRanksGivenDifferentCheckpoints) {
  const int me = world().rank();
  const std::string dir = scratch("load_mixed");
  const auto keep_all = SaveCheckpointOptions().keep_last(0);
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string a = save_checkpoint(dir, s.groups, s.optimizers(), keep_all);
  train_step(&s, nullptr, 2);
  const std::string b = save_checkpoint(dir, s.groups, s.optimizers(), keep_all);
  Sharded t = make_sharded(99);
  train_step(&t, nullptr, 1);
  const Snapshot before = snapshot(t);
  expect_error([&] { load_checkpoint(me == 0 ? a : b, t.groups, t.optimizers()); },
               {"fsdp_muon::load_checkpoint", "every rank must load the same checkpoint"},
               "ranks given different checkpoint folders");
  expect_snapshot(t, before, "after the refused load");
}

// Saving into a checkpoint folder is an error (it would nest a checkpoint that loads of that
// folder never see); resuming from a root and saving into the same root is the pattern.
FSDP_MUON_WORLD_TEST(CheckpointFailures,
                     SaveIntoACheckpointFolderIsAnErrorResumeAndSaveToTheRootWorks) {
  const std::string dir = scratch("nested");
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string first = save_checkpoint(dir, s.groups, s.optimizers(),
                                            SaveCheckpointOptions().user_state(step_state(1)));
  expect_error([&] { save_checkpoint(first, s.groups, s.optimizers()); },
               {"fsdp_muon::save_checkpoint", first, "is a checkpoint folder",
                "save into the folder that holds it"},
               "a save into a checkpoint folder");
  world().barrier();
  EXPECT_EQ(list_directory(first).size(), static_cast<size_t>(world().size() + 1))
      << "the refused save wrote into " << first;

  // Resume from the root, train, save into the root, resume again: the second save.
  Sharded t = make_sharded(99);
  EXPECT_EQ(load_checkpoint(dir, t.groups, t.optimizers()).ints["step"], 1);
  train_step(&t, nullptr, 2);
  const std::string second = save_checkpoint(dir, t.groups, t.optimizers(),
                                             SaveCheckpointOptions().user_state(step_state(2)));
  EXPECT_EQ(second, dir + "/ckpt-000002");
  const Snapshot saved = snapshot(t);
  Sharded u = make_sharded(98);
  EXPECT_EQ(load_checkpoint(dir, u.groups, u.optimizers()).ints["step"], 2);
  expect_snapshot(u, saved, "resumed from the root after resume-and-save");
}

// Ranks that pass their optimizers in different orders would write a checkpoint no load
// accepts (and prune the good one); the save refuses before writing anything.
FSDP_MUON_WORLD_TEST(CheckpointFailures, SaveAgreesOnTheOptimizersBeforeWriting) {
  const int me = world().rank();
  const std::string dir = scratch("save_agreement");
  const auto keep_one = SaveCheckpointOptions().keep_last(1);
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string first = save_checkpoint(dir, s.groups, s.optimizers(), keep_one);
  const Snapshot saved = snapshot(s);
  train_step(&s, nullptr, 2);
  std::vector<torch::optim::Optimizer*> swapped = {s.adamw.get(), s.muon.get()};
  for (int attempt = 0; attempt < 2; ++attempt) {
    expect_error(
        [&] { save_checkpoint(dir, s.groups, me == 0 ? s.optimizers() : swapped, keep_one); },
        {"fsdp_muon::save_checkpoint", "the ranks disagree on what to save",
         "optimizer 0: rank 0 has fsdp_muon", "has adamw"},
        "optimizers in different orders on different ranks");
  }
  world().barrier();
  EXPECT_EQ(latest_checkpoint(dir), first);
  std::vector<std::string> names = list_directory(dir);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"ckpt-000001", "latest"}));
  Sharded t = make_sharded(99);
  load_checkpoint(dir, t.groups, t.optimizers());
  expect_snapshot(t, saved, "the checkpoint before the refused saves");
}

// Two jobs saving into one root would prune each other's checkpoints and flip `latest`: a save
// into a root whose newest checkpoint is of another job (another run_id or another model) is
// refused, and pruning never removes another job's checkpoint.
// Export and import agree their arguments across ranks (issue 32, item 4). Before: groups in
// another order on one rank wrote a file with its shards under other names, optimizers in another
// order aborted rank 0 inside Gloo, and ranks reading different files imported a model mixed
// from both. Now every rank fails naming the difference, nothing is written or changed; a copy
// of the same file under another path is fine. A load with optimizers in another order likewise.
FSDP_MUON_WORLD_TEST(CheckpointFailures, ExportImportAndLoadAgreeTheirArgumentsAcrossRanks) {
  const int w = world().size();
  if (w == 1) GTEST_SKIP() << "one rank cannot disagree with itself";
  const bool odd_one = world().rank() == w - 1;
  const std::string ranks = "rank(s) " + std::to_string(w - 1) + " differ from rank 0";
  const std::string dir = scratch("export_agreement");
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string first = dir + "/first.pt";
  const std::string second = dir + "/second.pt";
  export_full_checkpoint(first, s.groups, s.optimizers());
  const Snapshot at_first = snapshot(s);
  const std::string saved = save_checkpoint(dir + "/ckpt", s.groups, s.optimizers());
  train_step(&s, nullptr, 2);
  export_full_checkpoint(second, s.groups, s.optimizers());
  if (world().rank() == 0) {
    const std::vector<char> bytes = checkpoint::read_whole_file(first);
    std::ofstream(dir + "/copy_of_first.pt", std::ios::binary).write(bytes.data(), bytes.size());
  }
  world().barrier();

  const std::vector<std::shared_ptr<FsdpParameterGroup>> reversed(s.groups.rbegin(),
                                                                  s.groups.rend());
  const std::string bad = dir + "/bad.pt";
  expect_error([&] { export_full_checkpoint(bad, odd_one ? reversed : s.groups, s.optimizers()); },
               {"fsdp_muon::export_full_checkpoint: the ranks disagree on what to export", ranks,
                "group 0: rank 0 has 'g0'", "nothing was written"},
               "export, groups in another order");
  std::vector<torch::optim::Optimizer*> swapped = {s.adamw.get(), s.muon.get()};
  expect_error([&] { export_full_checkpoint(bad, s.groups, odd_one ? swapped : s.optimizers()); },
               {ranks, "optimizer 0: rank 0 has fsdp_muon", "has adamw"},
               "export, optimizers swapped");
  expect_error([&] { export_full_checkpoint(odd_one ? bad + "2" : bad, s.groups, s.optimizers()); },
               {ranks, "path: rank 0 has " + bad + ", rank"}, "export, another path");
  world().barrier();
  EXPECT_TRUE(files_named(dir, "bad.pt").empty()) << "a refused export wrote a file";

  Sharded t = make_sharded(99);
  train_step(&t, nullptr, 1);
  const Snapshot before = snapshot(t);
  expect_error([&] { import_full_checkpoint(odd_one ? second : first, t.groups, t.optimizers()); },
               {"fsdp_muon::import_full_checkpoint: the ranks disagree on what to import", ranks,
                "file: rank 0 has ", "nothing was changed"},
               "import, ranks reading different files");
  const std::vector<torch::optim::Optimizer*> t_swapped = {t.adamw.get(), t.muon.get()};
  expect_error(
      [&] { import_full_checkpoint(first, t.groups, odd_one ? t_swapped : t.optimizers()); },
      {ranks, "optimizer 0: rank 0 has fsdp_muon"}, "import, optimizers swapped");
  expect_snapshot(t, before, "after the refused imports");
  import_full_checkpoint(odd_one ? dir + "/copy_of_first.pt" : first, t.groups, t.optimizers());
  expect_snapshot(t, at_first, "imported from a copy under another path on one rank");

  Sharded u = make_sharded(98);
  train_step(&u, nullptr, 1);
  const std::vector<torch::optim::Optimizer*> u_swapped = {u.adamw.get(), u.muon.get()};
  const Snapshot u_before = snapshot(u);
  expect_error([&] { load_checkpoint(saved, u.groups, odd_one ? u_swapped : u.optimizers()); },
               {"fsdp_muon::load_checkpoint: the ranks disagree on what to load into", ranks,
                "optimizer 0: rank 0 has fsdp_muon"},
               "load, optimizers swapped");
  expect_snapshot(u, u_before, "after the refused load");
}

FSDP_MUON_WORLD_TEST(CheckpointFailures, AnotherJobsCheckpointsAreRefusedAndNeverPruned) {
  const int me = world().rank();
  const std::string dir = scratch("jobs");
  const std::string other_dir = scratch("jobs_other");
  const auto job_a = SaveCheckpointOptions().run_id("job-a").keep_last(1);
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string first = save_checkpoint(dir, s.groups, s.optimizers(), job_a);
  const std::string latest = read_text(dir + "/latest");
  expect_error(
      [&] {
        save_checkpoint(dir, s.groups, s.optimizers(), SaveCheckpointOptions().run_id("job-b"));
      },
      {"fsdp_muon::save_checkpoint", first, "of another job", "run id 'job-a'", "'job-b'"},
      "another run id");
  {
    Sharded other = make_sharded(7, /*renamed=*/true);
    train_step(&other, nullptr, 1);
    expect_error([&] { save_checkpoint(dir, other.groups, other.optimizers(), job_a); },
                 {"fsdp_muon::save_checkpoint", first, "of another job", "blk0.w1x"},
                 "another model");
    // Another job's checkpoint that is older than this job's newest: never pruned.
    save_checkpoint(other_dir, other.groups, other.optimizers(), job_a);
    if (me == 0) copy_tree(other_dir + "/ckpt-000001", dir + "/ckpt-000000");
    world().barrier();
  }
  world().barrier();
  EXPECT_EQ(read_text(dir + "/latest"), latest);
  train_step(&s, nullptr, 2);
  const std::string next = save_checkpoint(dir, s.groups, s.optimizers(), job_a);
  world().barrier();
  std::vector<std::string> names = list_directory(dir);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{"ckpt-000000", next.substr(dir.size() + 1), "latest"}));
}

// An EIO from a folder's fsync (the rename may not be durable) fails the save on every rank.
FSDP_MUON_WORLD_TEST(CheckpointFailures, FolderFsyncFailureFailsTheSave) {
  const int me = world().rank();
  const int last = world().size() - 1;
  const std::string dir = scratch("folder_fsync");
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string first = save_checkpoint(dir, s.groups, s.optimizers());
  struct Failure {
    int rank;
    int64_t after;  // folder fsyncs of that rank's save that succeed first
    std::string folder;
  };
  // Rank 0: the root after creating the checkpoint folder, then the folder after its rank file
  // and its manifest, then the root after `latest`; the last rank: its rank file's folder.
  for (const Failure& f : {Failure{last, 0, dir + "/ckpt-"}, Failure{0, 0, dir},
                           Failure{0, 2, dir + "/ckpt-"}, Failure{0, 3, dir}}) {
    if (me == f.rank) detail::set_checkpoint_folder_sync_failure(f.after);
    expect_error(
        [&] { save_checkpoint(dir, s.groups, s.optimizers()); },
        {me == f.rank ? "fsdp_muon::save_checkpoint: fsync of folder "
                      : "fsdp_muon::save_checkpoint failed on rank " + std::to_string(f.rank),
         f.folder, "Input/output error"},
        "a failed fsync of a folder (rank " + std::to_string(f.rank) + ", after " +
            std::to_string(f.after) + ")");
    detail::set_checkpoint_folder_sync_failure(-1);
    world().barrier();
  }
  EXPECT_TRUE(path_exists(first + "/manifest.pt"));
  train_step(&s, nullptr, 2);
  save_checkpoint(dir, s.groups, s.optimizers());
  Sharded t = make_sharded(99);
  load_checkpoint(dir, t.groups, t.optimizers());
  expect_snapshot(t, snapshot(s), "saved after the failed fsyncs");
}

// Rank files swapped (or renamed) are reported as such, not as truncated.
FSDP_MUON_WORLD_TEST(CheckpointFailures, SwappedRankFilesAreReportedAsSwapped) {
  const int me = world().rank();
  const int w = world().size();
  if (w < 2) GTEST_SKIP() << "needs two rank files";
  const std::string dir = scratch("swapped");
  Sharded s = make_sharded(7);
  train_step(&s, nullptr, 1);
  const std::string folder = save_checkpoint(dir + "/good", s.groups, s.optimizers());
  if (me == 0) {
    copy_tree(folder, dir + "/swapped");
    const std::string a = dir + "/swapped/" + rank_file(0, w);
    const std::string b = dir + "/swapped/" + rank_file(1, w);
    ASSERT_EQ(std::rename(a.c_str(), (a + ".x").c_str()), 0);
    ASSERT_EQ(std::rename(b.c_str(), a.c_str()), 0);
    ASSERT_EQ(std::rename((a + ".x").c_str(), b.c_str()), 0);
  }
  world().barrier();
  // Rank 1 reads rank 0's file; every other rank reports rank 0's error.
  const int reader = me == 1 ? 1 : 0;
  expect_error([&] { load_checkpoint(dir + "/swapped", s.groups, s.optimizers()); },
               {"fsdp_muon::load_checkpoint", rank_file(reader, w),
                "was written by rank " + std::to_string(1 - reader) + " of " + std::to_string(w) +
                    ", not rank " + std::to_string(reader),
                "swapped or renamed"},
               "swapped rank files");
}

// ---- corruption: a save at world size 2, loaded with flipped bytes at 1-3 ----

FSDP_MUON_WORLD_TEST(CheckpointCorruptionSave, TwoSavesOfOneStateAndAnExport) {
  const std::string dir = env_dir("FSDP_MUON_CHECKPOINT_DIR");
  ASSERT_FALSE(dir.empty());
  if (world().rank() == 0) remove_tree(dir);
  world().barrier();
  // Chunks far smaller than the files, so that loads at other world sizes read parts of them.
  detail::set_checkpoint_chunk_bytes(256);
  Sharded s = make_sharded(7);
  for (int step = 1; step <= 2; ++step) train_step(&s, nullptr, step);
  const auto keep_all = SaveCheckpointOptions().keep_last(0);
  save_checkpoint(dir + "/sharded", s.groups, s.optimizers(), keep_all);
  EXPECT_EQ(save_checkpoint(dir + "/sharded", s.groups, s.optimizers(), keep_all),
            dir + "/sharded/ckpt-000002");
  detail::set_checkpoint_chunk_bytes(0);
  export_full_checkpoint(dir + "/export.pt", s.groups, s.optimizers());
}

// Flips bit 0 of the byte at `offset` (twice restores it).
void flip(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  ASSERT_TRUE(f.good()) << path;
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x01);
  f.seekp(offset);
  f.write(&c, 1);
  ASSERT_TRUE(f.good()) << path << " at " << offset;
}

uint64_t read_u64(const std::string& path, int64_t offset) {
  const std::vector<char> bytes = checkpoint::read_whole_file(path);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[offset + i]);
  return v;
}

FSDP_MUON_WORLD_TEST(CheckpointCorruption, EveryFlippedByteFailsToLoadOnEveryRank) {
  const int me = world().rank();
  const std::string src = env_dir("FSDP_MUON_CHECKPOINT_DIR");
  ASSERT_TRUE(path_exists(src + "/sharded/ckpt-000002/manifest.pt"))
      << "run checkpoint_corruption_save first (it is this test's CTest fixture)";
  const std::string root = scratch("flips");
  if (me == 0) copy_tree(src + "/sharded", root);
  world().barrier();
  Sharded ref = make_sharded(5);
  import_full_checkpoint(src + "/export.pt", ref.groups, ref.optimizers());
  const Snapshot want = snapshot(ref);
  Sharded s = make_sharded(99);
  train_step(&s, nullptr, 1);  // snapshot() reads the optimizer state a step creates
  const Snapshot before = snapshot(s);

  // Per file, the offsets to flip: every field of the frame, the header, the padding after it,
  // the data from its first byte to its last; all of the manifest; every byte of `latest`.
  const std::string folder = root + "/ckpt-000002";
  std::vector<std::pair<std::string, std::vector<int64_t>>> targets;
  for (int r = 0; r < 2; ++r) {
    const std::string path = folder + "/" + rank_file(r, 2);
    const int64_t size = file_size(path);
    const auto header = static_cast<int64_t>(read_u64(path, 8));
    const int64_t data_start = (24 + header + 63) / 64 * 64;
    std::vector<int64_t> offsets = {
        0, 7, 8, 15, 16, 19, 20, 23, 24, 24 + header / 2, 24 + header - 1};
    if (data_start > 24 + header) offsets.push_back(data_start - 1);
    for (int k = 0; k < 8; ++k) offsets.push_back(data_start + (size - data_start) * k / 8);
    offsets.push_back(size - 1);
    targets.emplace_back(path, offsets);
  }
  {
    const std::string path = folder + "/manifest.pt";
    const int64_t size = file_size(path);
    std::vector<int64_t> offsets = {0, 8, 16, 20, 24};
    for (int k = 1; k < 8; ++k) offsets.push_back(size * k / 8);
    offsets.push_back(size - 1);
    targets.emplace_back(path, offsets);
  }
  {
    const std::string path = root + "/latest";
    std::vector<int64_t> offsets;
    for (int64_t k = 0; k < file_size(path); ++k) offsets.push_back(k);
    targets.emplace_back(path, offsets);
  }
  int loads = 0;
  for (const auto& [path, offsets] : targets) {
    for (int64_t offset : offsets) {
      if (me == 0) flip(path, offset);
      world().barrier();
      expect_error([&] { load_checkpoint(root, s.groups, s.optimizers()); },
                   {"fsdp_muon::load_checkpoint", path},
                   path + " with byte " + std::to_string(offset) + " flipped, world size " +
                       std::to_string(world().size()));
      ++loads;
      world().barrier();
      if (me == 0) flip(path, offset);
      world().barrier();
    }
  }
  EXPECT_GT(loads, 60);
  expect_snapshot(s, before, "after the corrupt loads");
  load_checkpoint(root, s.groups, s.optimizers());
  expect_snapshot(s, want, "the intact checkpoint");
}

// Checkpoints of format version 1 (saved at world size 4 by the previous release, with a full
// export of the same state) still load, at any world size.
FSDP_MUON_WORLD_TEST(CheckpointCorruption, LoadsAVersion1Checkpoint) {
  const std::string v1 = env_dir("FSDP_MUON_CHECKPOINT_V1");
  EXPECT_EQ(latest_checkpoint(v1 + "/sharded"), v1 + "/sharded/ckpt-000001");
  Sharded ref = make_sharded(5);
  import_full_checkpoint(v1 + "/export.pt", ref.groups, ref.optimizers());
  Sharded s = make_sharded(12345);
  const CheckpointUserState user = load_checkpoint(v1 + "/sharded", s.groups, s.optimizers());
  EXPECT_TRUE(user.ints.empty() && user.strings.empty());
  expect_snapshot(s, snapshot(ref), "a version 1 checkpoint");
  EXPECT_DOUBLE_EQ(s.adamw->param_groups()[0].options().get_lr(), 0.007);
  EXPECT_DOUBLE_EQ(s.muon->param_groups()[1].options().get_lr(), 0.015);

  // A damaged version 1 manifest (no checksum) whose pickles no longer parse (the first one in
  // the file is a param group's options): the error names it.
  const std::string copy = scratch("v1_damaged");
  if (world().rank() == 0) {
    copy_tree(v1 + "/sharded", copy);
    const std::string manifest = copy + "/ckpt-000001/manifest.pt";
    std::vector<char> bytes = checkpoint::read_whole_file(manifest);
    const std::string text(bytes.begin(), bytes.end());
    const size_t pickle = text.find("\x80\x02");  // PROTO 2: where data.pkl starts
    ASSERT_NE(pickle, std::string::npos);
    for (size_t k = pickle; k < pickle + 16; ++k) bytes[k] = '\xff';
    std::ofstream(manifest, std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  world().barrier();
  expect_error([&] { load_checkpoint(copy, s.groups, s.optimizers()); },
               {"fsdp_muon::load_checkpoint: ", copy + "/ckpt-000001/manifest.pt", "corrupt"},
               "a damaged version 1 manifest");
}

}  // namespace
}  // namespace fsdp_muon
