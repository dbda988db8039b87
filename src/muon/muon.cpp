#include <fsdp_muon/muon/muon.h>

#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include "common/check.h"
#include "muon/muon_math.h"
#include "newton_schulz/newton_schulz_internal.h"

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
  FSDP_MUON_CHECK(options != nullptr, "parameter group ", index,
                  " has options of another optimizer; give it fsdp_muon::MuonOptions");
  return *options;
}

// Whether Muon orthogonalizes `p` under its group's layout: a whole() parameter only when it is
// 2-D (the others are skipped under skip_non_matrix or refused); the other layouts always (a
// parameter their shape does not fit is an error).
bool is_orthogonalized(const at::Tensor& p, const MuonOptions& options) {
  return options.matrix_layout().kind() != MatrixLayout::Kind::kWhole || p.dim() == 2;
}

std::string parameter_label(size_t index, size_t group) {
  return std::to_string(index) + " of group " + std::to_string(group);
}

// The update of a parameter of several matrices (docs/DESIGN.md §4, "Layouts"): each block of
// U is orthogonalized and scaled on its own, in fresh storage as a separate parameter's U would
// be, and NorMuon normalizes the block's rows of the parameter's per-row state. Same-shape
// blocks go through one batched call only where the batched kernel gives every matrix the 2-D
// call's bits, so the result equals Muon on the blocks as separate parameters.
at::Tensor blockwise_update(const at::Tensor& u, const std::vector<MatrixBlock>& blocks,
                            const MuonOptions& options, const at::Tensor& variance) {
  // Bounds a batch's stacked copy and its Newton–Schulz workspace, as FsdpMuon's batches.
  constexpr int64_t kMaxBatchElements = int64_t{1} << 25;
  const at::Tensor flat = u.reshape({-1});
  at::Tensor update = at::zeros_like(flat);
  const bool may_batch =
      detail::batched_newton_schulz_is_bitwise(u.device(), options.newton_schulz().compute_dtype());
  std::vector<std::vector<const MatrixBlock*>> batches;
  std::map<std::pair<int64_t, int64_t>, size_t> open_batch;  // shape -> batch still filling
  for (const MatrixBlock& block : blocks) {
    if (block.numel() == 0) continue;
    const std::pair<int64_t, int64_t> shape{block.rows, block.cols};
    auto open = may_batch ? open_batch.find(shape) : open_batch.end();
    if (open != open_batch.end() &&
        static_cast<int64_t>(batches[open->second].size() + 1) * block.numel() <=
            kMaxBatchElements) {
      batches[open->second].push_back(&block);
      continue;
    }
    if (may_batch) open_batch[shape] = batches.size();
    batches.push_back({&block});
  }
  const auto matrix_of = [&](const MatrixBlock& b) {
    return flat.narrow(0, b.offset, b.numel()).view({b.rows, b.cols});
  };
  const auto rows_of = [&](const MatrixBlock& b) {
    return variance.narrow(0, b.offset / b.cols, b.rows);
  };
  for (const auto& batch : batches) {
    if (batch.size() == 1) {
      const MatrixBlock& b = *batch.front();
      const at::Tensor v = variance.defined() ? rows_of(b) : at::Tensor();
      const at::Tensor result =
          detail::muon_orthogonalized_update(matrix_of(b).clone(), options, v);
      update.narrow(0, b.offset, b.numel()).copy_(result.reshape({-1}));
      continue;
    }
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> rows;
    for (const MatrixBlock* b : batch) {
      inputs.push_back(matrix_of(*b));
      if (variance.defined()) rows.push_back(rows_of(*b));
    }
    const at::Tensor v = variance.defined() ? at::stack(rows) : at::Tensor();
    const at::Tensor result = detail::muon_orthogonalized_update(at::stack(inputs), options, v);
    for (size_t i = 0; i < batch.size(); ++i) {
      const auto k = static_cast<int64_t>(i);
      update.narrow(0, batch[i]->offset, batch[i]->numel()).copy_(result[k].reshape({-1}));
      if (variance.defined()) rows[i].copy_(v[k]);
    }
  }
  return update.view(u.sizes());
}

}  // namespace

Muon::Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, MuonOptions defaults)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                std::make_unique<MuonOptions>(defaults)) {
  FSDP_MUON_API_SCOPE("Muon");
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
  FSDP_MUON_API_SCOPE("Muon");
  std::string skipped;
  add_group(param_group, skipped);
  warn_skipped(skipped);
}

