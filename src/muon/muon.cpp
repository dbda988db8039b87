#include <fsdp_muon/muon/muon.h>

#include <sstream>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include "muon/muon_math.h"

namespace fsdp_muon {

void MuonParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(normuon_variance);  // absent when undefined
}

void MuonParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, normuon_variance);
}

bool operator==(const MuonParamState& lhs, const MuonParamState& rhs) {
  const bool lhs_has = lhs.momentum_buffer().defined();
  const bool rhs_has = rhs.momentum_buffer().defined();
  const bool lhs_v = lhs.normuon_variance().defined();
  const bool rhs_v = rhs.normuon_variance().defined();
  return lhs.step() == rhs.step() && lhs_has == rhs_has &&
         (!lhs_has || at::equal(lhs.momentum_buffer(), rhs.momentum_buffer())) && lhs_v == rhs_v &&
         (!lhs_v || at::equal(lhs.normuon_variance(), rhs.normuon_variance()));
}

namespace {

MuonOptions& muon_options_of(torch::optim::OptimizerParamGroup& group, size_t index) {
  auto* options = dynamic_cast<MuonOptions*>(&group.options());
  TORCH_CHECK(options != nullptr, "fsdp_muon::Muon: parameter group ", index,
              " has options of another optimizer; give it fsdp_muon::MuonOptions");
  return *options;
}

std::string shape_string(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

}  // namespace

Muon::Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, MuonOptions defaults)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                std::make_unique<MuonOptions>(defaults)) {
  defaults.validate();
  std::string skipped;
  for (const auto& group : param_groups) {
    add_group(group, skipped);
  }
  warn_skipped(skipped);
}

Muon::Muon(std::vector<at::Tensor> params, MuonOptions defaults)
    : Muon({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

void Muon::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  std::string skipped;
  add_group(param_group, skipped);
  warn_skipped(skipped);
}

void Muon::warn_skipped(const std::string& skipped) {
  if (!skipped.empty()) {
    TORCH_WARN(
        "fsdp_muon::Muon: skip_non_matrix is set, so these non-2-D parameters are never updated "
        "by ",
        "Muon (give them to torch::optim::AdamW): ", skipped);
  }
}

void Muon::add_group(const torch::optim::OptimizerParamGroup& param_group, std::string& skipped) {
  const size_t index = param_groups_.size();
  for (size_t i = 0; i < param_group.params().size(); ++i) {
    const at::Tensor& p = param_group.params()[i];
    TORCH_CHECK(p.defined(), "fsdp_muon::Muon: parameter ", i, " of group ", index,
                " is an undefined tensor");
    for (size_t other = 0; other < param_groups_.size(); ++other) {
      for (const at::Tensor& q : param_groups_[other].params()) {
        TORCH_CHECK(!q.is_same(p), "fsdp_muon::Muon: parameter ", i, " of group ", index,
                    " is already in group ", other, "; give each parameter to one group only");
      }
    }
  }
  Optimizer::add_param_group(param_group);
  // Whatever the base class did with the options (LibTorch versions differ: some replace the
  // options of optimizer types they do not know with the defaults), the group gets its own.
  if (param_group.has_options()) {
    param_groups_.back().set_options(param_group.options().clone());
  }
  try {
    check_group(index, skipped);
  } catch (...) {
    param_groups_.pop_back();  // a failed call leaves the optimizer as it was
    throw;
  }
}

void Muon::check_group(size_t index, std::string& skipped) {
  auto& group = param_groups_[index];
  const MuonOptions& options = muon_options_of(group, index);
  options.validate();
  std::ostringstream non_matrix;
  int64_t count = 0;
  for (size_t i = 0; i < group.params().size(); ++i) {
    const at::Tensor& p = group.params()[i];
    TORCH_CHECK(!p.is_complex(), "fsdp_muon::Muon: parameter ", i, " of group ", index,
                " is complex; Muon supports real matrices only");
    if (p.dim() != 2) {
      non_matrix << (count++ ? ", " : "") << "group " << index << " parameter " << i << " shape "
                 << shape_string(p);
    }
  }
  if (count == 0) {
    return;
  }
  TORCH_CHECK(options.skip_non_matrix(),
              "fsdp_muon::Muon: only 2-D parameters can be orthogonalized, but ", count,
              " are not: ", non_matrix.str(),
              ". Give biases, norms and embeddings to torch::optim::AdamW, or set "
              "MuonOptions().skip_non_matrix(true) to leave them untouched");
  skipped += (skipped.empty() ? "" : ", ") + non_matrix.str();
}

at::Tensor Muon::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // Every check first, so a bad gradient leaves all parameters and state untouched.
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    muon_options_of(group, gi).validate();  // options may have been edited since construction
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      const at::Tensor& g = p.grad();
      if (!g.defined() || p.dim() != 2) {
        continue;
      }
      TORCH_CHECK(!g.is_sparse(), "fsdp_muon::Muon: parameter ", i, " of group ", gi,
                  " has a sparse gradient; Muon needs dense gradients (use a dense embedding or "
                  "give it to another optimizer)");
      TORCH_CHECK(!g.is_complex(), "fsdp_muon::Muon: parameter ", i, " of group ", gi,
                  " has a complex gradient; Muon supports real matrices only");
      TORCH_CHECK(g.sizes() == p.sizes(), "fsdp_muon::Muon: parameter ", i, " of group ", gi,
                  " has shape ", p.sizes(), " but its gradient has shape ", g.sizes());
    }
  }
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const MuonOptions& options = muon_options_of(group, gi);
    for (const at::Tensor& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined() || p.dim() != 2) {  // non-2-D only reach here with skip_non_matrix
        continue;
      }
      MuonParamState& state = detail::advance_muon_state(state_, p);
      at::Tensor buffer = state.momentum_buffer();
      const at::Tensor u = detail::muon_momentum_input(p, g, buffer, options);
      at::Tensor variance = detail::muon_normuon_variance(state, p, options);
      const at::Tensor update = detail::muon_orthogonalized_update(u, options, variance);
      detail::muon_apply_update(p, update, options);
    }
  }
  return loss;
}

void Muon::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

void Muon::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

}  // namespace fsdp_muon
