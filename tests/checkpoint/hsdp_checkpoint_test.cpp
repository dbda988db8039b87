// Checkpoints across meshes (HSDP), in $FSDP_MUON_HSDP_CHECKPOINT_DIR, as a chain of four runs
// (in-process: one test runs them in turn; launched: CTest chains four jobs through fixtures):
//   W = 4 saves on 2x2 and 4x1             (FSDP_MUON_HSDP_SAVE=2,1: the shard sizes)
//   W = 3 loads those on 1x3 and 3x1, saves on 1x3 (FSDP_MUON_HSDP_LOAD=2x2,4x1)
//   W = 6 loads those on 3x2, 2x3, 6x1 and 1x6, saves on 3x2
//   W = 4 loads the 1x3 and 3x2 saves on 2x2, 4x1 and 1x4 (the reverse)
// Every run also loads what it saved on every mesh of its own world. A save writes one copy
// (the rank files of the shard ranks, as a 1-D save at W = shard size would), with its full
// export beside it as the reference; a load on any mesh must export bitwise that reference (the
// groups' weights and the optimizers' state), give every replica the same bits (a hash all-gathered
// over the world), and keep them the same through another step. The state is FsdpMuon's (momentum,
// NorMuon's per-row state; saved under ReplicaNewtonSchulz::kOncePerWorld, loaded under the
// relay) and AdamW's. Groups on two meshes are an error on every rank.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <fsdp_muon/checkpoint/checkpoint.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "checkpoint/file_io.h"
#include "common/distributed_main.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using checkpoint::join_path;
using checkpoint::list_directory;
using testing::world;
using testing::world_ptr;

// A row of 1 and sizes no shard size divides: some shard ranks hold nothing of some parameters.
const std::vector<int64_t> kDims = {5, 13, 1, 7};

struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (size_t i = 0; i + 1 < kDims.size(); ++i) {
      layers.push_back(
          register_module("l" + std::to_string(i), torch::nn::Linear(kDims[i], kDims[i + 1])));
    }
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Net);

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// "2x2,4x1" -> {"2x2", "4x1"}.
std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string w; std::getline(in, w, ',');) {
    if (!w.empty()) out.push_back(w);
  }
  return out;
}

