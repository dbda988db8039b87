#include "checkpoint/optimizer_state.h"

#include <memory>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fsdp_muon/muon/muon.h>

#include "muon/update_rule.h"

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
      if (s.normuon_variance().defined())
        out.tensors.emplace_back("normuon_variance", s.normuon_variance());
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
      if (const at::Tensor* t = find_tensor(state, "normuon_variance")) {
        // This rank's rows of it (row state), in the parameter's dtype as FsdpMuon creates it.
        at::Tensor rows = at::empty({t->numel()}, param.options());
        rows.copy_(t->reshape({-1}));
        s->normuon_variance(rows);
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

std::vector<std::string> required_state_keys(OptimizerKind kind,
                                             const torch::optim::OptimizerOptions& options) {
  switch (kind) {
    case OptimizerKind::kFsdpMuon: {
      const auto& o = static_cast<const MuonOptions&>(options);
      if (detail::update_rule(o).per_row_state) {
        return {"momentum_buffer", "normuon_variance"};
      }
      return {"momentum_buffer"};
    }
    case OptimizerKind::kAdamW: {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(options);
      if (o.amsgrad()) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
      return {"exp_avg", "exp_avg_sq"};
    }
    case OptimizerKind::kAdam: {
      const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
      if (o.amsgrad()) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
      return {"exp_avg", "exp_avg_sq"};
    }
    case OptimizerKind::kSgd:
      return {"momentum_buffer"};
  }
  return {};
}

}  // namespace fsdp_muon::checkpoint
