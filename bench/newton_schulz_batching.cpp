// newton_schulz_batching: batched against one-by-one Newton–Schulz on the MoE preset (one
// Qwen3-30B-A3B layer; on a CPU scaled down as fsdp_muon_bench scales it), on the CPU or one GPU,
// in one run:
//   1. the kernel: each same-shape class of the layer's matrices orthogonalized one call per
//      matrix and in batches (FsdpMuon's cap of 2^25 elements per call), as rates against a
//      plain GEMM (X·Xᵀ) of one matrix of that shape, and whether every batched matrix has the
//      2-D call's bits;
//   2. FsdpMuon's orthogonalize phase at W=1 with batch_newton_schulz kNever and kAlways, as
//      rates against the GEMM of one expert;
//   3. (--bits) batched against 2-D bits for small and odd shapes (1x7 .. 256x704, batches 1..8),
//      the question docs/DESIGN.md §4 "Batching" leaves open for CUDA;
//   4. the decision for batch_newton_schulz on CUDA from the bits and the phase's rate.
// A single process (a world of one; NCCL on a GPU, Gloo on a CPU).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "bench_util.h"
#include "model_shapes.h"

namespace fsdp_muon_bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kMaxBatchElements = int64_t{1} << 25;  // as FsdpMuon's orthogonalize phase

void sync(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Seconds per call of each function: the minimum over rounds that call every function once in
// turn (after one warm-up round), until `min_seconds` have passed and at least 3 rounds ran. The
// minimum of interleaved calls is what survives other processes sharing the cores.
std::vector<double> time_interleaved(const std::vector<std::function<void()>>& fns,
                                     const c10::Device& device, double min_seconds) {
  for (const auto& fn : fns) fn();
  sync(device);
  std::vector<double> best(fns.size(), 1e30);
  const auto start = Clock::now();
  for (int round = 0;; ++round) {
    for (size_t f = 0; f < fns.size(); ++f) {
      const auto t0 = Clock::now();
      fns[f]();
      sync(device);
      best[f] = std::min(best[f], std::chrono::duration<double>(Clock::now() - t0).count());
    }
    if (round >= 2 && std::chrono::duration<double>(Clock::now() - start).count() >= min_seconds) {
      return best;
    }
  }
}

const char* dtype_name(c10::ScalarType dtype) { return dtype == at::kBFloat16 ? "bf16" : "fp32"; }

// FLOP rate of X·Xᵀ for one rows x cols matrix (wide side last), the product Newton–Schulz
// spends most of its time in.
double gemm_rate(int64_t rows, int64_t cols, c10::ScalarType dtype, const c10::Device& device,
                 double min_seconds) {
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const at::Tensor x = at::randn({m, n}, at::TensorOptions().device(device)).to(dtype);
  const double t = time_interleaved({[&] { (void)at::mm(x, x.t()); }}, device, min_seconds)[0];
  return 2.0 * m * m * n / t;
}

// The batches FsdpMuon would form from `count` matrices of one shape: chunks under the cap.
std::vector<std::pair<int64_t, int64_t>> chunks(int64_t count, int64_t rows, int64_t cols) {
  const int64_t per = std::max<int64_t>(1, kMaxBatchElements / (rows * cols));
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t start = 0; start < count; start += per) {
    out.emplace_back(start, std::min(per, count - start));
  }
  return out;
}

struct KernelRow {
  double one_by_one_rate = 0, batched_rate = 0, gemm = 0;
  int64_t differing = 0, count = 0;
};

KernelRow measure_kernel(int64_t count, int64_t rows, int64_t cols, c10::ScalarType dtype,
                         int64_t steps, const c10::Device& device, double min_seconds) {
  const auto options = fsdp_muon::NewtonSchulzOptions().steps(steps).compute_dtype(dtype);
  const at::Tensor x =
      at::randn({count, rows, cols}, at::TensorOptions().device(device)).mul_(0.02);
  std::vector<at::Tensor> singles(static_cast<size_t>(count));
  const auto parts = chunks(count, rows, cols);
  std::vector<at::Tensor> batched(parts.size());
  const auto one_by_one = [&] {
    for (int64_t i = 0; i < count; ++i) {
      singles[static_cast<size_t>(i)] = fsdp_muon::newton_schulz(x[i], options);
    }
  };
  const auto batch = [&] {
    for (size_t c = 0; c < parts.size(); ++c) {
      batched[c] = fsdp_muon::newton_schulz(x.narrow(0, parts[c].first, parts[c].second), options);
    }
  };
  const std::vector<double> t = time_interleaved({one_by_one, batch}, device, min_seconds);
  const double t_single = t[0], t_batched = t[1];
  KernelRow row;
  row.count = count;
  for (size_t c = 0; c < parts.size(); ++c) {
    for (int64_t i = 0; i < parts[c].second; ++i) {
      const bool same = at::equal(batched[c][i], singles[static_cast<size_t>(parts[c].first + i)]);
      row.differing += same ? 0 : 1;
    }
  }
  const double flops =
      static_cast<double>(fsdp_muon::newton_schulz_flops(rows, cols, steps)) * count;
  row.one_by_one_rate = flops / t_single;
  row.batched_rate = flops / t_batched;
  row.gemm = gemm_rate(rows, cols, dtype, device, min_seconds);
  return row;
}

