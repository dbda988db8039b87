#include <fsdp_muon/newton_schulz/newton_schulz.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <string_view>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <c10/util/Exception.h>

#include <fsdp_muon/config.h>

#include "newton_schulz/newton_schulz_internal.h"

namespace fsdp_muon {
namespace {

using Tuple = std::array<double, 3>;

enum class Rule { kCycle, kRepeatLast, kExactSteps };

struct Preset {
  NsCoefficients id;
  const char* name;
  Rule rule;
  std::vector<Tuple> tuples;
};

// FSDP_MUON_NS_PRESETS as data, one entry per enumerator, in enumerator order.
const std::vector<Preset>& presets() {
  static const std::vector<Preset> table{
#define FSDP_MUON_NS_PRESET_ENTRY(enumerator, name, rule, ...) \
  {NsCoefficients::enumerator, name, Rule::rule, {__VA_ARGS__}},
      FSDP_MUON_NS_PRESETS(FSDP_MUON_NS_PRESET_ENTRY)
#undef FSDP_MUON_NS_PRESET_ENTRY
  };
  return table;
}

// nullptr for a value outside the enum (an integer cast to it).
const Preset* find_preset(NsCoefficients coefficients) {
  const auto index = static_cast<size_t>(coefficients);
  return index < presets().size() ? &presets()[index] : nullptr;
}

Tuple cycle(const std::vector<Tuple>& tuples, int64_t i) {
  return tuples[static_cast<size_t>(i) % tuples.size()];
}

Tuple repeat_last(const std::vector<Tuple>& tuples, int64_t i) {
  return tuples[std::min(static_cast<size_t>(i), tuples.size() - 1)];
}

}  // namespace

const char* to_string(NsCoefficients coefficients) {
  const Preset* preset = find_preset(coefficients);
  return preset != nullptr ? preset->name : "unknown";
}

std::optional<NsCoefficients> parse_ns_coefficients(std::string_view name) {
  for (const Preset& preset : presets()) {
    if (name == preset.name) return preset.id;
  }
  return std::nullopt;
}

std::vector<std::array<double, 3>> newton_schulz_schedule(const NewtonSchulzOptions& options) {
  return detail::newton_schulz_schedule(options, "fsdp_muon::NewtonSchulzOptions", "steps");
}

namespace detail {

std::vector<std::array<double, 3>> newton_schulz_schedule(const NewtonSchulzOptions& options,
                                                          const char* api,
                                                          const char* steps_option) {
  const int64_t steps = options.steps();
  TORCH_CHECK(steps >= 1, api, ": ", steps_option, " must be at least 1, got ", steps);
  const auto& custom = options.custom_coefficients();
  const Preset* preset = custom.empty() ? find_preset(options.coefficients()) : nullptr;
  TORCH_CHECK(!custom.empty() || preset != nullptr, api, ": coefficients has an unknown value ",
              static_cast<int>(options.coefficients()));
  if (preset != nullptr && preset->rule == Rule::kExactSteps) {
    // Checked before the steps are materialized, so a nonsensical step count fails loudly.
    const auto defined = static_cast<int64_t>(preset->tuples.size());
    TORCH_CHECK(steps == defined, api, ": the ", preset->name, " schedule is defined for exactly ",
                defined, " steps, got ", steps_option, " = ", steps, "; set ", steps_option, "(",
                defined, ") or choose another schedule");
  }
  for (size_t t = 0; t < custom.size(); ++t) {
    const Tuple& tuple = custom[t];
    TORCH_CHECK(std::isfinite(tuple[0]) && std::isfinite(tuple[1]) && std::isfinite(tuple[2]), api,
                ": custom_coefficients[", t, "] = (", tuple[0], ", ", tuple[1], ", ", tuple[2],
                ") is not finite; every (a, b, c) must be finite numbers");
  }

  std::vector<Tuple> schedule;
  schedule.reserve(static_cast<size_t>(steps));
  for (int64_t i = 0; i < steps; ++i) {
    if (preset == nullptr) {
      schedule.push_back(repeat_last(custom, i));
    } else if (preset->rule == Rule::kCycle) {
      schedule.push_back(cycle(preset->tuples, i));
    } else {
      // kRepeatLast, and kExactSteps, whose step count was checked above.
      schedule.push_back(repeat_last(preset->tuples, i));
    }
  }
  return schedule;
}

int64_t ns_coefficients_count() { return static_cast<int64_t>(presets().size()); }

void check_newton_schulz_input(const at::Tensor& x, const NewtonSchulzOptions& options) {
  TORCH_CHECK(x.defined(), "fsdp_muon::newton_schulz: the input tensor is undefined");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3,
              "fsdp_muon::newton_schulz: expected a 2-D matrix or a 3-D batch of matrices, got a "
              "tensor "
              "of shape ",
              x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()),
              "fsdp_muon::newton_schulz: expected a real floating-point tensor, got ",
              x.scalar_type());
  TORCH_CHECK(x.layout() == c10::kStrided,
              "fsdp_muon::newton_schulz: expected a dense (strided) tensor, got ", x.layout());
  const c10::ScalarType dtype = options.compute_dtype();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "fsdp_muon::NewtonSchulzOptions: compute_dtype must be at::kBFloat16 or at::kFloat, "
              "got ",
              dtype);
  TORCH_CHECK(std::isfinite(options.eps()) && options.eps() > 0.0,
              "fsdp_muon::NewtonSchulzOptions: eps must be a positive finite number (it guards the "
              "division by the Frobenius norm), got ",
              options.eps());
}

