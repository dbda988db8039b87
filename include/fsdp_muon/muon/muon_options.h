#pragma once
// Options shared by single-device Muon and FsdpMuon (docs/DESIGN.md §4, §8).

#include <array>
#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/newton_schulz/newton_schulz.h>

namespace fsdp_muon {

// How the orthogonalized update is scaled for a rows x cols (out x in) matrix.
enum class ScaleMode {
  kSpectral,       // sqrt(max(rows, cols))
  kShapeScaling,   // sqrt(max(1, rows / cols))   (torch.optim.Muon "original", Keller Jordan)
  kUnitRmsNorm,    // sqrt(rows / cols)
  kMatchRmsAdamW,  // 0.2 * sqrt(max(rows, cols))  (Moonlight)
  kNone,           // 1
};

// Where weight decay enters, before the momentum update.
enum class WeightDecayMethod {
  kDecoupled,    // W <- W - lr * wd * W
  kIndependent,  // W <- W - wd * W
  kL2,           // G <- G + wd * W
  kPalm,         // W <- W - lr^2 * wd * W
};

// A per-row normalization of the orthogonalized update (docs/DESIGN.md §4, "NorMuon").
//   kNone     the update is NS(U).
//   kNorMuon  NorMuon (Li et al., 2025): with O = NS(U) (rows × cols), per-row second moment
//             v ← β2·v + (1 − β2)·mean_j(O_ij²) kept in the optimizer state, O_ij ← O_ij /
//             (√v_i + ε), then rescaled to O's Frobenius norm (‖O‖_F / max(‖·‖_F, ε)).
enum class Normalization { kNone, kNorMuon };

struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  explicit MuonOptions(double lr = 0.02);
  TORCH_ARG(double, lr) = 0.02;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(WeightDecayMethod, weight_decay_method) = WeightDecayMethod::kDecoupled;
  TORCH_ARG(int64_t, ns_steps) = 5;
  TORCH_ARG(NsCoefficients, coefficients) = NsCoefficients::kQuintic;
  TORCH_ARG(NsCoefficientList, custom_coefficients) = {};
  TORCH_ARG(ScaleMode, scale_mode) = ScaleMode::kShapeScaling;
  TORCH_ARG(double, extra_scale_factor) = 1.0;
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(c10::ScalarType, ns_dtype) = at::kBFloat16;
  TORCH_ARG(bool, skip_non_matrix) = false;
  // Newton–Schulz evaluation (NewtonSchulzOptions::method, gram_restarts, preconditioning).
  TORCH_ARG(NsMethod, ns_method) = NsMethod::kStandard;
  TORCH_ARG(NsRestartList, gram_restarts) = NsRestartList{2};
  TORCH_ARG(NsPreconditioning, ns_preconditioning) = NsPreconditioning::kNone;
  TORCH_ARG(Normalization, normalization) = Normalization::kNone;
  TORCH_ARG(double, normuon_beta2) = 0.95;
  TORCH_ARG(double, normuon_eps) = 1e-8;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
  // Throws with a message naming the option and the fix (negative lr, momentum outside [0, 1),
  // ns_steps < 1, ...).
  void validate() const;
  NewtonSchulzOptions newton_schulz_options() const;
  friend bool operator==(const MuonOptions& lhs, const MuonOptions& rhs);
};

const char* to_string(ScaleMode mode);
const char* to_string(WeightDecayMethod method);
const char* to_string(Normalization normalization);  // "none", "normuon"

}  // namespace fsdp_muon
