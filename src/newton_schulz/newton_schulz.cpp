#include <fsdp_muon/newton_schulz/newton_schulz.h>

#include <cmath>
#include <cstddef>

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

// DESIGN §4, digit for digit.
constexpr Tuple kSimpleTuple{3.4445, -4.7750, 2.0315};
const std::vector<Tuple> kQuinticTuples{{4.0848, -6.8946, 2.9270},
                                        {3.9505, -6.3029, 2.6377},
                                        {3.7418, -5.5913, 2.3037},
                                        {2.8769, -3.1427, 1.2046},
                                        {2.8366, -3.0525, 1.2012}};
const std::vector<Tuple> kPolarExpressTuples{
    {8.2051, -22.9019, 16.4607}, {4.0664, -2.8612, 0.5184}, {3.9096, -2.8234, 0.5250},
    {3.2856, -2.4153, 0.4853},   {2.2779, -1.6198, 0.3985}, {1.8726, -1.2307, 0.3585},
    {1.8564, -1.2132, 0.3568},   {1.8750, -1.2500, 0.3750}};
const std::vector<Tuple> kCansTuples{{8.4703, -25.1081, 18.6293},
                                     {4.1828, -3.1087, 0.5806},
                                     {3.9619, -2.9541, 0.5630},
                                     {3.2866, -2.4647, 0.5074},
                                     {2.2737, -1.6447, 0.4162}};
const std::vector<Tuple> kAolTuples{{4.0098, -7.0585, 2.4635},
                                    {3.4585, -5.5479, 2.5959},
                                    {2.7573, -3.2939, 1.4254},
                                    {2.7215, -3.0494, 1.3169}};
constexpr int64_t kDeepseekV4SimpleSteps = 8;
constexpr Tuple kDeepseekV4Tail{2.0, -1.5, 0.5};
const std::vector<Tuple> kCubic5Tuples{{3.3656576, -3.3420992, 0.0},
                                       {2.5744352, -1.4957376, 0.0},
                                       {2.5368962, -1.4312570, 0.0},
                                       {2.4418906, -1.2764040, 0.0},
                                       {2.2230472, -0.9630650, 0.0}};
constexpr int64_t kCubic5Steps = 5;

Tuple cycle(const std::vector<Tuple>& tuples, int64_t i) {
  return tuples[static_cast<size_t>(i) % tuples.size()];
}

Tuple repeat_last(const std::vector<Tuple>& tuples, int64_t i) {
  return tuples[std::min(static_cast<size_t>(i), tuples.size() - 1)];
}

}  // namespace

const char* to_string(NsCoefficients coefficients) {
  switch (coefficients) {
    case NsCoefficients::kSimple:
      return "simple";
    case NsCoefficients::kQuintic:
      return "quintic";
    case NsCoefficients::kPolarExpress:
      return "polar_express";
    case NsCoefficients::kCans:
      return "cans";
    case NsCoefficients::kAol:
      return "aol";
    case NsCoefficients::kDeepseekV4:
      return "deepseek_v4";
    case NsCoefficients::kCubic5:
      return "cubic5";
  }
  return "unknown";
}

std::vector<std::array<double, 3>> newton_schulz_schedule(const NewtonSchulzOptions& options) {
  const int64_t steps = options.steps();
  TORCH_CHECK(steps >= 1, "NewtonSchulzOptions::steps must be at least 1, got ", steps);
  const auto& custom = options.custom_coefficients();
  if (custom.empty()) {
    // Checked before the steps are materialized, so a nonsensical step count fails loudly.
    TORCH_CHECK(options.coefficients() != NsCoefficients::kCubic5 || steps == kCubic5Steps,
                "NewtonSchulzOptions: the cubic5 schedule is defined for exactly ", kCubic5Steps,
                " steps, got steps = ", steps, "; set steps(", kCubic5Steps,
                ") or choose another schedule");
  }
  for (size_t t = 0; t < custom.size(); ++t) {
    const Tuple& tuple = custom[t];
    TORCH_CHECK(std::isfinite(tuple[0]) && std::isfinite(tuple[1]) && std::isfinite(tuple[2]),
                "NewtonSchulzOptions::custom_coefficients[", t, "] = (", tuple[0], ", ", tuple[1],
                ", ", tuple[2], ") is not finite; every (a, b, c) must be finite numbers");
  }

  std::vector<Tuple> schedule;
  schedule.reserve(static_cast<size_t>(steps));
  for (int64_t i = 0; i < steps; ++i) {
    if (!custom.empty()) {
      schedule.push_back(repeat_last(custom, i));
      continue;
    }
    switch (options.coefficients()) {
      case NsCoefficients::kSimple:
        schedule.push_back(kSimpleTuple);
        break;
      case NsCoefficients::kQuintic:
        schedule.push_back(cycle(kQuinticTuples, i));
        break;
      case NsCoefficients::kPolarExpress:
        schedule.push_back(repeat_last(kPolarExpressTuples, i));
        break;
      case NsCoefficients::kCans:
        schedule.push_back(repeat_last(kCansTuples, i));
        break;
      case NsCoefficients::kAol:
        schedule.push_back(cycle(kAolTuples, i));
        break;
      case NsCoefficients::kDeepseekV4:
        schedule.push_back(i < kDeepseekV4SimpleSteps ? kSimpleTuple : kDeepseekV4Tail);
        break;
      case NsCoefficients::kCubic5:
        schedule.push_back(kCubic5Tuples[static_cast<size_t>(i)]);
        break;
      default:
        TORCH_CHECK(false, "NewtonSchulzOptions::coefficients has an unknown value ",
                    static_cast<int>(options.coefficients()));
    }
  }
  return schedule;
}

namespace detail {

void check_newton_schulz_input(const at::Tensor& x, const NewtonSchulzOptions& options) {
  TORCH_CHECK(x.defined(), "newton_schulz: the input tensor is undefined");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3,
              "newton_schulz: expected a 2-D matrix or a 3-D batch of matrices, got a tensor "
              "of shape ",
              x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()),
              "newton_schulz: expected a real floating-point tensor, got ", x.scalar_type());
  TORCH_CHECK(x.layout() == c10::kStrided, "newton_schulz: expected a dense (strided) tensor, got ",
              x.layout());
  const c10::ScalarType dtype = options.compute_dtype();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "NewtonSchulzOptions::compute_dtype must be at::kBFloat16 or at::kFloat, got ",
              dtype);
  TORCH_CHECK(std::isfinite(options.eps()) && options.eps() > 0.0,
              "NewtonSchulzOptions::eps must be a positive finite number (it guards the division "
              "by the Frobenius norm), got ",
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
    TORCH_CHECK(false,
                "newton_schulz: got a CUDA tensor, but this build of fsdp_muon has no CUDA "
                "support (LibTorch without CUDA at build time); move the tensor to the CPU or "
                "rebuild against a CUDA LibTorch");
#endif
  }
  TORCH_CHECK(x.is_cpu(), "newton_schulz: supports CPU and CUDA tensors, got device ", x.device());
  return detail::newton_schulz_aten(x, options);
}

}  // namespace fsdp_muon
