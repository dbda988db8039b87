#pragma once
// The CUDA side of the check family (common/check.h): CUDA runtime, cuBLAS, NCCL. Each throws a
// c10::Error carrying the calling API, the file, the line, the failed call and the library's own
// error string.
// Internal header: only compiled into the CUDA build.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon::detail {
const char* cublas_status_string(cublasStatus_t status);
}  // namespace fsdp_muon::detail

#define FSDP_MUON_CHECK_CUDA(expr)                                                                 \
  do {                                                                                             \
    const cudaError_t fsdp_muon_status_ = (expr);                                                  \
    TORCH_CHECK(fsdp_muon_status_ == cudaSuccess, ::fsdp_muon::detail::ApiPrefix{}, __FILE__, ":", \
                __LINE__, ": CUDA call ", #expr,                                                   \
                " failed: ", cudaGetErrorString(fsdp_muon_status_));                               \
  } while (0)

#define FSDP_MUON_CHECK_CUBLAS(expr)                                                          \
  do {                                                                                        \
    const cublasStatus_t fsdp_muon_status_ = (expr);                                          \
    TORCH_CHECK(fsdp_muon_status_ == CUBLAS_STATUS_SUCCESS, ::fsdp_muon::detail::ApiPrefix{}, \
                __FILE__, ":", __LINE__, ": cuBLAS call ", #expr,                             \
                " failed: ", ::fsdp_muon::detail::cublas_status_string(fsdp_muon_status_));   \
  } while (0)

#define FSDP_MUON_CHECK_NCCL(expr)                                                                \
  do {                                                                                            \
    const ncclResult_t fsdp_muon_status_ = (expr);                                                \
    TORCH_CHECK(fsdp_muon_status_ == ncclSuccess || fsdp_muon_status_ == ncclInProgress,          \
                ::fsdp_muon::detail::ApiPrefix{}, __FILE__, ":", __LINE__, ": NCCL call ", #expr, \
                " failed: ", ncclGetErrorString(fsdp_muon_status_));                              \
  } while (0)
