#include "checkpoint/model_index.h"

#include <algorithm>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>

namespace fsdp_muon::checkpoint {
namespace {

at::Tensor like(const at::Tensor& param, const at::Tensor& src) {
  at::Tensor t = at::empty_like(param, at::MemoryFormat::Contiguous);
  t.copy_(src.reshape(param.sizes()));
  return t;
}

const at::Tensor* find_tensor(const ParamState& state, const char* key) {
  for (const auto& [k, t] : state.tensors) {
    if (k == key) return &t;
  }
  return nullptr;
}

template <typename AdamState>
std::unique_ptr<torch::optim::OptimizerParamState> adam_state(const at::Tensor& param,
                                                              const ParamState& state) {
  auto s = std::make_unique<AdamState>();
  s->step(state.step);
  if (const at::Tensor* t = find_tensor(state, "exp_avg")) s->exp_avg(like(param, *t));
  if (const at::Tensor* t = find_tensor(state, "exp_avg_sq")) s->exp_avg_sq(like(param, *t));
  if (const at::Tensor* t = find_tensor(state, "max_exp_avg_sq")) {
    s->max_exp_avg_sq(like(param, *t));
  }
  return s;
}

template <typename AdamState>
void read_adam(const AdamState& s, ParamState& out) {
  out.step = s.step();
  if (s.exp_avg().defined()) out.tensors.emplace_back("exp_avg", s.exp_avg());
  if (s.exp_avg_sq().defined()) out.tensors.emplace_back("exp_avg_sq", s.exp_avg_sq());
  if (s.max_exp_avg_sq().defined()) out.tensors.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
}

}  // namespace

const char* kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kFsdpMuon:
      return "fsdp_muon";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kSgd:
      return "sgd";
  }
  return "?";
}

const std::vector<std::string>& state_keys(OptimizerKind kind) {
  static const std::vector<std::string> momentum = {"momentum_buffer"};
  static const std::vector<std::string> adam = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return (kind == OptimizerKind::kAdamW || kind == OptimizerKind::kAdam) ? adam : momentum;
}

bool has_step(OptimizerKind kind) { return kind != OptimizerKind::kSgd; }

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

ModelIndex index_model(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                       const char* fn) {
  TORCH_CHECK(!groups.empty(), fn, ": no parameter groups given");
  ModelIndex model;
  model.groups = groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(groups[g] != nullptr, fn, ": parameter group ", g, " is null");
    const auto& comm = groups[g]->communicator();
    if (!model.comm) {
      model.comm = comm;
    } else {
      TORCH_CHECK(comm->size() == model.comm->size() && comm->rank() == model.comm->rank(), fn,
                  ": parameter group ", g, " ('", groups[g]->name(), "') is on rank ", comm->rank(),
                  " of ", comm->size(), " but group 0 on rank ", model.comm->rank(), " of ",
                  model.comm->size(), "; all groups must share one data-parallel world");
    }
    for (size_t i = 0; i < groups[g]->num_parameters(); ++i) {
      const std::string& name = groups[g]->slot(i).name;
      auto [it, inserted] = model.by_name.emplace(name, ParamRef{g, i});
      TORCH_CHECK(inserted, fn, ": parameter name '", name, "' appears twice (group ",
                  it->second.group, " and group ", g,
                  "); checkpoints key parameters by name, so names must be unique");
      model.by_impl.emplace(groups[g]->sharded_parameter(i).unsafeGetTensorImpl(), ParamRef{g, i});
    }
  }
  return model;
}

