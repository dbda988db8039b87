#pragma once
// Newton–Schulz orthogonalization (DESIGN §4): the coefficient schedules, normalization,
// transposition, compute dtype and batching used by every Muon in this library.

#include <array>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

namespace fsdp_muon {

// Named coefficient schedules; the tuples and their past-the-end rules are in DESIGN §4 and
// the README.
enum class NsCoefficients { kSimple, kQuintic, kPolarExpress, kCans, kAol, kDeepseekV4, kCubic5 };

// A schedule: one (a, b, c) per iteration. A named type because TORCH_ARG is a macro and the
// comma inside std::array<double, 3> would split its arguments.
using NsCoefficientList = std::vector<std::array<double, 3>>;

struct NewtonSchulzOptions {
  TORCH_ARG(int64_t, steps) = 5;
  TORCH_ARG(NsCoefficients, coefficients) = NsCoefficients::kQuintic;
  // Non-empty overrides the preset; past its end the last tuple repeats.
  TORCH_ARG(NsCoefficientList, custom_coefficients) = {};
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(c10::ScalarType, compute_dtype) = at::kBFloat16;
};

// The (a, b, c) tuple of every iteration for these options, after the schedule's cycle /
// repeat-last rule has been applied. Throws on invalid options (steps < 1, cubic5 with a step
// count other than 5, a custom tuple that is not finite).
std::vector<std::array<double, 3>> newton_schulz_schedule(const NewtonSchulzOptions& options);

// Name of a preset as used in the README and in error messages ("quintic", ...).
const char* to_string(NsCoefficients coefficients);

// Orthogonalizes a 2-D matrix or a 3-D batch of same-shape matrices. The result has the input's
// shape and the compute dtype converted back to the input's dtype. CPU tensors go through ATen;
// CUDA tensors through cuBLAS on the caller's current stream.
at::Tensor newton_schulz(const at::Tensor& x, const NewtonSchulzOptions& options = {});

}  // namespace fsdp_muon
