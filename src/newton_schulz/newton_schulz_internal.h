#pragma once
// Internal pieces of newton_schulz shared by the ATen path, the cuBLAS path, tests and the GPU
// benchmark. Not installed.

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdp_muon/newton_schulz/newton_schulz.h>

namespace fsdp_muon::detail {

// The largest eps (Newton-Schulz's, NorMuon's) the options accept: bf16's largest finite value,
// the narrowest dtype these values meet as tensor scalars. A larger one (1e300, say) would fail
// deep inside ATen ("value cannot be converted to type float without overflow") at the first
// step instead of naming the option.
constexpr double kLargestEps = 3.3895313892515355e38;

// How many NsCoefficients values exist (the rows of FSDP_MUON_NS_PRESETS); an archive holding
// any other integer is rejected.
int64_t ns_coefficients_count();
// How many NsMethod and NsPreconditioning values exist (their name tables' rows).
int64_t newton_schulz_method_count();
int64_t newton_schulz_preconditioning_count();

// newton_schulz_schedule() with errors that spell each option with `prefix` before its name
// (e.g. "newton_schulz()." for "newton_schulz().steps"), for callers that hold the options inside
// their own; they name the calling API (common/check.h).
std::vector<std::array<double, 3>> newton_schulz_schedule(const NewtonSchulzOptions& options,
                                                          const char* prefix);

// The iterate in canonical form: wide (rows <= cols), contiguous, normalized in fp32 and cast to
// the compute dtype; always 3-D (a 2-D input becomes a batch of one).
struct NsPrepared {
  at::Tensor x;     // (batch, m, n), m <= n, contiguous, compute dtype
  bool transposed;  // the input was tall and has been transposed
  bool batched;     // the input was 3-D
  c10::ScalarType input_dtype;
};

// Validates the input and the options that are not part of the schedule (eps, compute dtype).
void check_newton_schulz_input(const at::Tensor& x, const NewtonSchulzOptions& options);

// Normalization by the Frobenius norm (per matrix) in fp32, transposition to wide, cast.
NsPrepared prepare_newton_schulz(const at::Tensor& x, const NewtonSchulzOptions& options);

// Undoes prepare_newton_schulz's transposition, batching and dtype on the final iterate.
at::Tensor finish_newton_schulz(const at::Tensor& x, const NsPrepared& prepared);

// Whether a 3-D batch is known to compute every matrix bit for bit as the 2-D call does on this
// device with this compute dtype (docs/DESIGN.md §4, "Batching"): measured so on the CPU with
// fp32 and one intra-op thread (tests/newton_schulz), and not otherwise (bf16 goes through
// oneDNN kernels whose batched and single rounding differ in the last bit; with several threads
// the batch splits the work differently). CUDA is false until scripts/gpu-check measures it.
bool batched_newton_schulz_is_bitwise(const c10::Device& device, c10::ScalarType compute_dtype);

// x·xᵀ in fp32 for a batch x of the compute dtype (operands as they are, fp32 products): Gram's R
// and AOL's A.
at::Tensor gram_fp32(const at::Tensor& x);

// AOL preconditioning of a prepared batch x (docs/DESIGN.md §4, "AOL") given a = x·xᵀ in fp32:
// returns diag(s)·x in x's dtype and diag(s)·a·diag(s) in fp32, s_i = max(Σ_j |a_ij|, eps)^(-1/2);
// the second is the first step's A (standard, cast to the compute dtype) or Gram's R_0.
std::pair<at::Tensor, at::Tensor> aol_rescale(const at::Tensor& x, const at::Tensor& a, double eps);

// The iteration through ATen operators on whatever device x lives on: the CPU path, and the
// reference a GPU benchmark or test compares the cuBLAS path with. Same contract as
// newton_schulz().
at::Tensor newton_schulz_aten(const at::Tensor& x, const NewtonSchulzOptions& options);

// The cuBLAS path (only defined in CUDA builds): GEMMs and stream-ordered copies on the current
// stream of x's device through LibTorch's cuBLAS handle. Same contract as newton_schulz().
at::Tensor newton_schulz_cuda(const at::Tensor& x, const NewtonSchulzOptions& options);

}  // namespace fsdp_muon::detail