std::vector<OptimizerEntry> index_optimizers(
    const std::vector<torch::optim::Optimizer*>& optimizers, const ModelIndex& model,
    const char* fn) {
  std::vector<OptimizerEntry> out;
  std::unordered_map<const void*, size_t> owner;
  for (size_t o = 0; o < optimizers.size(); ++o) {
    torch::optim::Optimizer* opt = optimizers[o];
    TORCH_CHECK(opt != nullptr, fn, ": optimizer ", o, " is null");
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
      TORCH_CHECK(false, fn, ": optimizer ", o,
                  " is a single-device fsdp_muon::Muon, which works on full tensors, not on "
                  "the sharded parameters of FsdpParameterGroups; use FsdpMuon");
    } else {
      TORCH_CHECK(false, fn, ": optimizer ", o,
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
        TORCH_CHECK(it != model.by_impl.end(), fn, ": optimizer ", o, " (", kind_name(entry.kind),
                    "), param group ", j, ", parameter ", k, " (shape ",
                    shape_string(params[k].sizes()),
                    ") is not a sharded parameter of the given FsdpParameterGroups");
        auto [prev, inserted] = owner.emplace(impl, o);
        TORCH_CHECK(inserted || prev->second == o, fn, ": parameter '", model.slot(it->second).name,
                    "' is in optimizer ", prev->second, " and optimizer ", o);
        refs.push_back(it->second);
      }
      entry.param_groups.push_back(std::move(refs));
    }
    out.push_back(std::move(entry));
  }
  return out;
}

ParamState read_state(const OptimizerEntry& opt, const at::Tensor& param) {
  ParamState out;
  auto& states = opt.optimizer->state();
  auto it = states.find(param.unsafeGetTensorImpl());
  if (it == states.end() || !it->second) return out;
  out.present = true;
  switch (opt.kind) {
    case OptimizerKind::kFsdpMuon: {
      const auto& s = static_cast<const MuonParamState&>(*it->second);
      out.step = s.step();
      if (s.momentum_buffer().defined())
        out.tensors.emplace_back("momentum_buffer", s.momentum_buffer());
      break;
    }
    case OptimizerKind::kAdamW:
      read_adam(static_cast<const torch::optim::AdamWParamState&>(*it->second), out);
      break;
    case OptimizerKind::kAdam:
      read_adam(static_cast<const torch::optim::AdamParamState&>(*it->second), out);
      break;
    case OptimizerKind::kSgd: {
      const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
      if (s.momentum_buffer().defined())
        out.tensors.emplace_back("momentum_buffer", s.momentum_buffer());
      break;
    }
  }
  return out;
}

void install_state(const OptimizerEntry& opt, const at::Tensor& param, const ParamState& state) {
  auto& states = opt.optimizer->state();
  void* key = param.unsafeGetTensorImpl();
  if (!state.present) {
    states.erase(key);
    return;
  }
  std::unique_ptr<torch::optim::OptimizerParamState> fresh;
  switch (opt.kind) {
    case OptimizerKind::kFsdpMuon: {
      auto s = std::make_unique<MuonParamState>();
      s->step(state.step);
      if (const at::Tensor* t = find_tensor(state, "momentum_buffer")) {
        s->momentum_buffer(like(param, *t));
      }
      fresh = std::move(s);
      break;
    }
    case OptimizerKind::kAdamW:
      fresh = adam_state<torch::optim::AdamWParamState>(param, state);
      break;
    case OptimizerKind::kAdam:
      fresh = adam_state<torch::optim::AdamParamState>(param, state);
      break;
    case OptimizerKind::kSgd: {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      if (const at::Tensor* t = find_tensor(state, "momentum_buffer")) {
        s->momentum_buffer(like(param, *t));
      }
      fresh = std::move(s);
      break;
    }
  }
  states[key] = std::move(fresh);
}

std::vector<char> options_to_bytes(const torch::optim::OptimizerOptions& options) {
  torch::serialize::OutputArchive archive;
  options.serialize(archive);
  std::vector<char> bytes;
  archive.save_to([&bytes](const void* data, size_t size) -> size_t {
    const char* p = static_cast<const char*>(data);
    bytes.insert(bytes.end(), p, p + size);
    return size;
  });
  return bytes;
}

void options_from_bytes(torch::optim::OptimizerOptions& options, const std::vector<char>& bytes) {
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  options.serialize(archive);
}

void install_weights(const ModelIndex& model, const std::vector<std::vector<at::Tensor>>& weights) {
  {
    at::NoGradGuard no_grad;
    for (size_t g = 0; g < model.groups.size(); ++g) {
      for (size_t i = 0; i < model.groups[g]->num_parameters(); ++i) {
        const at::Tensor& shard = model.groups[g]->sharded_parameter(i);
        if (shard.numel() > 0) shard.copy_(weights[g][i]);
      }
    }
  }
  for (const auto& group : model.groups) group->refresh_model_weights();
}

}  // namespace fsdp_muon::checkpoint
