#include "checkpoint/model_index.h"

#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>

#include "common/check.h"
#include "common/enum_names.h"

namespace fsdp_muon::checkpoint {

namespace {

// Part of the file format: never rename a row.
constexpr detail::EnumName<OptimizerKind> kKindNames[] = {
    {OptimizerKind::kFsdpMuon, "fsdp_muon"},
    {OptimizerKind::kAdamW, "adamw"},
    {OptimizerKind::kAdam, "adam"},
    {OptimizerKind::kSgd, "sgd"},
};
static_assert(detail::rows_in_enumerator_order(kKindNames));

}  // namespace

const char* kind_name(OptimizerKind kind) { return detail::name_of(kKindNames, kind); }

const std::vector<std::string>& state_keys(OptimizerKind kind) {
  static const std::vector<std::string> muon = {"momentum_buffer", "normuon_variance"};
  static const std::vector<std::string> momentum = {"momentum_buffer"};
  static const std::vector<std::string> adam = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  switch (kind) {
    case OptimizerKind::kFsdpMuon:
      return muon;
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      return adam;
    case OptimizerKind::kSgd:
      return momentum;
  }
  return momentum;
}

bool is_row_state(OptimizerKind kind, const std::string& key) {
  return kind == OptimizerKind::kFsdpMuon && key == "normuon_variance";
}

bool has_step(OptimizerKind kind) { return kind != OptimizerKind::kSgd; }

Communicator& communicator_of(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  FSDP_MUON_CHECK(!groups.empty() && groups[0], "no parameter groups given");
  return *groups[0]->mesh().world;
}

ModelIndex index_model(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  FSDP_MUON_CHECK(!groups.empty(), "no parameter groups given");
  ModelIndex model;
  model.groups = groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    FSDP_MUON_CHECK(groups[g] != nullptr, "parameter group ", g, " is null");
    const DeviceMesh& mesh = groups[g]->mesh();
    if (!model.comm) {
      model.comm = groups[g]->communicator();
      model.mesh = mesh;
    } else {
      // The same shape and place, not the same objects: groups built on separate communicators
      // of one world save and load together as before meshes.
      const auto where = [](const DeviceMesh& m) {
        return "rank " + std::to_string(m.world->rank()) + " of " +
               std::to_string(m.world->size()) + " (mesh " + m.shape() + ", shard rank " +
               std::to_string(m.shard->rank()) + ")";
      };
      FSDP_MUON_CHECK(where(mesh) == where(model.mesh), "parameter group ", g, " ('",
                      groups[g]->name(), "') is on ", where(mesh), " but group 0 on ",
                      where(model.mesh),
                      "; all groups must share one data-parallel world and one mesh shape");
    }
    for (size_t i = 0; i < groups[g]->num_parameters(); ++i) {
      const std::string& name = groups[g]->slot(i).name;
      auto [it, inserted] = model.by_name.emplace(name, ParamRef{g, i});
      FSDP_MUON_CHECK(inserted, "parameter name '", name, "' appears twice (group ",
                      it->second.group, " and group ", g,
                      "); checkpoints key parameters by name, so names must be unique");
      model.by_impl.emplace(groups[g]->sharded_parameter(i).unsafeGetTensorImpl(), ParamRef{g, i});
    }
  }
  return model;
}

std::vector<OptimizerEntry> index_optimizers(
    const std::vector<torch::optim::Optimizer*>& optimizers, const ModelIndex& model) {
  std::vector<OptimizerEntry> out;
  std::unordered_map<const void*, size_t> owner;
  for (size_t o = 0; o < optimizers.size(); ++o) {
    torch::optim::Optimizer* opt = optimizers[o];
    FSDP_MUON_CHECK(opt != nullptr, "optimizer ", o, " is null");
    OptimizerEntry entry;
    entry.optimizer = opt;
    if (dynamic_cast<FsdpMuon*>(opt) != nullptr) {
      entry.kind = OptimizerKind::kFsdpMuon;
    } else if (dynamic_cast<torch::optim::AdamW*>(opt) != nullptr) {
      entry.kind = OptimizerKind::kAdamW;
    } else if (dynamic_cast<torch::optim::Adam*>(opt) != nullptr) {
      entry.kind = OptimizerKind::kAdam;
    } else if (dynamic_cast<torch::optim::SGD*>(opt) != nullptr) {
      entry.kind = OptimizerKind::kSgd;
    } else if (dynamic_cast<Muon*>(opt) != nullptr) {
      FSDP_MUON_CHECK(false, "optimizer ", o,
                      " is a single-device fsdp_muon::Muon, which works on full tensors, not on "
                      "the sharded parameters of FsdpParameterGroups; use FsdpMuon");
    } else {
      FSDP_MUON_CHECK(false, "optimizer ", o,
                      " is of an unsupported type; checkpoints support fsdp_muon::FsdpMuon, "
                      "torch::optim::AdamW, torch::optim::Adam and torch::optim::SGD");
    }
    const auto& param_groups = opt->param_groups();
    for (size_t j = 0; j < param_groups.size(); ++j) {
      std::vector<ParamRef> refs;
      const auto& params = param_groups[j].params();
      for (size_t k = 0; k < params.size(); ++k) {
        const void* impl = params[k].unsafeGetTensorImpl();
        auto it = model.by_impl.find(impl);
        FSDP_MUON_CHECK(it != model.by_impl.end(), "optimizer ", o, " (", kind_name(entry.kind),
                        "), param group ", j, ", parameter ", k, " (shape ",
                        c10::str(c10::IntArrayRef(params[k].sizes())),
                        ") is not a sharded parameter of the given FsdpParameterGroups");
        auto [prev, inserted] = owner.emplace(impl, o);
        FSDP_MUON_CHECK(inserted || prev->second == o, "parameter '", model.slot(it->second).name,
                        "' is in optimizer ", prev->second, " and optimizer ", o);
        refs.push_back(it->second);
      }
      entry.param_groups.push_back(std::move(refs));
    }
    out.push_back(std::move(entry));
  }
  return out;
}

}  // namespace fsdp_muon::checkpoint
