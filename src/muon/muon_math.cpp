#include "muon/muon_math.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <fsdp_muon/newton_schulz/newton_schulz.h>

#include "common/check.h"
#include "muon/update_rule.h"

// Only mul / add / sub (alpha = 1) / div below: see the bitwise contract in muon_math.h.

namespace fsdp_muon::detail {

namespace {

// The (1 - c) factor muon_momentum_input applies to the parameter for decoupled, independent and
// PaLM weight decay (not for kL2, which adds to the gradient instead).
double decay_factor(const MuonOptions& options) {
  const double lr = options.lr();
  const double wd = options.weight_decay();
  switch (options.weight_decay_method()) {
    case WeightDecayMethod::kDecoupled:
      return 1.0 - lr * wd;
    case WeightDecayMethod::kIndependent:
      return 1.0 - wd;
    case WeightDecayMethod::kPalm:
      return 1.0 - lr * lr * wd;
    case WeightDecayMethod::kL2:
      return 1.0;
  }
  FSDP_MUON_CHECK(false, "weight_decay_method has an unknown value ",
                  static_cast<int>(options.weight_decay_method()));
}

}  // namespace

at::Tensor muon_momentum_input(const at::Tensor& param, const at::Tensor& grad,
                               at::Tensor& momentum_buffer, const MuonOptions& options) {
  FSDP_MUON_CHECK(momentum_buffer.defined(), "the momentum buffer must be created by the caller");
  FSDP_MUON_CHECK(param.sizes() == grad.sizes() && param.sizes() == momentum_buffer.sizes(),
                  "parameter ", param.sizes(), ", gradient ", grad.sizes(), " and momentum buffer ",
                  momentum_buffer.sizes(), " must have one shape");
  const double wd = options.weight_decay();
  const double mu = options.momentum();

  at::Tensor g = grad;
  if (wd != 0.0) {
    // The (1 - c) factors are formed in double and applied with one mul, one rounding per
    // element; for kDecoupled this is torch.optim.Muon's param.mul_(1 - lr * wd).
    if (options.weight_decay_method() == WeightDecayMethod::kL2) {
      g = grad.add(param.mul(wd));  // a new tensor: the user's .grad stays as it was
    } else {
      param.mul_(decay_factor(options));
    }
  }

  const at::Tensor g_scaled = g.mul(1.0 - mu);
  momentum_buffer.mul_(mu);
  momentum_buffer.add_(g_scaled);
  if (options.nesterov()) {
    return g_scaled.add(momentum_buffer.mul(mu));
  }
  return momentum_buffer.clone();
}

std::vector<at::Tensor> muon_momentum_inputs(at::TensorList params, at::TensorList grads,
                                             at::TensorList momentum_buffers,
                                             const MuonOptions& options) {
  FSDP_MUON_CHECK(params.size() == grads.size() && params.size() == momentum_buffers.size(),
                  params.size(), " parameters, ", grads.size(), " gradients and ",
                  momentum_buffers.size(), " momentum buffers");
  if (params.empty()) return {};
  const double wd = options.weight_decay();
  const double mu = options.momentum();
  std::vector<at::Tensor> l2_grads;
  at::TensorList g = grads;
  if (wd != 0.0) {
    if (options.weight_decay_method() == WeightDecayMethod::kL2) {
      l2_grads = at::_foreach_add(grads, at::_foreach_mul(params, wd));
      g = l2_grads;
    } else {
      at::_foreach_mul_(params, decay_factor(options));
    }
  }
  const std::vector<at::Tensor> g_scaled = at::_foreach_mul(g, 1.0 - mu);
  at::_foreach_mul_(momentum_buffers, mu);
  at::_foreach_add_(momentum_buffers, g_scaled);
  if (options.nesterov()) {
    // mu*B + g_scaled: the sum muon_momentum_input forms as g_scaled + mu*B (addition commutes
    // exactly).
    std::vector<at::Tensor> u = at::_foreach_mul(momentum_buffers, mu);
    at::_foreach_add_(u, g_scaled);
    return u;
  }
  // Copies in one operation for the list: x * 1 is x, bit for bit, for every number (a NaN may
  // come back with another payload, which no later step reads).
  return at::_foreach_mul(momentum_buffers, 1.0);
}

double muon_scale(int64_t rows, int64_t cols, ScaleMode mode) {
  FSDP_MUON_CHECK(rows > 0 && cols > 0, "matrix shape must be positive, got ", rows, " x ", cols);
  const double r = static_cast<double>(rows);
  const double c = static_cast<double>(cols);
  switch (mode) {
    case ScaleMode::kSpectral:
      return std::sqrt(std::max(r, c));
    case ScaleMode::kShapeScaling:
      return std::sqrt(std::max(1.0, r / c));
    case ScaleMode::kUnitRmsNorm:
      return std::sqrt(r / c);
    case ScaleMode::kMatchRmsAdamW:
      return 0.2 * std::sqrt(std::max(r, c));
    case ScaleMode::kNone:
      return 1.0;
  }
  FSDP_MUON_CHECK(false, "scale_mode has an unknown value ", static_cast<int>(mode));
}

at::Tensor muon_normuon_normalize(const at::Tensor& o, const at::Tensor& variance,
                                  const MuonOptions& options) {
  const bool batch = o.dim() == 3;
  FSDP_MUON_CHECK((o.dim() == 2 || batch) && variance.dim() == o.dim() - 1 &&
                      variance.sizes() == o.sizes().slice(0, o.dim() - 1),
                  "NorMuon's variance must be one entry per row: update ", o.sizes(), ", variance ",
                  variance.sizes());
  FSDP_MUON_CHECK(variance.scalar_type() == o.scalar_type(), "NorMuon's variance is ",
                  variance.scalar_type(), " but the update is ", o.scalar_type());
  const double beta2 = options.normuon_beta2();
  const double eps = options.normuon_eps();
  // Per matrix: the whole matrix's norm, or each batch entry's ([batch, 1, 1]). On one CPU thread
  // a batch's reductions give each matrix the 2-D call's bits (tests/muon); elsewhere a batch is
  // only formed where its last bits may differ (NewtonSchulzBatching).
  const auto matrix_norm = [&](const at::Tensor& t) {
    return batch ? at::linalg_vector_norm(t, 2, at::IntArrayRef{-2, -1}, /*keepdim=*/true)
                 : at::linalg_vector_norm(t, 2);
  };
  const at::Tensor norm = matrix_norm(o);
  const at::Tensor row_mean_square = o.mul(o).mean(-1);
  variance.mul_(beta2);
  variance.add_(row_mean_square.mul(1.0 - beta2));
  const at::Tensor normalized = o.div(variance.sqrt().add(eps).unsqueeze(-1));
  const at::Tensor new_norm = matrix_norm(normalized).clamp_min(eps);
  return normalized.mul(norm.div(new_norm));
}

at::Tensor muon_row_state(MuonParamState& state, const at::Tensor& param,
                          const MuonOptions& options) {
  // One entry per row of the parameter: rows x cols, or E x m x n read as E·m rows
  // (MatrixLayout::batched), so each matrix of a layout normalizes its own rows.
  const int64_t rows = param.dim() == 3 ? param.size(0) * param.size(1) : param.size(0);
  return muon_row_state(state, param, rows, options);
}

at::Tensor muon_row_state(MuonParamState& state, const at::Tensor& like, int64_t rows,
                          const MuonOptions& options) {
  if (!update_rule(options).per_row_state) return at::Tensor();
  if (!state.normuon_variance().defined()) {
    state.normuon_variance(at::zeros({rows}, like.options()));
  }
  const at::Tensor& v = state.normuon_variance();
  FSDP_MUON_CHECK(v.dim() == 1 && v.size(0) == rows, "NorMuon's state has shape ", v.sizes(),
                  " where ", rows,
                  " rows were expected; it belongs to another parameter or layout");
  return v;
}

at::Tensor muon_orthogonalized_update(const at::Tensor& full_u, const MuonOptions& options,
                                      const at::Tensor& row_state) {
  FSDP_MUON_CHECK(full_u.dim() == 2 || full_u.dim() == 3,
                  "expected a 2-D matrix or a 3-D batch of matrices, got shape ", full_u.sizes());
  const double scale = muon_scale(full_u.size(-2), full_u.size(-1), options.scale_mode()) *
                       options.extra_scale_factor();
  at::Tensor update = newton_schulz(full_u, options.newton_schulz());
  if (update.scalar_type() != full_u.scalar_type()) {
    update = update.to(full_u.scalar_type());
  }
  const UpdateRule& rule = update_rule(options);
  FSDP_MUON_CHECK(rule.per_row_state == row_state.defined(), "per-row state is ",
                  rule.per_row_state ? "missing" : "given", " but the update rule is '", rule.name,
                  "'");
  if (rule.transform != nullptr) {
    if (full_u.dim() == 2 || rule.transforms_batches) {
      update = rule.transform(update, row_state, options);
    } else {
      // One matrix at a time, so each sees the reductions of the 2-D call (the bitwise contract
      // between a batched FsdpMuon owner and Muon).
      FSDP_MUON_CHECK(
          !row_state.defined() || (row_state.dim() == 2 && row_state.size(0) == full_u.size(0)),
          "the per-row state of a batch must be [batch, rows], got ", row_state.sizes(), " for ",
          full_u.sizes());
      for (int64_t i = 0; i < full_u.size(0); ++i) {
        update[i].copy_(
            rule.transform(update[i], row_state.defined() ? row_state[i] : at::Tensor(), options));
      }
    }
  }
  return update.mul_(scale);
}

void muon_apply_update(const at::Tensor& param, const at::Tensor& update,
                       const MuonOptions& options) {
  FSDP_MUON_CHECK(param.sizes() == update.sizes(), "parameter ", param.sizes(), " and update ",
                  update.sizes(), " must have one shape");
  param.sub_(update.mul(options.lr()));
}

void muon_apply_updates(at::TensorList params, at::TensorList updates, const MuonOptions& options) {
  FSDP_MUON_CHECK(params.size() == updates.size(), params.size(), " parameters but ",
                  updates.size(), " updates");
  if (params.empty()) return;
  at::_foreach_sub_(params, at::_foreach_mul(updates, options.lr()));
}

MuonParamState& advance_muon_state(OptimizerStateMap& state, const at::Tensor& param) {
  auto& slot = state[param.unsafeGetTensorImpl()];
  if (!slot) {
    auto fresh = std::make_unique<MuonParamState>();
    fresh->momentum_buffer(at::zeros_like(param, at::MemoryFormat::Contiguous));
    slot = std::move(fresh);
  }
  auto& muon_state = static_cast<MuonParamState&>(*slot);
  muon_state.step(muon_state.step() + 1);
  return muon_state;
}

}  // namespace fsdp_muon::detail
