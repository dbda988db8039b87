// The cuBLAS path of newton_schulz: every iteration is three GEMMs (two for a cubic step) and
// two device-to-device copies, all on the caller's current stream through LibTorch's cuBLAS
// handle. a·X and b·A enter as the GEMMs' accumulate (beta) terms, so no elementwise kernel
// runs inside the loop.

#include <climits>
#include <cstdint>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

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
  RowMajorGemm(cublasHandle_t handle, cudaDataType dtype, int64_t batch)
      : handle_(handle), dtype_(dtype), batch_(batch) {}

  // C (M×N, ldc = N) = alpha · op(P) · op(Q) + beta · C, with op(P) M×K and op(Q) K×N; ldp and
  // ldq are the stored row lengths of P and Q, stride_* the distance between batch entries.
  void operator()(bool transpose_p, bool transpose_q, int m, int n, int k, float alpha,
                  const void* p, int ldp, int64_t stride_p, const void* q, int ldq,
                  int64_t stride_q, float beta, void* c, int64_t stride_c) const {
    const cublasOperation_t op_q = transpose_q ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_p = transpose_p ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (batch_ == 1) {
      FSDP_MUON_CHECK_CUBLAS(cublasGemmEx(handle_, op_q, op_p, n, m, k, &alpha, q, dtype_, ldq, p,
                                          dtype_, ldp, &beta, c, dtype_, n, CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT));
    } else {
      FSDP_MUON_CHECK_CUBLAS(cublasGemmStridedBatchedEx(
          handle_, op_q, op_p, n, m, k, &alpha, q, dtype_, ldq, stride_q, p, dtype_, ldp, stride_p,
          &beta, c, dtype_, n, stride_c, static_cast<int>(batch_), CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT));
    }
  }

 private:
  cublasHandle_t handle_;
  cudaDataType dtype_;
  int64_t batch_;
};

}  // namespace

at::Tensor newton_schulz_cuda(const at::Tensor& x, const NewtonSchulzOptions& options) {
  check_newton_schulz_input(x, options);
  TORCH_CHECK(x.is_cuda(), "fsdp_muon::newton_schulz: expected a CUDA tensor, got device ",
              x.device());
  const auto schedule = newton_schulz_schedule(options);
  at::NoGradGuard no_grad;
  if (x.numel() == 0) return at::empty(x.sizes(), x.options());

  // The handle and the stream below belong to the current device; make that x's device.
  const c10::cuda::CUDAGuard device_guard(x.device());
  NsPrepared prepared = prepare_newton_schulz(x, options);
  const int64_t batch = prepared.x.size(0);
  const int64_t rows = prepared.x.size(1);  // m <= n after prepare
  const int64_t cols = prepared.x.size(2);
  TORCH_CHECK(batch <= INT_MAX && rows <= INT_MAX && cols <= INT_MAX && rows * cols <= INT_MAX,
              "fsdp_muon::newton_schulz: matrices of shape ", x.sizes(),
              " exceed the 32-bit sizes of the cuBLAS path");
  const int m = static_cast<int>(rows);
  const int n = static_cast<int>(cols);
  const int64_t x_stride = rows * cols;
  const int64_t a_stride = rows * rows;

  const cudaDataType dtype = options.compute_dtype() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  const size_t element_size = prepared.x.element_size();
  const size_t x_bytes = static_cast<size_t>(batch * x_stride) * element_size;
  const size_t a_bytes = static_cast<size_t>(batch * a_stride) * element_size;

  // LibTorch binds its handle to the current stream; the copies go on that same stream so the
  // whole iteration is ordered with the caller's work and with the caching allocator.
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const HostPointerModeGuard pointer_mode(handle);
  const RowMajorGemm gemm(handle, dtype, batch);

  at::Tensor X = prepared.x;
  at::Tensor Xn = at::empty_like(X);
  const at::Tensor A = at::empty({batch, rows, rows}, X.options());
  const at::Tensor B = at::empty({batch, rows, rows}, X.options());
  for (const auto& [a, b, c] : schedule) {
    // A = X·Xᵀ
    gemm(false, true, m, m, n, 1.0f, X.data_ptr(), n, x_stride, X.data_ptr(), n, x_stride, 0.0f,
         A.data_ptr(), a_stride);
    FSDP_MUON_CHECK_CUDA(
        cudaMemcpyAsync(Xn.data_ptr(), X.data_ptr(), x_bytes, cudaMemcpyDeviceToDevice, stream));
    if (c == 0.0) {
      // Cubic step: Xn = b·A·X + a·X
      gemm(false, false, m, n, m, static_cast<float>(b), A.data_ptr(), m, a_stride, X.data_ptr(), n,
           x_stride, static_cast<float>(a), Xn.data_ptr(), x_stride);
    } else {
      // B = c·A·A + b·A
      FSDP_MUON_CHECK_CUDA(
          cudaMemcpyAsync(B.data_ptr(), A.data_ptr(), a_bytes, cudaMemcpyDeviceToDevice, stream));
      gemm(false, false, m, m, m, static_cast<float>(c), A.data_ptr(), m, a_stride, A.data_ptr(), m,
           a_stride, static_cast<float>(b), B.data_ptr(), a_stride);
      // Xn = B·X + a·X
      gemm(false, false, m, n, m, 1.0f, B.data_ptr(), m, a_stride, X.data_ptr(), n, x_stride,
           static_cast<float>(a), Xn.data_ptr(), x_stride);
    }
    std::swap(X, Xn);
  }
  return finish_newton_schulz(X, prepared);
}

}  // namespace fsdp_muon::detail
