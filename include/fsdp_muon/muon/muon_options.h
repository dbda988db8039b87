#pragma once
// Options shared by single-device Muon and FsdpMuon (docs/DESIGN.md §4, §8).

#include <array>
#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/muon/matrix_layout.h>
#include <fsdp_muon/newton_schulz/ns_options.h>

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

// The per-parameter-group math of Muon and FsdpMuon (docs/DESIGN.md §4); how FsdpMuon
// distributes it is FsdpMuonConfig. validate() names an invalid option and its fix.
struct FSDP_MUON_API MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  explicit MuonOptions(double lr = 0.02);
  // Learning rate: W <- W - lr * update. >= 0.
  TORCH_ARG(double, lr) = 0.02;
  // Momentum mu: B <- mu * B + (1 - mu) * G. In [0, 1).
  TORCH_ARG(double, momentum) = 0.95;
  // Orthogonalize the Nesterov input (1 - mu) * G + mu * B instead of B.
  TORCH_ARG(bool, nesterov) = true;
  // Weight decay, applied as weight_decay_method says before the momentum update. >= 0.
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(WeightDecayMethod, weight_decay_method) = WeightDecayMethod::kDecoupled;
  // How the orthogonalized update is computed: Newton–Schulz iterations, coefficient schedule,
  // Frobenius-norm clamp, compute dtype (bf16 or fp32), method, Gram restarts and
  // preconditioning (see NewtonSchulzOptions, whose defaults are Muon's). Set it whole,
  // .newton_schulz(NewtonSchulzOptions().steps(5).compute_dtype(at::kFloat)), or one setting
  // of it, options.newton_schulz().steps(3).
  TORCH_ARG(NewtonSchulzOptions, newton_schulz) = {};
  // How the orthogonalized update is scaled for its shape (see ScaleMode), times
  // extra_scale_factor (finite).
  TORCH_ARG(ScaleMode, scale_mode) = ScaleMode::kShapeScaling;
  TORCH_ARG(double, extra_scale_factor) = 1.0;
  // Leave parameters that are not 2-D untouched (one warning on rank 0) instead of an error;
  // give them to an elementwise optimizer such as torch::optim::AdamW. Only under
  // MatrixLayout::whole(): the other layouts name the shape they take.
  TORCH_ARG(bool, skip_non_matrix) = false;
  // A per-row normalization of the orthogonalized update (see Normalization), with NorMuon's
  // second-moment decay in [0, 1) and the finite eps > 0 that guards its divisions.
  TORCH_ARG(Normalization, normalization) = Normalization::kNone;
  TORCH_ARG(double, normuon_beta2) = 0.95;
  TORCH_ARG(double, normuon_eps) = 1e-8;
  // Which matrices each parameter of the group holds (see MatrixLayout): whole() (one 2-D
  // matrix), row_blocks({...}) (a fused QKV or per-head weight) or batched() (3-D experts).
  TORCH_ARG(MatrixLayout, matrix_layout) = MatrixLayout::whole();

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
  // Throws with a message naming the option and the fix (negative lr, momentum outside [0, 1),
  // newton_schulz().steps() < 1, ...).
  void validate() const;
  friend FSDP_MUON_API bool operator==(const MuonOptions& lhs, const MuonOptions& rhs);
};

FSDP_MUON_API const char* to_string(ScaleMode mode);
FSDP_MUON_API const char* to_string(WeightDecayMethod method);
FSDP_MUON_API const char* to_string(Normalization normalization);  // "none", "normuon"

}  // namespace fsdp_muon
