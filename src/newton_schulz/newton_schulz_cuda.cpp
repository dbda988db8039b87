// The cuBLAS path of newton_schulz: every standard iteration is three GEMMs (two for a cubic
// step) and two device-to-device copies, all on the caller's current stream through LibTorch's
// cuBLAS handle. a·X and b·A enter as the GEMMs' accumulate (beta) terms, so no elementwise
// kernel runs inside the loop. Gram iterations are m×m GEMMs the same way, plus one diagonal add
// per (re)start; AOL's row scaling runs as ATen kernels on the same stream.

#include <algorithm>
#include <climits>
#include <cstdint>
#include <tuple>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "common/check.h"
#include "common/cuda_check.h"
#include "newton_schulz/newton_schulz_internal.h"

namespace fsdp_muon::detail {
namespace {

// LibTorch's handle is shared with every other user in the process; host scalars need host
// pointer mode, and whatever mode the handle had is put back.
class HostPointerModeGuard {
 public:
  explicit HostPointerModeGuard(cublasHandle_t handle) : handle_(handle) {
    FSDP_MUON_CHECK_CUBLAS(cublasGetPointerMode(handle_, &previous_));
    FSDP_MUON_CHECK_CUBLAS(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
  }
  ~HostPointerModeGuard() { cublasSetPointerMode(handle_, previous_); }
  HostPointerModeGuard(const HostPointerModeGuard&) = delete;
  HostPointerModeGuard& operator=(const HostPointerModeGuard&) = delete;

 private:
  cublasHandle_t handle_;
  cublasPointerMode_t previous_ = CUBLAS_POINTER_MODE_HOST;
};

// Row-major GEMMs over a batch of contiguous matrices of one dtype. cuBLAS is column-major and a
// row-major M×N matrix is, to it, its N×M transpose; so C = op(P)·op(Q) in row-major is
// Cᵀ = op(Q)ᵀ·op(P)ᵀ in column-major: same transpose flags, operands swapped, M and N swapped.
class RowMajorGemm {
 public:
  // `dtype` for P and Q; C has `c_dtype` (default: the same), accumulation is fp32.
  RowMajorGemm(cublasHandle_t handle, cudaDataType dtype, int64_t batch)
      : RowMajorGemm(handle, dtype, dtype, batch) {}
  RowMajorGemm(cublasHandle_t handle, cudaDataType dtype, cudaDataType c_dtype, int64_t batch)
      : handle_(handle), dtype_(dtype), c_dtype_(c_dtype), batch_(batch) {}

  // C (M×N, ldc = N) = alpha · op(P) · op(Q) + beta · C, with op(P) M×K and op(Q) K×N; ldp and
  // ldq are the stored row lengths of P and Q, stride_* the distance between batch entries.
  void operator()(bool transpose_p, bool transpose_q, int m, int n, int k, float alpha,
                  const void* p, int ldp, int64_t stride_p, const void* q, int ldq,
                  int64_t stride_q, float beta, void* c, int64_t stride_c) const {
    const cublasOperation_t op_q = transpose_q ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_p = transpose_p ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (batch_ == 1) {
      FSDP_MUON_CHECK_CUBLAS(cublasGemmEx(handle_, op_q, op_p, n, m, k, &alpha, q, dtype_, ldq, p,
                                          dtype_, ldp, &beta, c, c_dtype_, n, CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT));
    } else {
      FSDP_MUON_CHECK_CUBLAS(cublasGemmStridedBatchedEx(
          handle_, op_q, op_p, n, m, k, &alpha, q, dtype_, ldq, stride_q, p, dtype_, ldp, stride_p,
          &beta, c, c_dtype_, n, stride_c, static_cast<int>(batch_), CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT));
    }
  }

