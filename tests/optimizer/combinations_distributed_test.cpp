// Every feature in combination with every other (issue 32): layout {whole, row_blocks, batched
// with a one-row expert and an empty expert tensor} x normalization {none, NorMuon} x Newton–Schulz
// method {standard, gram, auto} x strategy {ZeRO-1, ZeRO-3} x mesh {W = 3 1-D, 2x2}, the full
// product (72 runs, in-process). Each run trains two steps and must equal single-device Muon bit
// for bit (fp32 Newton–Schulz), saves a checkpoint and exports; the other mesh (the other world
// size) then loads the checkpoint, imports the export, and both continue a third step bit for bit.
// Launched (torchrun W = 4 on 2x2, mpirun W = 3 on 1-D), a corner of each factor runs the whole
// round trip at the launcher's world size.

#include <cstdint>
#include <map>
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

namespace fsdp_muon {
namespace {

using testing::Spec;
using testing::world;
using testing::world_ptr;

enum class Layout { kWhole, kRowBlocks, kBatched };
const char* name_of(Layout l) {
  return l == Layout::kWhole ? "whole" : l == Layout::kRowBlocks ? "row_blocks" : "batched";
}

struct Combo {
  Layout layout;
  bool normuon;
  NsMethod ns;
  ShardingStrategy strategy;
  bool two_by_two;  // the 2x2 mesh at W = 4, else the 1-D mesh at W = 3

  std::string name() const {
    const char* ns_name = ns == NsMethod::kStandard ? "standard"
                          : ns == NsMethod::kGram   ? "gram"
                                                    : "auto";
    return std::string(name_of(layout)) + (normuon ? "-normuon-" : "-plain-") + ns_name + "-" +
           to_string(strategy) + (two_by_two ? "-2x2" : "-w3");
  }
  int world_size() const { return two_by_two ? 4 : 3; }
};

// The full product: cheap enough in-process (see the closing note of issue 32 for its time).
std::vector<Combo> all_combos() {
  std::vector<Combo> combos;
  for (const bool two_by_two : {false, true}) {
    for (const Layout layout : {Layout::kWhole, Layout::kRowBlocks, Layout::kBatched}) {
      for (const bool normuon : {false, true}) {
        for (const NsMethod ns : {NsMethod::kStandard, NsMethod::kGram, NsMethod::kAuto}) {
          for (const ShardingStrategy strategy :
               {ShardingStrategy::kOptim, ShardingStrategy::kOptimGradsParams}) {
            combos.push_back({layout, normuon, ns, strategy, two_by_two});
          }
        }
      }
    }
  }
  return combos;
}

// The matrices of a layout, with 1-D parameters between them so that group boundaries fall in
// awkward places: rows of 1, sizes no shard size up to 4 divides, ranks holding nothing of some.
std::vector<std::vector<Spec>> specs_of(Layout layout) {
  switch (layout) {
    case Layout::kWhole:
      return {{{"a.w", {7, 5}}, {"a.bias", {7}}, {"a.row", {1, 9}}},
              {{"b.col", {9, 1}}, {"b.w", {6, 6}}}};
    case Layout::kRowBlocks:  // blocks of 3, 1 and 3 rows
      return {{{"a.qkv", {7, 5}}, {"a.bias", {7}}}, {{"b.qkv", {7, 3}}, {"b.norm", {3}}}};
    case Layout::kBatched:  // one-row experts and an expert tensor with no experts
      return {{{"e.w1", {3, 4, 6}}, {"e.bias", {5}}, {"e.row", {5, 1, 9}}},
              {{"e.none", {0, 4, 3}}, {"e.w2", {3, 6, 4}}}};
  }
  return {};
}

MatrixLayout matrix_layout_of(Layout layout) {
  switch (layout) {
    case Layout::kWhole:
      return MatrixLayout::whole();
    case Layout::kRowBlocks:
      return MatrixLayout::row_blocks({3, 1, 3});
    case Layout::kBatched:
      return MatrixLayout::batched();
  }
  return MatrixLayout::whole();
}

MuonOptions options_of(const Combo& c) {
  return MuonOptions()
      .lr(0.02)
      .weight_decay(0.01)
      .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat).method(c.ns))
      .normalization(c.normuon ? Normalization::kNorMuon : Normalization::kNone)
      .matrix_layout(matrix_layout_of(c.layout));
}

bool is_matrix(const Spec& spec) { return spec.shape.size() >= 2; }