// One FsdpMuon on its own copy of `model` at W=1.
struct PhaseRun {
  std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>> groups;
  std::unique_ptr<fsdp_muon::FsdpMuon> muon;
  double best_seconds = 1e30;  // fastest orthogonalize phase of a step
  int64_t calls = 0;           // Newton–Schulz calls per step

  PhaseRun(const ModelShapes& model, const std::shared_ptr<fsdp_muon::Communicator>& comm,
           c10::ScalarType dtype, fsdp_muon::NewtonSchulzBatching mode) {
    torch::manual_seed(1);
    std::vector<at::Tensor> matrices;
    for (const auto& [name, shapes] : model.groups) {
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (const auto& [pname, shape] : shapes) {
        named.emplace_back(pname,
                           (at::randn(shape) * 0.02).to(comm->device()).requires_grad_(true));
      }
      groups.push_back(std::make_shared<fsdp_muon::FsdpParameterGroup>(
          named, comm, fsdp_muon::FsdpParameterGroupOptions().name(name)));
      for (size_t i = 0; i < groups.back()->num_parameters(); ++i) {
        if (groups.back()->slot(i).shape.size() == 2) {
          matrices.push_back(groups.back()->sharded_parameter(i));
        }
      }
    }
    muon = std::make_unique<fsdp_muon::FsdpMuon>(
        matrices,
        fsdp_muon::MuonOptions(0.02).newton_schulz(
            fsdp_muon::NewtonSchulzOptions().compute_dtype(dtype)),
        fsdp_muon::FsdpMuonConfig().batch_newton_schulz(mode));
  }

  void step(bool measured) {
    for (const auto& g : groups) {
      g->zero_grad();
      g->full_grad_buffer().normal_();
      g->reduce_scatter_grads();
    }
    muon->step();
    sync(groups.front()->communicator()->device());
    if (!measured) return;
    const auto& stats = muon->last_step_stats();
    best_seconds = std::min(best_seconds, stats.orthogonalize_seconds);
    calls = stats.newton_schulz_calls;
  }
};

// Batched against 2-D bits over small and odd shapes: {matrices compared, matrices differing}.
std::pair<int64_t, int64_t> compare_bits(c10::ScalarType dtype, const c10::Device& device) {
  const std::vector<std::pair<int64_t, int64_t>> shapes{
      {1, 7},   {7, 1},   {3, 5},    {5, 3},    {8, 8},    {16, 24},
      {33, 65}, {64, 64}, {64, 176}, {176, 64}, {96, 256}, {256, 704}};
  const auto options = fsdp_muon::NewtonSchulzOptions().compute_dtype(dtype);
  int64_t compared = 0, differing = 0;
  for (const auto& [rows, cols] : shapes) {
    for (int64_t batch = 1; batch <= 8; ++batch) {
      torch::manual_seed(100 * batch + rows + cols);
      const at::Tensor u = at::randn({batch, rows, cols}, at::TensorOptions().device(device));
      const at::Tensor out = fsdp_muon::newton_schulz(u, options);
      for (int64_t i = 0; i < batch; ++i) {
        ++compared;
        differing += at::equal(out[i], fsdp_muon::newton_schulz(u[i], options)) ? 0 : 1;
      }
    }
  }
  return {compared, differing};
}