// A model on `mesh`, initialized from `seed`: FsdpMuon with NorMuon (momentum and per-row state)
// on the weight matrices, under `mode`, AdamW (two moments and a step) on the biases.
struct Model {
  Model(const DeviceMesh& mesh, uint64_t seed,
        ReplicaNewtonSchulz mode = ReplicaNewtonSchulz::kOncePerWorld) {
    {
      testing::SeededRandom random(seed);
      net = Net();
    }
    groups = shard_module(*net, mesh);
    std::vector<at::Tensor> matrices, rest;
    for (const auto& g : groups) {
      for (const at::Tensor& p : g->sharded_parameters()) params.push_back(p);
      for (size_t i = 0; i < g->num_parameters(); ++i) {
        (g->slot(i).shape.size() == 2 ? matrices : rest).push_back(g->sharded_parameter(i));
      }
    }
    muon = std::make_unique<FsdpMuon>(
        matrices,
        MuonOptions(0.02)
            .weight_decay(0.01)
            .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
            .normalization(Normalization::kNorMuon),
        FsdpMuonConfig().planner(OwnerPlanOptions().replica_newton_schulz(mode)));
    adamw = std::make_unique<torch::optim::AdamW>(
        rest, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  }

  // One step on world rank r's batch for `step`.
  void step(int step) {
    for (const auto& g : groups) g->zero_grad();
    at::Tensor h;
    {
      testing::SeededRandom random(300 + 17 * step + world().rank());
      h = at::randn({4, kDims.front()});
    }
    for (auto& layer : net->layers) h = at::tanh(layer->forward(h));
    h.pow(2).mean().backward();
    for (const auto& g : groups) g->reduce_scatter_grads();
    adamw->step();
    muon->step();  // refreshes the model weights of every group
  }

  std::vector<torch::optim::Optimizer*> optimizers() { return {muon.get(), adamw.get()}; }

  // Every tensor this rank holds: main-weight shards and the optimizers' state.
  std::vector<at::Tensor> held() const {
    std::vector<at::Tensor> out;
    const auto add = [&](const at::Tensor& t) {
      if (t.defined()) out.push_back(t.detach());
    };
    for (const at::Tensor& p : params) {
      add(p);
      if (auto it = adamw->state().find(p.unsafeGetTensorImpl()); it != adamw->state().end()) {
        const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        add(s.exp_avg());
        add(s.exp_avg_sq());
        add(at::scalar_tensor(s.step()));
      }
      if (auto it = muon->state().find(p.unsafeGetTensorImpl()); it != muon->state().end()) {
        const auto& s = static_cast<const MuonParamState&>(*it->second);
        add(s.momentum_buffer());
        add(s.normuon_variance());
        add(at::scalar_tensor(s.step()));
      }
    }
    return out;
  }

  Net net{nullptr};
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<at::Tensor> params;
  std::unique_ptr<FsdpMuon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
};

std::vector<DeviceMesh> every_mesh() {
  std::vector<DeviceMesh> meshes;
  const int w = world().size();
  for (int shard_size = w; shard_size >= 1; --shard_size) {
    if (w % shard_size == 0) meshes.push_back(make_device_mesh(world_ptr(), shard_size));
  }
  return meshes;
}

int64_t bits_hash(const std::vector<at::Tensor>& tensors) {
  uint64_t h = 1469598103934665603ull;
  for (const at::Tensor& t : tensors) {
    const at::Tensor c = t.detach().contiguous().cpu();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  }
  int64_t out;
  std::memcpy(&out, &h, sizeof(out));
  return out;
}

void expect_replicas_identical(const DeviceMesh& mesh, const Model& model,
                               const std::string& what) {
  at::Tensor all = at::empty({world().size()}, at::kLong);
  world().all_gather(at::full({1}, bits_hash(model.held()), at::kLong), all);
  const int64_t* h = all.data_ptr<int64_t>();
  for (int r = 0; r < world().size(); ++r) {
    EXPECT_EQ(h[r], h[mesh.world_rank(0, r % mesh.shard_size())])
        << what << ": world rank " << r << " differs from its shard rank in replica 0 (mesh "
        << mesh.shape() << ")";
  }
}

c10::Dict<c10::IValue, c10::IValue> read_export(const std::string& path) {
  const std::vector<char> bytes = checkpoint::read_whole_file(path);
  return torch::pickle_load(bytes).toGenericDict();
}

// Both exports hold the same names with bitwise the same tensors.
void expect_same_export(const std::string& got_path, const std::string& want_path,
                        const std::string& what) {
  const auto got = read_export(got_path);
  const auto want = read_export(want_path);
  EXPECT_EQ(got.size(), want.size()) << what;
  for (const auto& item : want) {
    const std::string name = item.key().toStringRef();
    ASSERT_TRUE(got.contains(name)) << what << ": '" << name << "' missing";
    const at::Tensor a = got.at(name).toTensor();
    const at::Tensor b = item.value().toTensor();
    EXPECT_TRUE(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && at::equal(a, b))
        << what << ": '" << name << "' differs";
  }
}

std::string root() {
  const std::string dir = env("FSDP_MUON_HSDP_CHECKPOINT_DIR");
  EXPECT_FALSE(dir.empty()) << "set FSDP_MUON_HSDP_CHECKPOINT_DIR";
  return dir;
}

// Loads the checkpoint saved on `saved` ("2x2") into a model initialized otherwise on every mesh
// of this world: the same bits as the saver's export, on every replica, and still after a step.
void load_everywhere(const std::string& saved) {
  const std::string folder = join_path(root(), saved);
  const std::string reference = join_path(root(), saved + "-full.pt");
  ASSERT_TRUE(checkpoint::path_exists(reference)) << reference;
  for (const DeviceMesh& mesh : every_mesh()) {
    const std::string what = "saved on " + saved + ", loaded on " + mesh.shape();
    SCOPED_TRACE(what);
    // Saved under the direct scatter, loaded under the relay (the state does not depend on it).
    Model model(mesh, /*seed=*/77, ReplicaNewtonSchulz::kOncePerWorldRelay);
    model.step(0);  // state to be replaced
    load_checkpoint(folder, model.groups, model.optimizers());
    const std::string exported =
        join_path(root(), "loaded-" + saved + "-on-" + mesh.shape() + ".pt");
    export_full_checkpoint(exported, model.groups, model.optimizers());
    expect_same_export(exported, reference, what);
    expect_replicas_identical(mesh, model, what);
    model.step(5);
    expect_replicas_identical(mesh, model, what + ", then a step");
    world().barrier();  // every rank has read the export before the next mesh writes its own
  }
}

// One link of the chain: loads the saves named in `load` ("2x2,4x1") on every mesh of this world,
// then saves on each shard size in `save` ("2,1") and loads that back everywhere.
void load_then_save(const std::string& load, const std::string& save) {
  for (const std::string& shape : words(load)) load_everywhere(shape);
  for (const std::string& shard : words(save)) {
    const DeviceMesh mesh = make_device_mesh(world_ptr(), std::stoi(shard));
    Model model(mesh, /*seed=*/11);
    model.step(0);
    model.step(1);
    const std::string folder =
        save_checkpoint(join_path(root(), mesh.shape()), model.groups, model.optimizers());
    export_full_checkpoint(join_path(root(), mesh.shape() + "-full.pt"), model.groups,
                           model.optimizers());
    // One copy: the shard ranks' files, as a 1-D save over shard_size ranks writes them.
    std::vector<std::string> files;
    for (const std::string& name : list_directory(folder)) {
      if (name.rfind("rank-", 0) == 0) files.push_back(name);
    }
    std::sort(files.begin(), files.end());
    std::vector<std::string> expected;
    for (int s = 0; s < mesh.shard_size(); ++s) {
      char name[64];
      std::snprintf(name, sizeof(name), "rank-%05d-of-%05d.bin", s, mesh.shard_size());
      expected.push_back(name);
    }
    EXPECT_EQ(files, expected) << "saved on " << mesh.shape();
    world().barrier();
    load_everywhere(mesh.shape());
  }
}

// A launched job is one link, named by FSDP_MUON_HSDP_LOAD and FSDP_MUON_HSDP_SAVE (CTest chains
// the jobs through fixtures); in-process, the next test runs the whole chain.
TEST(HsdpCheckpoint, SavesOneCopyAndLoadsOnEveryMesh) {
  if (testing::in_process()) GTEST_SKIP() << "in-process: HsdpCheckpoint.ChainAcrossWorlds";
  load_then_save(env("FSDP_MUON_HSDP_LOAD"), env("FSDP_MUON_HSDP_SAVE"));
}

TEST(HsdpCheckpoint, ChainAcrossWorlds) {
  if (!testing::in_process()) GTEST_SKIP() << "launched: one link per job";
  testing::on_world_of(4, [] { load_then_save("", "2,1"); });
  testing::on_world_of(3, [] { load_then_save("2x2,4x1", "3"); });
  testing::on_world_of(6, [] { load_then_save("2x2,4x1", "2"); });
  testing::on_world_of(4, [] { load_then_save("1x3,3x2", ""); });
}

FSDP_MUON_WORLD_TEST(HsdpCheckpoint, GroupsOnTwoMeshesAreAnErrorOnEveryRank) {
  const int w = world().size();
  if (w == 1) GTEST_SKIP() << "a mesh of several replicas needs two ranks";
  const DeviceMesh flat = make_device_mesh(world_ptr(), w);
  const DeviceMesh replicated = make_device_mesh(world_ptr(), 1);
  Model a(flat, 11);
  Model b(replicated, 11);
  const std::vector<std::shared_ptr<FsdpParameterGroup>> mixed{a.groups[0], b.groups[1]};
  const std::string dir = join_path(root(), "mixed-" + std::to_string(w));
  testing::expect_error([&] { save_checkpoint(dir, mixed, {}); },
                        {"fsdp_muon::save_checkpoint", "parameter group 1 ('l1') is on rank",
                         "(mesh " + replicated.shape(), "(mesh " + flat.shape(),
                         "all groups must share one data-parallel world and one mesh shape"});
}

}  // namespace
}  // namespace fsdp_muon