 private:
  cublasHandle_t handle_;
  cudaDataType dtype_;
  cudaDataType c_dtype_;
  int64_t batch_;
};

}  // namespace

at::Tensor newton_schulz_cuda(const at::Tensor& x, const NewtonSchulzOptions& options) {
  check_newton_schulz_input(x, options);
  FSDP_MUON_CHECK(x.is_cuda(), "expected a CUDA tensor, got device ", x.device());
  const auto schedule = newton_schulz_schedule(options);
  at::NoGradGuard no_grad;
  if (x.numel() == 0) return at::empty(x.sizes(), x.options());

  // The handle and the stream below belong to the current device; make that x's device.
  const c10::cuda::CUDAGuard device_guard(x.device());
  NsPrepared prepared = prepare_newton_schulz(x, options);
  const int64_t batch = prepared.x.size(0);
  const int64_t rows = prepared.x.size(1);  // m <= n after prepare
  const int64_t cols = prepared.x.size(2);
  FSDP_MUON_CHECK(batch <= INT_MAX && rows <= INT_MAX && cols <= INT_MAX && rows * cols <= INT_MAX,
                  "matrices of shape ", x.sizes(), " exceed the 32-bit sizes of the cuBLAS path");
  const int m = static_cast<int>(rows);
  const int n = static_cast<int>(cols);
  const int64_t x_stride = rows * cols;
  const int64_t a_stride = rows * rows;

  const cudaDataType dtype = options.compute_dtype() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;

  // LibTorch binds its handle to the current stream; the copies go on that same stream so the
  // whole iteration is ordered with the caller's work and with the caching allocator.
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const HostPointerModeGuard pointer_mode(handle);
  const RowMajorGemm gemm(handle, dtype, batch);
  // X·Xᵀ into fp32 (Gram's R, AOL's A), and fp32 m×m products (Gram's loop).
  const RowMajorGemm gemm_to_fp32(handle, dtype, CUDA_R_32F, batch);
  const RowMajorGemm gemm_fp32(handle, CUDA_R_32F, batch);
  const at::TensorOptions fp32 = prepared.x.options().dtype(at::kFloat);

  at::Tensor X = prepared.x;
  at::Tensor Xn = at::empty_like(X);
  const auto copy = [&](const at::Tensor& dst, const at::Tensor& src) {
    FSDP_MUON_CHECK_CUDA(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(),
                                         cudaMemcpyDeviceToDevice, stream));
  };
  // A = X·Xᵀ in the compute dtype
  const auto gram = [&](const at::Tensor& x, const at::Tensor& out) {
    gemm(false, true, m, m, n, 1.0f, x.data_ptr(), n, x_stride, x.data_ptr(), n, x_stride, 0.0f,
         out.data_ptr(), a_stride);
  };
  // R = X·Xᵀ in fp32
  const auto gram32 = [&](const at::Tensor& x, const at::Tensor& out) {
    gemm_to_fp32(false, true, m, m, n, 1.0f, x.data_ptr(), n, x_stride, x.data_ptr(), n, x_stride,
                 0.0f, out.data_ptr(), a_stride);
  };
  // out (m×m) = alpha·P·Q + beta·out, all of `g`'s dtype
  const auto square = [&](const RowMajorGemm& g, float alpha, const at::Tensor& p,
                          const at::Tensor& q, float beta, const at::Tensor& out) {
    g(false, false, m, m, m, alpha, p.data_ptr(), m, a_stride, q.data_ptr(), m, a_stride, beta,
      out.data_ptr(), a_stride);
  };
  // out (m×n) = alpha·P·x + beta·out, P m×m, all in the compute dtype
  const auto apply = [&](float alpha, const at::Tensor& p, const at::Tensor& x, float beta,
                         const at::Tensor& out) {
    gemm(false, false, m, n, m, alpha, p.data_ptr(), m, a_stride, x.data_ptr(), n, x_stride, beta,
         out.data_ptr(), x_stride);
  };

  at::Tensor A0;  // AOL's rescaled Gram matrix (fp32): the first step's A, or Gram's R_0
  if (options.preconditioning() == NsPreconditioning::kAol) {
    const at::Tensor a = at::empty({batch, rows, rows}, fp32);
    gram32(X, a);
    // The row scaling runs as ATen kernels, on the current stream like everything here.
    std::tie(X, A0) = aol_rescale(X, a, options.eps());
  }