int run(int argc, char** argv) {
  Flags flags(argc, argv,
              "usage: newton_schulz_batching [--experts E] [--scale S] [--steps N] [--warmup N]\n"
              "         [--ns-steps 5] [--min-seconds 0.3] [--threads T] [--bits] [--quick]\n"
              "  one process; CUDA when available (scale 1), else the CPU (scale 8)");
  const bool quick = flags.has("quick");
  const bool bits = flags.has("bits");
  const int64_t threads = flags.get_int("threads", 0);
  const int64_t steps = flags.get_int("steps", quick ? 3 : 5);
  const int64_t warmup = flags.get_int("warmup", 1);
  const int64_t newton_schulz_steps = flags.get_int("ns-steps", 5);
  const double min_seconds = flags.get_double("min-seconds", quick ? 0.2 : 0.3);
  const std::string scale_flag = flags.get("scale", "");
  const std::string experts_flag = flags.get("experts", "");
  flags.finish();
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));

  const auto comm = fsdp_muon::init_from_env();
  TORCH_CHECK(comm->size() == 1,
              "newton_schulz_batching runs as one process, got W=", comm->size());
  const c10::Device device = comm->device();
  const int64_t scale = scale_flag.empty() ? (device.is_cuda() ? 1 : 8) : std::stoll(scale_flag);
  const int64_t experts =
      experts_flag.empty() ? (device.is_cuda() ? 128 : 16) : std::stoll(experts_flag);
  const ModelShapes model = qwen3_30b_a3b(1, experts, scale);

  std::printf(
      "newton_schulz_batching: %s, one layer, on %s, %d intra-op thread(s), %lld quintic "
      "steps\n",
      model.name.c_str(), device.str().c_str(), at::get_num_threads(),
      static_cast<long long>(newton_schulz_steps));

  // 1. The kernel, per same-shape class of the layer (classes of one matrix are left out).
  std::map<std::pair<int64_t, int64_t>, int64_t> classes;
  for (const auto& group : model.groups) {
    for (const auto& p : group.second) {
      if (p.second.size() == 2) ++classes[{p.second[0], p.second[1]}];
    }
  }
  std::printf(
      "\n1. Newton-Schulz per shape class: one call per matrix vs batched (<= 2^25 "
      "elements a call); rates as a share of one matrix's X*X^T GEMM rate\n");
  std::printf("%-12s %5s %5s %10s %10s %10s %9s %14s\n", "shape", "count", "dtype", "GEMM GF/s",
              "1-by-1", "batched", "batched/", "batched bits");
  std::printf("%-12s %5s %5s %10s %10s %10s %9s %14s\n", "", "", "", "", "%GEMM", "%GEMM", "1-by-1",
              "== 2-D call");
  double expert_speedup[2] = {0, 0};
  int64_t kernel_differing[2] = {0, 0};  // batched matrices whose bits differ, per dtype
  for (c10::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (const auto& [shape, count] : classes) {
      if (count < 2) continue;
      const KernelRow r = measure_kernel(count, shape.first, shape.second, dtype,
                                         newton_schulz_steps, device, min_seconds);
      const std::string label = format("%lldx%lld", static_cast<long long>(shape.first),
                                       static_cast<long long>(shape.second));
      std::printf("%-12s %5lld %5s %10.1f %9.0f%% %9.0f%% %9.2f %14s\n", label.c_str(),
                  static_cast<long long>(count), dtype_name(dtype), r.gemm / 1e9,
                  100 * r.one_by_one_rate / r.gemm, 100 * r.batched_rate / r.gemm,
                  r.batched_rate / r.one_by_one_rate,
                  r.differing == 0
                      ? "identical"
                      : format("%lld of %lld differ", static_cast<long long>(r.differing),
                               static_cast<long long>(r.count))
                            .c_str());
      std::fflush(stdout);
      kernel_differing[dtype == at::kFloat] += r.differing;
      if (shape.first == 768 / scale) {  // the experts' gate/up projections
        expert_speedup[dtype == at::kFloat] = r.batched_rate / r.one_by_one_rate;
      }
    }
  }

  // 2. FsdpMuon's orthogonalize phase.
  const int64_t ffn = 768 / scale, d = 2048 / scale;
  std::printf(
      "\n2. FsdpMuon orthogonalize phase at W=1 (%lld matrices), batch_newton_schulz "
      "never vs always; rates as a share of one expert's (%lldx%lld) GEMM rate\n",
      static_cast<long long>(model.num_matrices()), static_cast<long long>(ffn),
      static_cast<long long>(d));
  std::printf("%-5s %10s %8s %10s %8s %10s %8s %9s\n", "dtype", "GEMM GF/s", "calls", "never",
              "%GEMM", "always", "%GEMM", "always/");
  std::printf("%-5s %10s %8s %10s %8s %10s %8s %9s\n", "", "(expert)", "nev/alw", "NS GF/s", "",
              "NS GF/s", "", "never");
  double phase_speedup[2] = {0, 0};
  for (c10::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    PhaseRun never_run(model, comm, dtype, fsdp_muon::NewtonSchulzBatching::kNever);
    PhaseRun always_run(model, comm, dtype, fsdp_muon::NewtonSchulzBatching::kAlways);
    for (int64_t s = 0; s < warmup + steps; ++s) {  // interleaved, as the kernel timings
      never_run.step(s >= warmup);
      always_run.step(s >= warmup);
    }
    const double flops = static_cast<double>(never_run.muon->owner_plan().total_cost());
    const double t_never = never_run.best_seconds, t_always = always_run.best_seconds;
    const int64_t calls_never = never_run.calls, calls_always = always_run.calls;
    const double gemm = gemm_rate(ffn, d, dtype, device, min_seconds);
    const double never = flops / t_never;
    const double always = flops / t_always;
    phase_speedup[dtype == at::kFloat] = always / never;
    std::printf("%-5s %10.1f %3lld/%-4lld %10.1f %7.0f%% %10.1f %7.0f%% %9.2f\n", dtype_name(dtype),
                gemm / 1e9, static_cast<long long>(calls_never),
                static_cast<long long>(calls_always), never / 1e9, 100 * never / gemm, always / 1e9,
                100 * always / gemm, always / never);
    std::fflush(stdout);
  }

  // 3. Bits of small and odd shapes.
  std::string bits_summary;
  int64_t bits_differing[2] = {0, 0};
  if (bits) {
    std::printf(
        "\n3. batched vs 2-D call bits, shapes 1x7 .. 256x704, batches 1..8, every "
        "position, on %s\n",
        device.str().c_str());
    for (c10::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
      const auto [compared, differing] = compare_bits(dtype, device);
      bits_differing[dtype == at::kFloat] = differing;
      const std::string verdict =
          differing == 0 ? "identical"
                         : format("%lld of %lld differ", static_cast<long long>(differing),
                                  static_cast<long long>(compared));
      std::printf("%-5s %lld matrices: %s\n", dtype_name(dtype), static_cast<long long>(compared),
                  verdict.c_str());
      bits_summary += format(", %s bits %s", dtype_name(dtype), verdict.c_str());
    }
  }

  // 4. The decision for FsdpMuonConfig::batch_newton_schulz on CUDA (README, "Batched
  // Newton-Schulz on CUDA"): where batching keeps every bit (the layer's classes and, with
  // --bits, the small and odd shapes), kWhereBitwise should batch on CUDA too; where it does not,
  // a phase at least kWorthIt times faster makes kAlways the CUDA default; otherwise one by one.
  constexpr double kWorthIt = 1.10;
  std::string decisions;
  std::printf("\n4. decision for batch_newton_schulz on %s%s\n", device.str().c_str(),
              bits ? "" : " (without --bits: the layer's shapes only)");
  for (c10::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const int i = dtype == at::kFloat;
    const int64_t differing = kernel_differing[i] + bits_differing[i];
    std::string decision;
    if (!device.is_cuda()) {
      decision =
          "none: the decision is for CUDA (on the CPU kWhereBitwise already batches "
          "exactly where the bits are kept)";
    } else if (differing == 0) {
      decision = format(
          "kWhereBitwise: batched bits identical, phase %.2fx; batching on CUDA "
          "keeps single-device Muon's bits, so kWhereBitwise should batch there",
          phase_speedup[i]);
    } else if (phase_speedup[i] >= kWorthIt) {
      decision = format(
          "kAlways: %lld batched matrices differ in their last bits, phase %.2fx >= "
          "%.2fx; the speed is worth the bits on CUDA",
          static_cast<long long>(differing), phase_speedup[i], kWorthIt);
    } else {
      decision = format(
          "kWhereBitwise (one by one on CUDA): %lld batched matrices differ, phase "
          "only %.2fx < %.2fx",
          static_cast<long long>(differing), phase_speedup[i], kWorthIt);
    }
    std::printf("decision: %s %s\n", dtype_name(dtype), decision.c_str());
    if (device.is_cuda()) {
      decisions += format(", decision %s %s", dtype_name(dtype),
                          decision.substr(0, decision.find(':')).c_str());
    }
  }
  bits_summary += decisions;

  std::printf(
      "\nheadline: %s on %s: batched/one-by-one Newton-Schulz on the %lldx%lld experts "
      "%.2fx bf16, %.2fx fp32; FsdpMuon orthogonalize phase %.2fx bf16, %.2fx fp32%s\n",
      model.name.c_str(), device.str().c_str(), static_cast<long long>(ffn),
      static_cast<long long>(d), expert_speedup[0], expert_speedup[1], phase_speedup[0],
      phase_speedup[1], bits_summary.c_str());
  return 0;
}

}  // namespace
}  // namespace fsdp_muon_bench

int main(int argc, char** argv) {
  try {
    return fsdp_muon_bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "newton_schulz_batching: error: %s\n", e.what());
    return 2;
  }
}
