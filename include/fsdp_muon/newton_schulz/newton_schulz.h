#pragma once
// Newton–Schulz orthogonalization (docs/DESIGN.md §4): the coefficient schedules, normalization,
// transposition, compute dtype and batching used by every Muon in this library.

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

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

struct NewtonSchulzOptions {
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
};

// The (a, b, c) tuple of every iteration for these options, after the schedule's cycle /
// repeat-last rule has been applied. Throws on invalid options (steps < 1, cubic5 with a step
// count other than 5, a custom tuple that is not finite).
std::vector<std::array<double, 3>> newton_schulz_schedule(const NewtonSchulzOptions& options);

// Name of a preset as used in the README and in error messages ("quintic", ...).
const char* to_string(NsCoefficients coefficients);

// The preset of that name (as to_string spells it); nullopt for any other string.
std::optional<NsCoefficients> parse_ns_coefficients(std::string_view name);

// Orthogonalizes a 2-D matrix or a 3-D batch of same-shape matrices. The result has the input's
// shape and the compute dtype converted back to the input's dtype. CPU tensors go through ATen;
// CUDA tensors through cuBLAS on the caller's current stream.
at::Tensor newton_schulz(const at::Tensor& x, const NewtonSchulzOptions& options = {});

}  // namespace fsdp_muon