void Muon::warn_skipped(const std::string& skipped) {
  if (!skipped.empty()) {
    FSDP_MUON_WARN(
        "skip_non_matrix is set, so these non-2-D parameters are never updated "
        "by ",
        "Muon (give them to torch::optim::AdamW): ", skipped);
  }
}

void Muon::add_group(const torch::optim::OptimizerParamGroup& param_group, std::string& skipped) {
  const size_t index = param_groups_.size();
  for (size_t i = 0; i < param_group.params().size(); ++i) {
    const at::Tensor& p = param_group.params()[i];
    FSDP_MUON_CHECK(p.defined(), "parameter ", i, " of group ", index, " is an undefined tensor");
    for (size_t other = 0; other < param_groups_.size(); ++other) {
      for (const at::Tensor& q : param_groups_[other].params()) {
        FSDP_MUON_CHECK(!q.is_same(p), "parameter ", i, " of group ", index,
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
    FSDP_MUON_CHECK(!p.is_complex(), "parameter ", i, " of group ", index,
                    " is complex; Muon supports real matrices only");
    if (!is_orthogonalized(p, options)) {
      non_matrix << (count++ ? ", " : "") << "group " << index << " parameter " << i << " shape "
                 << c10::str(p.sizes())
                 << (p.dim() == 3 ? " (3-D: MatrixLayout::batched() reads it as E matrices)" : "");
      continue;
    }
    (void)options.matrix_layout().blocks(p.sizes(), parameter_label(i, index));
  }
  if (count == 0) {
    return;
  }
  FSDP_MUON_CHECK(options.skip_non_matrix(), "only 2-D parameters can be orthogonalized, but ",
                  count, " are not: ", non_matrix.str(),
                  ". Give biases, norms and embeddings to torch::optim::AdamW, or set "
                  "MuonOptions().skip_non_matrix(true) to leave them untouched");
  skipped += (skipped.empty() ? "" : ", ") + non_matrix.str();
}

at::Tensor Muon::step(LossClosure closure) {
  FSDP_MUON_API_SCOPE("Muon");
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // Every check first, so a bad gradient leaves all parameters and state untouched.
  // [group][parameter] the matrices of each parameter that steps (empty for the others).
  std::vector<std::vector<std::vector<MatrixBlock>>> blocks(param_groups_.size());
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const MuonOptions& options = muon_options_of(group, gi);
    options.validate();  // options may have been edited since construction
    blocks[gi].resize(group.params().size());
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      const at::Tensor& g = p.grad();
      if (!g.defined() || !is_orthogonalized(p, options)) {
        continue;
      }
      blocks[gi][i] = options.matrix_layout().blocks(p.sizes(), parameter_label(i, gi));
      FSDP_MUON_CHECK(
          !g.is_sparse(), "parameter ", i, " of group ", gi,
          " has a sparse gradient; Muon needs dense gradients (use a dense embedding or "
          "give it to another optimizer)");
      FSDP_MUON_CHECK(!g.is_complex(), "parameter ", i, " of group ", gi,
                      " has a complex gradient; Muon supports real matrices only");
      FSDP_MUON_CHECK(g.sizes() == p.sizes(), "parameter ", i, " of group ", gi, " has shape ",
                      p.sizes(), " but its gradient has shape ", g.sizes());
    }
  }
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const MuonOptions& options = muon_options_of(group, gi);
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      const at::Tensor& g = p.grad();
      if (blocks[gi][i].empty()) {  // no gradient, or not a matrix under skip_non_matrix
        continue;
      }
      MuonParamState& state = detail::advance_muon_state(state_, p);
      at::Tensor buffer = state.momentum_buffer();
      const at::Tensor u = detail::muon_momentum_input(p, g, buffer, options);
      at::Tensor variance = detail::muon_row_state(state, p, options);
      const at::Tensor update = options.matrix_layout().kind() == MatrixLayout::Kind::kWhole
                                    ? detail::muon_orthogonalized_update(u, options, variance)
                                    : blockwise_update(u, blocks[gi][i], options, variance);
      detail::muon_apply_update(p, update, options);
    }
  }
  return loss;
}

void Muon::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

void Muon::load(torch::serialize::InputArchive& archive) {
  FSDP_MUON_API_SCOPE("Muon");
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

}  // namespace fsdp_muon