  const NsMethod method = resolve_ns_method(x.size(-2), x.size(-1), options);
  if (method == NsMethod::kStandard) {
    const at::Tensor A = at::empty({batch, rows, rows}, X.options());
    const at::Tensor B = at::empty({batch, rows, rows}, X.options());
    for (size_t i = 0; i < schedule.size(); ++i) {
      const auto& [a, b, c] = schedule[i];
      if (i == 0 && A0.defined()) {
        A.copy_(A0);  // fp32 → compute dtype
      } else {
        gram(X, A);
      }
      copy(Xn, X);
      if (c == 0.0) {
        // Cubic step: Xn = b·A·X + a·X
        apply(static_cast<float>(b), A, X, static_cast<float>(a), Xn);
      } else {
        // B = c·A·A + b·A
        copy(B, A);
        square(gemm, static_cast<float>(c), A, A, static_cast<float>(b), B);
        // Xn = B·X + a·X
        apply(1.0f, B, X, static_cast<float>(a), Xn);
      }
      std::swap(X, Xn);
    }
    return finish_newton_schulz(X, prepared);
  }

  // Gram (docs/DESIGN.md §4, "Gram"), the ATen path's loop with the same operands and order: R,
  // Z and Q in fp32; X, and Q cast to the compute dtype for Q·X, in the compute dtype.
  const auto& restarts = options.gram_restarts();
  const auto restart_at = [&](int64_t i) {
    return std::find(restarts.begin(), restarts.end(), i) != restarts.end();
  };
  at::Tensor R = at::empty({batch, rows, rows}, fp32);
  at::Tensor Rn = at::empty_like(R);
  at::Tensor Q = at::empty_like(R);
  at::Tensor Qn = at::empty_like(R);
  at::Tensor Z = at::empty_like(R);
  const at::Tensor RZ = at::empty_like(R);
  const at::Tensor Qc = at::empty({batch, rows, rows}, X.options());  // Q in the compute dtype
  if (A0.defined()) {
    copy(R, A0);
  } else {
    gram32(X, R);
  }
  bool fresh = true;
  const auto steps = static_cast<int64_t>(schedule.size());
  for (int64_t i = 0; i < steps; ++i) {
    const auto& [a, b, c] = schedule[static_cast<size_t>(i)];
    if (restart_at(i)) {
      Qc.copy_(Q);
      apply(1.0f, Qc, X, 0.0f, Xn);  // X ← Q·X
      std::swap(X, Xn);
      gram32(X, R);
      fresh = true;
    }
    if (c != 0.0) {
      copy(Z, R);
      square(gemm_fp32, static_cast<float>(c), R, R, static_cast<float>(b), Z);  // c·R·R + b·R
    } else {
      at::mul_out(Z, R, b);  // no GEMM for a cubic step
    }
    if (fresh) {
      copy(Q, Z);
      Q.diagonal(0, -2, -1).add_(a);  // Q = Z + a·I
      fresh = false;
    } else {
      copy(Qn, Q);
      square(gemm_fp32, 1.0f, Q, Z, static_cast<float>(a), Qn);  // Qn = Q·Z + a·Q
      std::swap(Q, Qn);
    }
    if (i + 1 < steps && !restart_at(i + 1)) {
      copy(RZ, R);
      square(gemm_fp32, 1.0f, R, Z, static_cast<float>(a), RZ);  // RZ = R·Z + a·R
      copy(Rn, RZ);
      square(gemm_fp32, 1.0f, Z, RZ, static_cast<float>(a), Rn);  // Rn = Z·RZ + a·RZ
      std::swap(R, Rn);
    }
  }
  Qc.copy_(Q);
  apply(1.0f, Qc, X, 0.0f, Xn);  // Q·X
  X = Xn;
  return finish_newton_schulz(X, prepared);
}

}  // namespace fsdp_muon::detail
