#pragma once
// Newton–Schulz options (docs/DESIGN.md §4): coefficient schedules, method, preconditioning,
// compute dtype. MuonOptions carries them; newton_schulz.h runs them.

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/newton_schulz/ns_presets.h>

namespace fsdp_muon {

// Named coefficient schedules: kSimple, kQuintic, kPolarExpress, kCans, kAol, kDeepseekV4,
// kCubic5, in this order. The enumerators, their tuples and past-the-end rules are the rows of
// FSDP_MUON_NS_PRESETS (ns_presets.h).
enum class NsCoefficients {
#define FSDP_MUON_NS_ENUMERATOR(enumerator, ...) enumerator,
  FSDP_MUON_NS_PRESETS(FSDP_MUON_NS_ENUMERATOR)
#undef FSDP_MUON_NS_ENUMERATOR
};

// A schedule: one (a, b, c) per iteration. A named type because TORCH_ARG is a macro and the
// comma inside std::array<double, 3> would split its arguments.
using NsCoefficientList = std::vector<std::array<double, 3>>;

// How the iteration is evaluated (docs/DESIGN.md §4, "Gram"). Both compute the same polynomial of
// the input; they round differently.
//   kStandard  X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ: (4k + 2)·m³ FLOPs per step for an m×km
//              matrix (m the short side).
//   kGram      iterates on the m×m Gram matrix R = X·Xᵀ and accumulates Q with X_t = Q·X_0,
//              multiplying by X only at the start, at each restart and at the end: 8·m³ per
//              step plus 4k·m³ per (re)start. Fewer FLOPs from aspect k ≳ 1.5 (5 steps).
//   kAuto      per matrix, whichever of the two counts fewer FLOPs for its shape and schedule
//              (newton_schulz_flops); square matrices stay standard.
enum class NsMethod { kStandard, kGram, kAuto };

// A rescaling of the normalized input before the first step (docs/DESIGN.md §4, "AOL").
//   kNone  X = U / ‖U‖_F only.
//   kAol   Turbo-Muon's AOL diagonal: with A = X·Xᵀ, X ← diag(s)·X, s_i = (Σ_j |A_ij|)^(-1/2),
//          which bounds ‖X‖₂ ≤ 1 and pulls the singular values up, so one step fewer reaches the
//          same band; A is reused (rescaled) by the first step, so it costs no extra GEMM.
enum class NsPreconditioning { kNone, kAol };

// A list of iteration indices (TORCH_ARG cannot take a template with a comma either).
using NsRestartList = std::vector<int64_t>;

struct FSDP_MUON_API NewtonSchulzOptions {
  // Iterations (>= 1; cubic5 takes exactly 5).
  TORCH_ARG(int64_t, steps) = 5;
  // The (a, b, c) schedule, a named preset (see NsCoefficients and the README).
  TORCH_ARG(NsCoefficients, coefficients) = NsCoefficients::kQuintic;
  // Non-empty overrides the preset; past its end the last tuple repeats.
  TORCH_ARG(NsCoefficientList, custom_coefficients) = {};
  // The input is divided by max(Frobenius norm, eps) (finite, > 0), in fp32.
  TORCH_ARG(double, eps) = 1e-7;
  // The dtype the iterations compute in: bf16 or fp32.
  TORCH_ARG(c10::ScalarType, compute_dtype) = at::kBFloat16;
  TORCH_ARG(NsMethod, method) = NsMethod::kStandard;
  // kGram (and kAuto where it picks Gram): restart before these 0-based iterations, i.e. after
  // the 2nd of them for {2} (X ← Q·X, R ← X·Xᵀ, Q ← I), which bounds how far the rounding of
  // the Gram products can carry. Strictly increasing, each in [1, steps − 1]. The default is
  // where the published autotune puts one restart for 5 steps.
  TORCH_ARG(NsRestartList, gram_restarts) = NsRestartList{2};
  TORCH_ARG(NsPreconditioning, preconditioning) = NsPreconditioning::kNone;
};

// Name of a preset as used in the README and in error messages ("quintic", ...).
FSDP_MUON_API const char* to_string(NsCoefficients coefficients);

// The preset of that name (as to_string spells it); nullopt for any other string.
FSDP_MUON_API std::optional<NsCoefficients> parse_ns_coefficients(std::string_view name);

FSDP_MUON_API const char* to_string(NsMethod method);  // "standard", "gram", "auto"
FSDP_MUON_API const char* to_string(NsPreconditioning preconditioning);  // "none", "aol"
FSDP_MUON_API std::optional<NsMethod> parse_ns_method(std::string_view name);
FSDP_MUON_API std::optional<NsPreconditioning> parse_ns_preconditioning(std::string_view name);

}  // namespace fsdp_muon
