#include <fsdp_muon/newton_schulz/newton_schulz.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <c10/util/Exception.h>

#include <fsdp_muon/config.h>

#include "common/check.h"
#include "common/enum_names.h"
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

constexpr detail::EnumName<NsMethod> kNsMethodNames[] = {
    {NsMethod::kStandard, "standard"},
    {NsMethod::kGram, "gram"},
    {NsMethod::kAuto, "auto"},
};
static_assert(detail::rows_in_enumerator_order(kNsMethodNames));

constexpr detail::EnumName<NsPreconditioning> kNsPreconditioningNames[] = {
    {NsPreconditioning::kNone, "none"},
    {NsPreconditioning::kAol, "aol"},
};
static_assert(detail::rows_in_enumerator_order(kNsPreconditioningNames));

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

const char* to_string(NsMethod method) { return detail::name_of(kNsMethodNames, method); }

const char* to_string(NsPreconditioning preconditioning) {
  return detail::name_of(kNsPreconditioningNames, preconditioning);
}

std::optional<NsMethod> parse_ns_method(std::string_view name) {
  return detail::value_named(kNsMethodNames, name);
}

std::optional<NsPreconditioning> parse_ns_preconditioning(std::string_view name) {
  return detail::value_named(kNsPreconditioningNames, name);
}

std::vector<std::array<double, 3>> newton_schulz_schedule(const NewtonSchulzOptions& options) {
  FSDP_MUON_API_SCOPE("NewtonSchulzOptions");
  return detail::newton_schulz_schedule(options, "");
}

namespace {

// FLOPs of the GEMMs of one m × n matrix (m <= n after transposition) with a resolved method.
double flops_for(double m, double n, const std::vector<Tuple>& schedule, NsMethod method,
                 const NewtonSchulzOptions& options) {
  const double xx = 2.0 * m * m * n;  // X·Xᵀ, or an m×m matrix times X
  const double mm = 2.0 * m * m * m;  // m×m times m×m
  const bool aol = options.preconditioning() == NsPreconditioning::kAol;
  const auto steps = static_cast<int64_t>(schedule.size());
  double flops = 0.0;
  if (method == NsMethod::kStandard) {
    if (aol) flops += xx;  // its X·Xᵀ is the first step's A
    for (int64_t i = 0; i < steps; ++i) {
      const Tuple& t = schedule[static_cast<size_t>(i)];
      if (t[1] == 0.0 && t[2] == 0.0) continue;
      flops += (i == 0 && aol) ? 0.0 : xx;  // A
      flops += xx;                          // B·X
      if (t[2] != 0.0) flops += mm;         // A·A
    }
    return flops;
  }
  const auto& restarts = options.gram_restarts();
  auto restart_at = [&](int64_t i) {
    return std::find(restarts.begin(), restarts.end(), i) != restarts.end();
  };
  flops += xx;  // R = X·Xᵀ (AOL's A)
  bool fresh = true;
  for (int64_t i = 0; i < steps; ++i) {
    if (restart_at(i)) {
      flops += 2.0 * xx;  // X ← Q·X, R ← X·Xᵀ
      fresh = true;
    }
    if (schedule[static_cast<size_t>(i)][2] != 0.0) flops += mm;  // Z = b·R + c·R·R
    if (!fresh) flops += mm;                                      // Q ← Q·Z + a·Q
    fresh = false;
    if (i + 1 < steps && !restart_at(i + 1)) flops += 2.0 * mm;  // R ← (Z + aI)·R·(Z + aI)
  }
  return flops + xx;  // Q·X
}

}  // namespace

NsMethod resolve_ns_method(int64_t rows, int64_t cols, const NewtonSchulzOptions& options) {
  if (options.method() != NsMethod::kAuto) return options.method();
  const auto schedule = newton_schulz_schedule(options);
  const auto m = static_cast<double>(std::min(rows, cols));
  const auto n = static_cast<double>(std::max(rows, cols));
  return flops_for(m, n, schedule, NsMethod::kGram, options) <
                 flops_for(m, n, schedule, NsMethod::kStandard, options)
             ? NsMethod::kGram
             : NsMethod::kStandard;
}