NsPrepared prepare_newton_schulz(const at::Tensor& x, const NewtonSchulzOptions& options) {
  NsPrepared prepared;
  prepared.batched = x.dim() == 3;
  prepared.transposed = x.size(-2) > x.size(-1);
  prepared.input_dtype = x.scalar_type();
  at::Tensor u = prepared.batched ? x : x.unsqueeze(0);
  u = u.to(at::kFloat);
  if (prepared.transposed) u = u.mT();
  // One canonical layout before any arithmetic: the result for a tall U and for the wide Uᵀ is
  // then computed from identical bits, and the norm's reduction order never depends on the
  // caller's strides.
  u = u.contiguous();
  const at::Tensor norm = at::linalg_vector_norm(u, 2, at::IntArrayRef{-2, -1}, /*keepdim=*/true);
  // Clamping the norm (not adding eps) keeps unit-norm inputs exact and maps zero to zero.
  u = u.div(norm.clamp_min(options.eps()));
  prepared.x = u.to(options.compute_dtype()).contiguous();
  return prepared;
}

at::Tensor finish_newton_schulz(const at::Tensor& x, const NsPrepared& prepared) {
  at::Tensor out = prepared.transposed ? x.mT() : x;
  if (!prepared.batched) out = out.squeeze(0);
  return out.to(prepared.input_dtype).contiguous();
}

bool batched_newton_schulz_is_bitwise(const c10::Device& device, c10::ScalarType compute_dtype) {
  return device.is_cpu() && compute_dtype == at::kFloat && at::get_num_threads() == 1;
}

at::Tensor newton_schulz_aten(const at::Tensor& x, const NewtonSchulzOptions& options) {
  check_newton_schulz_input(x, options);
  const auto schedule = newton_schulz_schedule(options);
  // Orthogonalization is not differentiated through; keep autograd out even for inputs that
  // require grad.
  at::NoGradGuard no_grad;
  if (x.numel() == 0) return at::empty(x.sizes(), x.options());
  NsPrepared prepared = prepare_newton_schulz(x, options);
  at::Tensor X = prepared.x;
  for (const Tuple& t : schedule) {
    if (t[1] == 0.0 && t[2] == 0.0) {
      // Never hand ATen a zero alpha: torch 2.11's CPU baddbmm ignores alpha == 0 for bf16
      // (it adds the product anyway).
      X = X.mul(t[0]);
      continue;
    }
    const at::Tensor A = at::bmm(X, X.mT());
    if (t[2] == 0.0) {
      // Cubic step: X = a·X + b·A·X, one GEMM fewer.
      X = at::baddbmm(X, A, X, /*beta=*/t[0], /*alpha=*/t[1]);
    } else {
      const at::Tensor B = at::baddbmm(A, A, A, /*beta=*/t[1], /*alpha=*/t[2]);
      X = at::baddbmm(X, B, X, /*beta=*/t[0], /*alpha=*/1.0);
    }
  }
  return finish_newton_schulz(X, prepared);
}

}  // namespace detail

at::Tensor newton_schulz(const at::Tensor& x, const NewtonSchulzOptions& options) {
  detail::check_newton_schulz_input(x, options);
  if (x.is_cuda()) {
#if FSDP_MUON_WITH_CUDA
    return detail::newton_schulz_cuda(x, options);
#else
    TORCH_CHECK(
        false,
        "fsdp_muon::newton_schulz: got a CUDA tensor, but this build of fsdp_muon has no CUDA "
        "support (LibTorch without CUDA at build time); move the tensor to the CPU or "
        "rebuild against a CUDA LibTorch");
#endif
  }
  TORCH_CHECK(x.is_cpu(), "fsdp_muon::newton_schulz: supports CPU and CUDA tensors, got device ",
              x.device());
  return detail::newton_schulz_aten(x, options);
}

}  // namespace fsdp_muon