// The sharded model on the combo's mesh of this world, and FsdpMuon over its matrices.
struct Sharded {
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::unique_ptr<FsdpMuon> muon;

  Sharded(const Combo& c, const DeviceMesh& mesh, uint64_t seed) {
    const auto specs = specs_of(c.layout);
    std::vector<std::vector<std::pair<std::string, at::Tensor>>> drawn;
    {
      testing::SeededRandom random(seed);
      for (const auto& group_specs : specs)
        drawn.push_back(testing::random_parameters(group_specs));
    }
    std::vector<at::Tensor> matrices;
    for (size_t g = 0; g < specs.size(); ++g) {
      groups.push_back(std::make_shared<FsdpParameterGroup>(std::move(drawn[g]), mesh,
                                                            FsdpParameterGroupOptions()
                                                                .broadcast_from_rank0(false)
                                                                .sharding_strategy(c.strategy)
                                                                .name("g" + std::to_string(g))));
      for (size_t i = 0; i < specs[g].size(); ++i) {
        if (is_matrix(specs[g][i])) matrices.push_back(groups[g]->sharded_parameter(i));
      }
    }
    muon = std::make_unique<FsdpMuon>(matrices, options_of(c), FsdpMuonConfig().rates(CostRates()));
  }
  std::vector<torch::optim::Optimizer*> optimizers() { return {muon.get()}; }
};

// Single-device Muon on the full tensors, every weight after each step: [step][param] in model
// order (1-D parameters never change).
std::vector<std::vector<at::Tensor>> reference_run(const Combo& c, uint64_t seed, int steps) {
  const auto specs = specs_of(c.layout);
  std::vector<at::Tensor> params;
  {
    testing::SeededRandom random(seed);
    for (const auto& group_specs : specs) {
      for (auto& [name, t] : testing::random_parameters(group_specs)) params.push_back(t.detach());
    }
  }
  std::vector<at::Tensor> matrices;
  size_t k = 0;
  for (const auto& group_specs : specs) {
    for (const Spec& spec : group_specs) {
      if (is_matrix(spec)) matrices.push_back(params[k].requires_grad_());
      ++k;
    }
  }
  Muon muon(matrices, options_of(c));
  std::vector<std::vector<at::Tensor>> after;
  for (int step = 1; step <= steps; ++step) {
    testing::SeededRandom random(1000 + step);
    for (at::Tensor& p : params) p.mutable_grad() = at::randn(p.sizes());
    muon.step();
    std::vector<at::Tensor> snapshot;
    for (const at::Tensor& p : params) snapshot.push_back(p.detach().clone());
    after.push_back(std::move(snapshot));
  }
  return after;
}

// The gradients reference_run draws for `step`, each rank's slice in its gradient shard.
void feed_gradients(Sharded& s, int step) {
  std::vector<at::Tensor> full;
  {
    testing::SeededRandom random(1000 + step);
    for (const auto& group : s.groups) {
      for (size_t i = 0; i < group->num_parameters(); ++i) {
        full.push_back(at::randn(group->slot(i).shape));
      }
    }
  }
  size_t k = 0;
  for (const auto& group : s.groups) {
    group->zero_grad();
    for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
      const auto [first, second] = group->held_range(i);
      group->sharded_parameter(i).grad().copy_(full[k].reshape({-1}).slice(0, first, second));
    }
  }
}

// Every shard equals its slice of `expected` (model order), bit for bit; so do the model weights
// (gathered under ZeRO-3, where they are not kept between steps).
void expect_weights(Sharded& s, const std::vector<at::Tensor>& expected, const std::string& what) {
  size_t k = 0;
  for (const auto& group : s.groups) {
    group->unshard();
    const auto model = group->model_parameters();
    for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
      const auto [first, second] = group->held_range(i);
      EXPECT_TRUE(
          at::equal(group->sharded_parameter(i), expected[k].reshape({-1}).slice(0, first, second)))
          << what << ": shard of " << group->slot(i).name;
      EXPECT_TRUE(at::equal(model[i].detach(), expected[k]))
          << what << ": model weight " << group->slot(i).name;
    }
    group->reshard();
  }
}

std::string root() {
  const char* dir = std::getenv("FSDP_MUON_COMBINATIONS_DIR");
  EXPECT_NE(dir, nullptr) << "FSDP_MUON_COMBINATIONS_DIR is not set";
  return dir == nullptr ? std::string("/tmp/fsdp_muon_combinations") : std::string(dir);
}

