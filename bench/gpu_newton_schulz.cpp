// gpu_newton_schulz: Newton–Schulz throughput on one GPU against the GEMM rate measured in the
// same run, the library's cuBLAS path against its ATen (addmm) reference path, bf16 and fp32.
// Prints a skip reason and exits 0 when there is no GPU.

#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/newton_schulz/newton_schulz.h>
#include <fsdp_muon/planning/owner_plan.h>

#include "newton_schulz/newton_schulz_internal.h"

#if FSDP_MUON_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  const char* label;
  int64_t batch, rows, cols;
};

// Seconds per call: warm up, then repeat until at least `min_seconds` have passed.
double time_call(const std::function<void()>& fn, double min_seconds) {
  fn();
  torch::cuda::synchronize();
  int reps = 0;
  const auto t0 = Clock::now();
  double elapsed = 0;
  while (reps < 3 || elapsed < min_seconds) {
    fn();
    torch::cuda::synchronize();
    ++reps;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return elapsed / reps;
}

int run(int argc, char** argv) {
  double min_seconds = 0.5;
  int64_t steps = 5;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--min-seconds" && i + 1 < argc) {
      min_seconds = std::stod(argv[++i]);
    } else if (arg == "--steps" && i + 1 < argc) {
      steps = std::stoll(argv[++i]);
    } else {
      std::printf("usage: gpu_newton_schulz [--quick] [--min-seconds 0.5] [--steps 5]\n");
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }
#if !FSDP_MUON_WITH_CUDA
  std::printf("gpu_newton_schulz: skipped: this build of fsdp_muon has no CUDA\n");
  return 0;
#else
  if (!torch::cuda::is_available()) {
    std::printf(
        "gpu_newton_schulz: skipped: no CUDA device visible (torch::cuda::is_available() "
        "is false)\n");
    return 0;
  }
  std::vector<Shape> shapes = {
      {"1024x1024", 1, 1024, 1024},
      {"Llama-3-8B q/o 4096x4096", 1, 4096, 4096},
      {"Llama-3-8B MLP 14336x4096", 1, 14336, 4096},
      {"Qwen3 experts 128x768x2048", 128, 768, 2048},
  };
  if (quick) shapes = {{"1024x1024", 1, 1024, 1024}, {"2048x8192", 1, 2048, 8192}};

  const c10::Device device(c10::kCUDA, 0);
  std::printf("gpu_newton_schulz: %s, %lld quintic steps, input fp32, min %.2f s per timing\n",
              at::cuda::getDeviceProperties(0)->name, static_cast<long long>(steps), min_seconds);
  std::printf("%-28s %5s %9s %9s %6s %9s %6s %8s %9s\n", "shape", "dtype", "GEMM TF/s", "NS cuBLAS",
              "%GEMM", "NS ATen", "%GEMM", "cuBLAS/", "max diff");
  std::printf("%-28s %5s %9s %9s %6s %9s %6s %8s %9s\n", "", "", "(X*X^T)", "TFLOP/s", "",
              "TFLOP/s", "", "ATen", "");
  std::string headline;
  for (const auto& s : shapes) {
    for (c10::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
      const char* dname = dtype == at::kBFloat16 ? "bf16" : "fp32";
      const auto opts = fsdp_muon::NewtonSchulzOptions().steps(steps).compute_dtype(dtype);
      at::Tensor x = s.batch > 1 ? at::randn({s.batch, s.rows, s.cols}, device)
                                 : at::randn({s.rows, s.cols}, device);
      const int64_t m = std::min(s.rows, s.cols), n = std::max(s.rows, s.cols);
      at::Tensor wide = (s.rows <= s.cols ? x : x.transpose(-2, -1)).contiguous().to(dtype);
      const double gemm_flops = 2.0 * m * m * n * s.batch;
      const double t_gemm =
          time_call([&] { (void)at::matmul(wide, wide.transpose(-2, -1)); }, min_seconds);
      const double ns_flops =
          static_cast<double>(fsdp_muon::newton_schulz_flops(s.rows, s.cols, steps)) * s.batch;
      at::Tensor y_cublas, y_aten;
      const double t_cublas = time_call(
          [&] { y_cublas = fsdp_muon::detail::newton_schulz_cuda(x, opts); }, min_seconds);
      const double t_aten =
          time_call([&] { y_aten = fsdp_muon::detail::newton_schulz_aten(x, opts); }, min_seconds);
      const double diff =
          (y_cublas.to(at::kFloat) - y_aten.to(at::kFloat)).abs().max().item<double>();
      const double gemm_rate = gemm_flops / t_gemm, cublas_rate = ns_flops / t_cublas,
                   aten_rate = ns_flops / t_aten;
      std::printf("%-28s %5s %9.1f %9.1f %5.0f%% %9.1f %5.0f%% %8.2f %9.2e\n", s.label, dname,
                  gemm_rate / 1e12, cublas_rate / 1e12, 100 * cublas_rate / gemm_rate,
                  aten_rate / 1e12, 100 * aten_rate / gemm_rate, t_aten / t_cublas, diff);
      std::fflush(stdout);
      if (dtype == at::kBFloat16 && (headline.empty() || s.rows == 14336)) {
        char buf[256];
        std::snprintf(buf, sizeof(buf),
                      "headline: %s bf16: Newton-Schulz (cuBLAS path) %.1f TFLOP/s = %.0f%% of "
                      "the GEMM rate %.1f TFLOP/s; ATen path %.1f TFLOP/s",
                      s.label, cublas_rate / 1e12, 100 * cublas_rate / gemm_rate, gemm_rate / 1e12,
                      aten_rate / 1e12);
        headline = buf;
      }
    }
  }
  std::printf("\n%s\n", headline.c_str());
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_newton_schulz: error: %s\n", e.what());
    return 2;
  }
}