double newton_schulz_flops(int64_t rows, int64_t cols, const NewtonSchulzOptions& options) {
  FSDP_MUON_API_SCOPE("newton_schulz_flops");
  FSDP_MUON_CHECK(rows >= 0 && cols >= 0, "rows and cols must be >= 0, got ", rows, " x ", cols);
  const auto schedule = newton_schulz_schedule(options);
  const auto m = static_cast<double>(std::min(rows, cols));
  const auto n = static_cast<double>(std::max(rows, cols));
  return flops_for(m, n, schedule, resolve_ns_method(rows, cols, options), options);
}

namespace detail {

std::vector<std::array<double, 3>> newton_schulz_schedule(const NewtonSchulzOptions& options,
                                                          const char* prefix) {
  const std::string steps_option = std::string(prefix) + "steps";
  const std::string restarts_option = std::string(prefix) + "gram_restarts";
  const int64_t steps = options.steps();
  FSDP_MUON_CHECK(steps >= 1, steps_option, " must be at least 1, got ", steps);
  const auto& custom = options.custom_coefficients();
  const Preset* preset = custom.empty() ? find_preset(options.coefficients()) : nullptr;
  FSDP_MUON_CHECK(!custom.empty() || preset != nullptr, prefix,
                  "coefficients has an unknown value ", static_cast<int>(options.coefficients()));
  if (preset != nullptr && preset->rule == Rule::kExactSteps) {
    // Checked before the steps are materialized, so a nonsensical step count fails loudly.
    const auto defined = static_cast<int64_t>(preset->tuples.size());
    FSDP_MUON_CHECK(steps == defined, "the ", preset->name, " schedule is defined for exactly ",
                    defined, " steps, got ", steps_option, " = ", steps, "; set ", steps_option,
                    "(", defined, ") or choose another schedule");
  }
  FSDP_MUON_CHECK(options.method() == NsMethod::kStandard || options.method() == NsMethod::kGram ||
                      options.method() == NsMethod::kAuto,
                  "the Newton-Schulz method has an unknown value ",
                  static_cast<int>(options.method()), "; use NsMethod::kStandard, kGram or kAuto");
  FSDP_MUON_CHECK(options.preconditioning() == NsPreconditioning::kNone ||
                      options.preconditioning() == NsPreconditioning::kAol,
                  "the Newton-Schulz preconditioning has an unknown value ",
                  static_cast<int>(options.preconditioning()),
                  "; use NsPreconditioning::kNone or kAol");
  if (options.method() != NsMethod::kStandard) {
    // Restarts only mean something to Gram; a list that cannot apply is an error rather than
    // silently ignored, so a Gram run never differs from what its options say.
    const auto& restarts = options.gram_restarts();
    for (size_t r = 0; r < restarts.size(); ++r) {
      FSDP_MUON_CHECK(restarts[r] >= 1 && restarts[r] < steps, restarts_option, "[", r,
                      "] = ", restarts[r], " is not an iteration a restart can precede with ",
                      steps_option, " = ", steps, "; each entry must lie in [1, ", steps_option,
                      " - 1] (e.g. ", restarts_option, "({2}) for 5 steps, ", restarts_option,
                      "({}) for none)");
      FSDP_MUON_CHECK(r == 0 || restarts[r] > restarts[r - 1], restarts_option,
                      " must be strictly increasing, got ", restarts[r - 1], " then ", restarts[r]);
    }
  }
  for (size_t t = 0; t < custom.size(); ++t) {
    const Tuple& tuple = custom[t];
    FSDP_MUON_CHECK(std::isfinite(tuple[0]) && std::isfinite(tuple[1]) && std::isfinite(tuple[2]),
                    prefix, "custom_coefficients[", t, "] = (", tuple[0], ", ", tuple[1], ", ",
                    tuple[2], ") is not finite; every (a, b, c) must be finite numbers");
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

int64_t newton_schulz_method_count() { return static_cast<int64_t>(std::size(kNsMethodNames)); }

int64_t newton_schulz_preconditioning_count() {
  return static_cast<int64_t>(std::size(kNsPreconditioningNames));
}

void check_newton_schulz_input(const at::Tensor& x, const NewtonSchulzOptions& options) {
  FSDP_MUON_CHECK(x.defined(), "the input tensor is undefined");
  FSDP_MUON_CHECK(x.dim() == 2 || x.dim() == 3,
                  "expected a 2-D matrix or a 3-D batch of matrices, got a "
                  "tensor "
                  "of shape ",
                  x.sizes());
  FSDP_MUON_CHECK(at::isFloatingType(x.scalar_type()),
                  "expected a real floating-point tensor, got ", x.scalar_type());
  FSDP_MUON_CHECK(x.layout() == c10::kStrided, "expected a dense (strided) tensor, got ",
                  x.layout());
  FSDP_MUON_API_SCOPE("NewtonSchulzOptions");  // what follows checks the options, not the input
  const c10::ScalarType dtype = options.compute_dtype();
  FSDP_MUON_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
                  "compute_dtype must be at::kBFloat16 or at::kFloat, "
                  "got ",
                  dtype);
  FSDP_MUON_CHECK(options.eps() > 0.0 && options.eps() <= detail::kLargestEps,
                  "eps must be a positive finite number at most ", detail::kLargestEps,
                  " (bf16's largest; it guards the division by the Frobenius norm), got ",
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

at::Tensor gram_fp32(const at::Tensor& x) {
  const at::Tensor x32 = x.to(at::kFloat);
  return at::bmm(x32, x32.mT());
}

std::pair<at::Tensor, at::Tensor> aol_rescale(const at::Tensor& x, const at::Tensor& a,
                                              double eps) {
  FSDP_MUON_CHECK(a.scalar_type() == at::kFloat, "AOL's Gram matrix must be fp32");
  // The clamp (eps, as Turbo-Muon's) keeps a zero row zero (0·s) instead of 0·inf.
  const at::Tensor s = a.abs().sum(-1).clamp_min(eps).rsqrt();
  const at::Tensor xs = x.to(at::kFloat).mul(s.unsqueeze(-1)).to(x.scalar_type()).contiguous();
  const at::Tensor as = a.mul(s.unsqueeze(-1)).mul(s.unsqueeze(-2)).contiguous();
  return {xs, as};
}

namespace {

at::Tensor standard_aten(at::Tensor X, at::Tensor A0, const std::vector<Tuple>& schedule) {
  for (size_t i = 0; i < schedule.size(); ++i) {
    const Tuple& t = schedule[i];
    if (t[1] == 0.0 && t[2] == 0.0) {
      // Never hand ATen a zero alpha: torch 2.11's CPU baddbmm ignores alpha == 0 for bf16
      // (it adds the product anyway).
      X = X.mul(t[0]);
      continue;
    }
    const at::Tensor A = (i == 0 && A0.defined()) ? A0.to(X.scalar_type()) : at::bmm(X, X.mT());
    if (t[2] == 0.0) {
      // Cubic step: X = a·X + b·A·X, one GEMM fewer.
      X = at::baddbmm(X, A, X, /*beta=*/t[0], /*alpha=*/t[1]);
    } else {
      const at::Tensor B = at::baddbmm(A, A, A, /*beta=*/t[1], /*alpha=*/t[2]);
      X = at::baddbmm(X, B, X, /*beta=*/t[0], /*alpha=*/1.0);
    }
  }
  return X;
}

// docs/DESIGN.md §4, "Gram": every X_t is Q_t·X_s for the X_s of the last (re)start, and every
// factor is a polynomial in R_s = X_s·X_sᵀ, so the loop runs on m×m matrices only. R, Z and Q are
// fp32 whatever the compute dtype (in bf16 the Gram products lose the band: DESIGN); X and the
// products with X keep the compute dtype.
at::Tensor gram_aten(at::Tensor X, at::Tensor R, const std::vector<Tuple>& schedule,
                     const NsRestartList& restarts) {
  auto restart_at = [&](int64_t i) {
    return std::find(restarts.begin(), restarts.end(), i) != restarts.end();
  };
  const c10::ScalarType dtype = X.scalar_type();
  if (!R.defined()) R = gram_fp32(X);
  at::Tensor Q;
  const auto steps = static_cast<int64_t>(schedule.size());
  for (int64_t i = 0; i < steps; ++i) {
    const Tuple& t = schedule[static_cast<size_t>(i)];
    if (restart_at(i)) {
      X = at::bmm(Q.to(dtype), X);
      R = gram_fp32(X);
      Q = at::Tensor();
    }
    // Z = b·R + c·R² (no baddbmm with alpha = 0: see standard_aten).
    const at::Tensor Z =
        t[2] != 0.0 ? at::baddbmm(R, R, R, /*beta=*/t[1], /*alpha=*/t[2]) : R.mul(t[1]);
    if (!Q.defined()) {
      Q = Z.clone();
      Q.diagonal(0, -2, -1).add_(t[0]);  // Q = Z + a·I
    } else {
      Q = at::baddbmm(Q, Q, Z, /*beta=*/t[0], /*alpha=*/1.0);  // Q·Z + a·Q
    }
    if (i + 1 < steps && !restart_at(i + 1)) {
      const at::Tensor RZ = at::baddbmm(R, R, Z, /*beta=*/t[0], /*alpha=*/1.0);  // R·(Z + aI)
      R = at::baddbmm(RZ, Z, RZ, /*beta=*/t[0], /*alpha=*/1.0);                  // (Z + aI)·RZ
    }
  }
  return at::bmm(Q.to(dtype), X);
}

}  // namespace

at::Tensor newton_schulz_aten(const at::Tensor& x, const NewtonSchulzOptions& options) {
  check_newton_schulz_input(x, options);
  const auto schedule = newton_schulz_schedule(options);
  // Orthogonalization is not differentiated through; keep autograd out even for inputs that
  // require grad.
  at::NoGradGuard no_grad;
  if (x.numel() == 0) return at::empty(x.sizes(), x.options());
  NsPrepared prepared = prepare_newton_schulz(x, options);
  at::Tensor X = prepared.x;
  at::Tensor A0;
  if (options.preconditioning() == NsPreconditioning::kAol) {
    std::tie(X, A0) = aol_rescale(X, gram_fp32(X), options.eps());
  }
  const NsMethod method = resolve_ns_method(x.size(-2), x.size(-1), options);
  X = method == NsMethod::kGram ? gram_aten(X, A0, schedule, options.gram_restarts())
                                : standard_aten(X, A0, schedule);
  return finish_newton_schulz(X, prepared);
}

}  // namespace detail

at::Tensor newton_schulz(const at::Tensor& x, const NewtonSchulzOptions& options) {
  FSDP_MUON_API_SCOPE("newton_schulz");
  detail::check_newton_schulz_input(x, options);
  if (x.is_cuda()) {
#if FSDP_MUON_WITH_CUDA
    return detail::newton_schulz_cuda(x, options);
#else
    FSDP_MUON_CHECK(false,
                    "got a CUDA tensor, but this build of fsdp_muon has no CUDA "
                    "support (LibTorch without CUDA at build time); move the tensor to the CPU or "
                    "rebuild against a CUDA LibTorch");
#endif
  }
  FSDP_MUON_CHECK(x.is_cpu(), "supports CPU and CUDA tensors, got device ", x.device());
  return detail::newton_schulz_aten(x, options);
}

}  // namespace fsdp_muon