DeviceMesh mesh_for(const Combo& c) {
  return make_device_mesh(world_ptr(), c.two_by_two ? 2 : world().size());
}

// Trains two steps against the reference, saves and exports under root()/<name>.
void train_and_save(const Combo& c, const std::vector<std::vector<at::Tensor>>& reference) {
  SCOPED_TRACE(c.name() + ", W=" + std::to_string(world().size()));
  const DeviceMesh mesh = mesh_for(c);
  Sharded s(c, mesh, 7);
  for (int step = 1; step <= 2; ++step) {
    feed_gradients(s, step);
    s.muon->step();
    expect_weights(s, reference[step - 1], "step " + std::to_string(step));
  }
  const std::string dir = root() + "/" + c.name();
  save_checkpoint(dir + "/ckpt", s.groups, s.optimizers());
  export_full_checkpoint(dir + "/full.pt", s.groups, s.optimizers());
}

// Builds the combo on the mesh of this world from another seed, restores it from what
// train_and_save wrote for `saved` (load, then again by import), and checks the weights and a
// third step.
void load_and_continue(const Combo& c, const Combo& saved,
                       const std::vector<std::vector<at::Tensor>>& reference) {
  SCOPED_TRACE(saved.name() + " restored at W=" + std::to_string(world().size()));
  const DeviceMesh mesh = mesh_for(c);
  const std::string dir = root() + "/" + saved.name();
  for (const bool by_import : {false, true}) {
    SCOPED_TRACE(by_import ? "import" : "load");
    Sharded s(c, mesh, 99);
    if (by_import) {
      import_full_checkpoint(dir + "/full.pt", s.groups, s.optimizers());
    } else {
      load_checkpoint(dir + "/ckpt", s.groups, s.optimizers());
    }
    expect_weights(s, reference[1], "restored");
    feed_gradients(s, 3);
    s.muon->step();
    expect_weights(s, reference[2], "third step after the restore");
  }
}

// The combo with the other mesh: what it saved, this world loads.
Combo on_other_mesh(Combo c) {
  c.two_by_two = !c.two_by_two;
  return c;
}

TEST(FsdpMuonCombinations, FullProductTrainsSavesAndRestoresOnTheOtherMesh) {
  if (!testing::in_process()) GTEST_SKIP() << "launched: the corners test runs instead";
  checkpoint::remove_tree(root());
  const std::vector<Combo> combos = all_combos();
  std::map<std::string, std::vector<std::vector<at::Tensor>>> reference;
  for (const Combo& c : combos) reference[c.name()] = reference_run(c, 7, 3);
  // W = 3 trains its combos; W = 4 trains its own and restores W = 3's on the 2x2 mesh; W = 3
  // then restores W = 4's on its 1-D mesh.
  testing::on_world_of(3, [&] {
    for (const Combo& c : combos) {
      if (!c.two_by_two) train_and_save(c, reference.at(c.name()));
    }
  });
  testing::on_world_of(4, [&] {
    for (const Combo& c : combos) {
      if (c.two_by_two) {
        train_and_save(c, reference.at(c.name()));
      } else {
        load_and_continue(on_other_mesh(c), c, reference.at(c.name()));
      }
    }
  });
  testing::on_world_of(3, [&] {
    for (const Combo& c : combos) {
      if (c.two_by_two) load_and_continue(on_other_mesh(c), c, reference.at(c.name()));
    }
  });
}

// Launched: one corner per factor level at the launcher's world size (2x2 at W = 4, else 1-D),
// trained, saved, exported and restored in the same job.
FSDP_MUON_WORLD_TEST(FsdpMuonCombinations, CornersRoundTripUnderALauncher) {
  if (testing::in_process()) GTEST_SKIP() << "in-process: the full product runs instead";
  if (world().rank() == 0) checkpoint::remove_tree(root());
  world().barrier();
  const bool two_by_two = world().size() == 4;
  const std::vector<Combo> corners = {
      {Layout::kBatched, true, NsMethod::kGram, ShardingStrategy::kOptimGradsParams, two_by_two},
      {Layout::kRowBlocks, false, NsMethod::kAuto, ShardingStrategy::kOptim, two_by_two},
      {Layout::kWhole, true, NsMethod::kStandard, ShardingStrategy::kOptimGradsParams, two_by_two}};
  for (const Combo& c : corners) {
    const auto reference = reference_run(c, 7, 3);
    train_and_save(c, reference);
    load_and_continue(c, c, reference);
  }
}

}  // namespace
}  // namespace fsdp_muon
