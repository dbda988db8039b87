// newton_schulz_methods: Newton–Schulz time per matrix, standard quintic (5 steps) against Gram
// against Gram with AOL preconditioning and one step fewer (Turbo-Muon's 4-step schedule; and
// standard + AOL, and kAuto + AOL), for the distinct
// matrix shapes of GPT-2 124M, Llama-3-8B and Qwen3-30B-A3B (attention, MLP and expert shapes),
// in fp32 and bf16, measured side by side in one run (interleaved, minimum over rounds), each
// with its FLOP count and the worst deviation of its singular values from 1.
//
// On the CPU the widths are divided by --scale (default 8: Llama-3-8B's MLP becomes 512 x 1792;
// the aspect ratios, which decide Gram's saving, are kept). Headline: the best method's time
// against standard quintic on the MLP-shaped matrices (aspect >= 3.5: GPT-2 c_fc / c_proj,
// Llama-3-8B gate / up / down), as a geometric mean, with the σ bands of both.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <fsdp_muon/newton_schulz/newton_schulz.h>

#include "bench_util.h"

namespace fsdp_muon_bench {
namespace {

using fsdp_muon::NewtonSchulzOptions;
using fsdp_muon::NsCoefficients;
using fsdp_muon::NsMethod;
using fsdp_muon::NsPreconditioning;
using Clock = std::chrono::steady_clock;

struct Shape {
  const char* model;
  const char* name;
  int64_t rows;
  int64_t cols;
  bool mlp;  // aspect >= 3.5, counted in the headline
};

// Out x in, as the models register them (full size; divided by --scale).
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> all{
      {"gpt2-124m", "c_attn", 2304, 768, false},
      {"gpt2-124m", "attn.c_proj", 768, 768, false},
      {"gpt2-124m", "c_fc", 3072, 768, true},
      {"gpt2-124m", "mlp.c_proj", 768, 3072, true},
      {"llama3-8b", "q_proj/o_proj", 4096, 4096, false},
      {"llama3-8b", "k_proj/v_proj", 1024, 4096, false},
      {"llama3-8b", "gate/up_proj", 14336, 4096, true},
      {"llama3-8b", "down_proj", 4096, 14336, true},
      {"qwen3-30b-a3b", "q_proj", 4096, 2048, false},
      {"qwen3-30b-a3b", "k_proj/v_proj", 512, 2048, false},
      {"qwen3-30b-a3b", "router", 128, 2048, false},
      {"qwen3-30b-a3b", "expert gate/up", 768, 2048, false},
      {"qwen3-30b-a3b", "expert down", 2048, 768, false},
  };
  return all;
}

struct Method {
  const char* name;
  NewtonSchulzOptions options;
};

std::vector<Method> methods(c10::ScalarType dtype) {
  const auto base =
      NewtonSchulzOptions().coefficients(NsCoefficients::kQuintic).compute_dtype(dtype);
  const auto aol = NewtonSchulzOptions(base)
                       .custom_coefficients({{4.6051, -9.6552, 5.6769},
                                             {4.7505, -6.0861, 2.1790},
                                             {2.7763, -2.3190, 0.5523},
                                             {2.4231, -2.2861, 0.8193}})
                       .steps(4)
                       .preconditioning(NsPreconditioning::kAol);
  return {
      {"standard", NewtonSchulzOptions(base).steps(5)},
      {"gram", NewtonSchulzOptions(base).steps(5).method(NsMethod::kGram)},
      // AOL with one step fewer on Turbo-Muon's schedule (4 steps, README): the validated pair
      // whose worst |σ − 1| is below quintic-5's.
      {"gram+aol(4)", NewtonSchulzOptions(aol).method(NsMethod::kGram)},
      {"std+aol(4)", NewtonSchulzOptions(aol)},
      {"auto+aol(4)", NewtonSchulzOptions(aol).method(NsMethod::kAuto)},
  };
}

void sync(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Seconds per call of each function: minimum over interleaved rounds (one warm-up), at least
// `rounds` rounds.
std::vector<double> time_interleaved(const std::vector<std::function<void()>>& fns,
                                     const c10::Device& device, int rounds) {
  for (const auto& fn : fns) fn();
  sync(device);
  std::vector<double> best(fns.size(), 1e30);
  for (int round = 0; round < rounds; ++round) {
    for (size_t f = 0; f < fns.size(); ++f) {
      const auto t0 = Clock::now();
      fns[f]();
      sync(device);
      best[f] = std::min(best[f], std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  return best;
}

// The smallest and largest singular value of `out` over the directions whose input singular
// value is at least 2% of ‖u‖_F (a Gaussian square matrix has a tail no 5 steps can lift; see
// tests/newton_schulz), and so the worst |σ − 1|.
struct Band {
  double lo = 1e9, hi = 0.0;
  double worst() const { return std::max(1.0 - lo, hi - 1.0); }
  void add(const Band& o) {
    lo = std::min(lo, o.lo);
    hi = std::max(hi, o.hi);
  }
};

// On the matrices' device (a GPU's solver for full-width shapes), in float64.
Band band_of(const at::Tensor& u, const at::Tensor& out) {
  const at::Tensor in_sv = at::linalg_svdvals(u.to(at::kDouble)) / u.to(at::kDouble).norm();
  const at::Tensor out_sv = at::linalg_svdvals(out.to(at::kDouble));
  const int64_t guarded = std::max<int64_t>(1, (in_sv >= 0.02).sum().item<int64_t>());
  return {out_sv[guarded - 1].item<double>(), out_sv.max().item<double>()};
}

int run(Flags& flags) {
  const std::string device_name = flags.get("device", "cpu");
  const bool cuda = device_name == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::printf("newton_schulz_methods: skipped: --device cuda but no CUDA device is visible\n");
    return 0;
  }
  const c10::Device device(cuda ? c10::kCUDA : c10::kCPU, cuda ? 0 : -1);
  const int64_t fp32_scale = flags.get_int("scale", cuda ? 1 : 8);
  // This CPU's bf16 GEMMs run at a few GFLOP/s against tens for fp32 (bench/RESULTS.md), so
  // on the CPU bf16 gets widths halved once more by default to keep the run short.
  const int64_t bf16_scale = flags.get_int("bf16-scale", cuda ? fp32_scale : 2 * fp32_scale);
  const int rounds = static_cast<int>(flags.get_int("rounds", 3));
  const int threads = static_cast<int>(flags.get_int("threads", 1));
  const bool sigma = !flags.has("no-sigma");
  const std::string only = flags.get("models", "gpt2-124m,llama3-8b,qwen3-30b-a3b");
  std::vector<std::string> dtypes_wanted;
  {
    const std::string d = flags.get("dtypes", "fp32,bf16");
    if (d.find("fp32") != std::string::npos) dtypes_wanted.push_back("fp32");
    if (d.find("bf16") != std::string::npos) dtypes_wanted.push_back("bf16");
  }
  flags.finish();
  if (fp32_scale < 1 || bf16_scale < 1) {
    throw std::invalid_argument("--scale and --bf16-scale must be at least 1");
  }
  if (!cuda) at::set_num_threads(threads);

  std::printf(
      "Newton-Schulz per matrix on %s%s, widths / %lld (fp32) and / %lld (bf16), "
      "quintic; min of %d interleaved rounds; sigma = worst |sigma - 1| over input "
      "directions >= 2%% of |U|_F\n",
      cuda ? "CUDA" : "the CPU",
      cuda ? "" : format(" (%d intra-op thread%s)", threads, threads == 1 ? "" : "s").c_str(),
      static_cast<long long>(fp32_scale), static_cast<long long>(bf16_scale), rounds);
  std::printf("%-14s %-15s %11s %6s %5s", "model", "matrix", "shape", "aspect", "dtype");
  const auto names = methods(at::kFloat);
  for (const Method& m : names)
    std::printf(" %12s %6s", (std::string(m.name) + " ms").c_str(), "sigma");
  std::printf("   best/std\n");

  // Per dtype and method: sum of log(time / standard) over the MLP shapes, and their bands.
  for (const std::string& dname : dtypes_wanted) {
    const c10::ScalarType dtype = dname == "bf16" ? at::kBFloat16 : at::kFloat;
    const int64_t scale = dtype == at::kBFloat16 ? bf16_scale : fp32_scale;
    const auto ms = methods(dtype);
    std::vector<double> log_ratio(ms.size(), 0.0);
    std::vector<double> log_flops(ms.size(), 0.0);
    std::vector<Band> mlp_band(ms.size());
    int mlp_count = 0;
    for (const Shape& s : shapes()) {
      if (only.find(s.model) == std::string::npos) continue;
      const int64_t rows = std::max<int64_t>(1, s.rows / scale);
      const int64_t cols = std::max<int64_t>(1, s.cols / scale);
      auto generator = at::make_generator<at::CPUGeneratorImpl>(rows * 7919 + cols);
      const at::Tensor u_cpu = at::randn({rows, cols}, generator);
      const at::Tensor u = u_cpu.to(device);
      std::vector<std::function<void()>> fns;
      for (const Method& m : ms)
        fns.push_back([&u, &m] { (void)fsdp_muon::newton_schulz(u, m.options); });
      const std::vector<double> t = time_interleaved(fns, device, rounds);
      const double aspect = static_cast<double>(std::max(rows, cols)) / std::min(rows, cols);
      std::printf(
          "%-14s %-15s %11s %6.2f %5s", s.model, s.name,
          format("%lldx%lld", static_cast<long long>(rows), static_cast<long long>(cols)).c_str(),
          aspect, dname.c_str());
      size_t best = 0;
      for (size_t i = 0; i < ms.size(); ++i) {
        if (t[i] < t[best]) best = i;
        Band b;
        if (sigma) b = band_of(u, fsdp_muon::newton_schulz(u, ms[i].options));
        if (s.mlp) {
          log_ratio[i] += std::log(t[i] / t[0]);
          log_flops[i] += std::log(fsdp_muon::newton_schulz_flops(rows, cols, ms[i].options) /
                                   fsdp_muon::newton_schulz_flops(rows, cols, ms[0].options));
          mlp_band[i].add(b);
        }
        std::printf(" %12.3f %6s", 1e3 * t[i], sigma ? format("%.3f", b.worst()).c_str() : "-");
      }
      std::printf("   %.2f (%s)\n", t[best] / t[0], ms[best].name);
      mlp_count += s.mlp ? 1 : 0;
    }
    if (mlp_count == 0) continue;
    size_t best = 0;
    for (size_t i = 0; i < ms.size(); ++i) {
      std::printf(
          "MLP-shaped (aspect >= 3.5), %s, %s: %.2fx standard's time (geometric mean of %d), "
          "FLOPs %.2fx, sigma band [%.3f, %.3f]\n",
          dname.c_str(), ms[i].name, std::exp(log_ratio[i] / mlp_count), mlp_count,
          std::exp(log_flops[i] / mlp_count), sigma ? mlp_band[i].lo : 0.0,
          sigma ? mlp_band[i].hi : 0.0);
      if (log_ratio[i] < log_ratio[best]) best = i;
    }
    std::printf(
        "headline %s: Newton-Schulz on MLP-shaped matrices, best method %s at %.2fx "
        "standard quintic's time (goal <= 0.75), sigma band [%.3f, %.3f] vs standard "
        "[%.3f, %.3f]\n",
        dname.c_str(), ms[best].name, std::exp(log_ratio[best] / mlp_count), mlp_band[best].lo,
        mlp_band[best].hi, mlp_band[0].lo, mlp_band[0].hi);
  }
  return 0;
}

}  // namespace
}  // namespace fsdp_muon_bench

int main(int argc, char** argv) {
  return fsdp_muon_bench::run_main(
      argc, argv, "newton_schulz_methods",
      "usage: newton_schulz_methods [--device cpu|cuda] [--scale N] [--bf16-scale N] [--rounds N]\n"
      "         [--threads N]\n"
      "         [--models gpt2-124m,llama3-8b,qwen3-30b-a3b] [--dtypes fp32,bf16] [--no-sigma]\n"
      "Newton-Schulz time per matrix: standard, Gram, Gram+AOL (4 steps), standard+AOL, auto+AOL,\n"
      "side by side for real model shapes (widths divided by --scale; default 8 on the CPU, 1 on\n"
      "CUDA; bf16 by --bf16-scale, default 2 x scale on the CPU), with each method's worst\n"
      "singular-value deviation and the MLP-shaped headline.\n",
      fsdp_muon_bench::run);
}
