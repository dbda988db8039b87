// fsdp_muon_bench (default mode): FsdpMuon steps on model-shape presets, on the ranks of a
// launcher (torchrun, mpirun, srun; a single process works too). Reports per-phase times, the
// Newton-Schulz FLOP rate against a GEMM measured in the same run, balance, bytes against the
// docs/DESIGN.md §7 minimum and transient memory; --compare also times single-device Muon.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "bench.h"
#include "bench_util.h"
#include "model_shapes.h"

namespace fsdp_muon_bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kMiB = 1024.0 * 1024.0;

void sync(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

ModelShapes preset_shapes(const std::string& preset, int64_t layers, int64_t scale,
                          int64_t experts) {
  if (preset == "gpt2") return gpt2_124m(layers > 0 ? layers : 12, 768 / scale);
  if (preset == "llama3-layer") return llama3_8b(layers > 0 ? layers : 1, scale);
  if (preset == "moe") return qwen3_30b_a3b(layers > 0 ? layers : 1, experts, scale);
  TORCH_CHECK(false, "--preset: unknown preset '", preset, "' (gpt2, llama3-layer, moe)");
}

// Per-phase seconds in a fixed order, for cross-rank reductions.
enum Phase {
  kCheck,
  kElementwise,
  kGather,
  kOrthogonalize,
  kScatter,
  kApply,
  kRefresh,
  kStep,
  kReduceScatter,
  kNumPhases
};
const char* kPhaseNames[] = {"check",         "elementwise",  "gather",
                             "orthogonalize", "scatter",      "apply",
                             "refresh",       "step (total)", "grad reduce-scatter"};

// GEMM rate of X·Xᵀ for an m x n matrix in `dtype` (the product Newton–Schulz spends most of its
// time in), measured now on this rank.
double gemm_flops_per_second(int64_t m, int64_t n, c10::ScalarType dtype,
                             const c10::Device& device) {
  const at::Tensor x = at::randn({m, n}, at::TensorOptions().device(device)).to(dtype);
  at::Tensor out = at::mm(x, x.t());
  sync(device);
  int reps = 0;
  const auto t0 = Clock::now();
  double elapsed = 0;
  while (reps < 3 || elapsed < 0.5) {
    out = at::mm(x, x.t());
    sync(device);
    ++reps;
    elapsed = seconds_since(t0);
  }
  return 2.0 * m * m * n * reps / elapsed;
}

// Step time, compute phases (elementwise + orthogonalize + apply), exposed communication (the
// rest) and the agreement check of FsdpMuon configurations on this rank: medians over `steps`
// after `warmup`, so that a step slowed by another process does not count. The configurations
// take turns step by step, so that drift in a shared machine's speed hits them alike.
struct SettingTimes {
  double step = 0, compute = 0, exposed = 0, check = 0;
  // The plan: rounds, and the step time the cost model predicts (OwnerPlan::pipelined_seconds).
  size_t rounds = 0;
  double predicted = 0;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n == 0 ? 0.0 : (n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]));
}

std::vector<SettingTimes> time_settings(
    const std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>>& groups,
    const std::vector<at::Tensor>& matrices, c10::ScalarType newton_schulz_dtype,
    const std::vector<fsdp_muon::FsdpMuonConfig>& configs, int64_t warmup, int64_t steps,
    const c10::Device& device) {
  std::vector<std::unique_ptr<fsdp_muon::FsdpMuon>> optimizers;
  for (const auto& config : configs) {
    optimizers.push_back(std::make_unique<fsdp_muon::FsdpMuon>(
        matrices,
        fsdp_muon::MuonOptions(0.02).newton_schulz(
            fsdp_muon::NewtonSchulzOptions().compute_dtype(newton_schulz_dtype)),
        config));
  }
  // [setting][quantity][step]: step, compute, exposed, check.
  std::vector<std::vector<std::vector<double>>> samples(configs.size(),
                                                        std::vector<std::vector<double>>(4));
  for (int64_t s = 0; s < warmup + steps; ++s) {
    for (size_t k = 0; k < optimizers.size(); ++k) {
      for (const auto& g : groups) {
        g->zero_grad();
        g->full_grad_buffer().normal_();
        g->reduce_scatter_grads();
      }
      sync(device);
      groups.front()->communicator()->barrier();
      const auto t0 = Clock::now();
      optimizers[k]->step();
      sync(device);
      const double step = seconds_since(t0);
      if (s < warmup) continue;
      const auto& st = optimizers[k]->last_step_stats();
      const double compute = st.elementwise_seconds + st.orthogonalize_seconds + st.apply_seconds;
      samples[k][0].push_back(step);
      samples[k][1].push_back(compute);
      samples[k][2].push_back(step - compute);
      samples[k][3].push_back(st.check_seconds);
    }
  }
  std::vector<SettingTimes> times(configs.size());
  for (size_t k = 0; k < configs.size(); ++k) {
    const fsdp_muon::OwnerPlan& plan = optimizers[k]->owner_plan();
    times[k] = {median(samples[k][0]), median(samples[k][1]), median(samples[k][2]),
                median(samples[k][3]), plan.rounds.size(),    plan.pipelined_seconds()};
  }
  return times;
}

// The flags of one run, shared by every mesh it measures.
struct MeasureArgs {
  std::string preset;
  int64_t layers = 0, experts = 16, steps = 5, warmup = 1;
  std::string newton_schulz_dtype_name, policy_name, prefetch, schedule_name, scale_flag;
  bool compare = false;
  std::optional<fsdp_muon::CostRates> rates;  // std::nullopt: measured at construction
  fsdp_muon::ReplicaNewtonSchulz replica_newton_schulz = fsdp_muon::ReplicaNewtonSchulz::kByCost;
};

// One mesh's figures for the side-by-side table (max over ranks; filled on rank 0 only).
struct MeshRow {
  std::string mesh, replica_newton_schulz;
  size_t rounds = 0;
  double optimizer_mib = 0, inter_mib = 0, reduce_shard_mib = 0, reduce_replicate_mib = 0;
  double reduce_ms = 0, step_ms = 0, orthogonalize_ms = 0;
};

// Builds the groups on the mesh of `shard_size` (0: every rank), steps FsdpMuon on them and
// prints the full report; returns the row of the side-by-side table.
MeshRow measure_on_mesh(const MeasureArgs& args,
                        const std::shared_ptr<fsdp_muon::Communicator>& comm, int64_t shard_size) {
  const std::string& preset = args.preset;
  const int64_t layers = args.layers, experts = args.experts, steps = args.steps,
                warmup = args.warmup;
  const std::string &newton_schulz_dtype_name = args.newton_schulz_dtype_name,
                    &policy_name = args.policy_name, &prefetch = args.prefetch,
                    &schedule_name = args.schedule_name, &scale_flag = args.scale_flag;
  const bool compare = args.compare;
  const c10::ScalarType newton_schulz_dtype =
      newton_schulz_dtype_name == "bf16" ? at::kBFloat16 : at::kFloat;
  const c10::Device device = comm->device();
  const int rank = comm->rank(), world = comm->size();
  const fsdp_muon::DeviceMesh mesh =
      shard_size > 0 ? fsdp_muon::make_device_mesh(comm, static_cast<int>(shard_size))
                     : fsdp_muon::one_dimensional_mesh(comm);
  // On a CPU the default presets are scaled down to run in seconds; on a GPU they are full size.
  const int64_t default_scale = device.is_cuda() ? 1 : (preset == "gpt2" ? 1 : 8);
  const int64_t scale = scale_flag.empty() ? default_scale : std::stoll(scale_flag);
  TORCH_CHECK(scale >= 1, "--scale must be >= 1");
  ModelShapes model =
      preset_shapes(preset, layers > 0 ? layers : (preset == "gpt2" && !device.is_cuda() ? 2 : 0),
                    scale, experts);

  if (preset == "gpt2" && model.groups.size() != 12) {
    model.name += format(" (%zu of 12 layers)", model.groups.size());
  }

  // The groups: parameters as a model would hold them, gradients filled at random per rank.
  torch::manual_seed(1);
  std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>> groups;
  std::vector<at::Tensor> matrices;
  for (const auto& [name, shapes] : model.groups) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& [pname, shape] : shapes) {
      named.emplace_back(pname, (at::randn(shape) * 0.02).to(device).requires_grad_(true));
    }
    groups.push_back(std::make_shared<fsdp_muon::FsdpParameterGroup>(
        named, mesh, fsdp_muon::FsdpParameterGroupOptions().name(name)));
    for (size_t i = 0; i < groups.back()->num_parameters(); ++i) {
      if (groups.back()->slot(i).shape.size() == 2) {
        matrices.push_back(groups.back()->sharded_parameter(i));
      }
    }
  }
  const int64_t budget = prefetch == "unlimited" ? fsdp_muon::kUnlimitedPrefetch
                                                 : static_cast<int64_t>(std::stoll(prefetch)) << 20;
  const fsdp_muon::FsdpMuonConfig config =
      fsdp_muon::FsdpMuonConfig()
          .planner(
              fsdp_muon::OwnerPlanOptions()
                  .owner_policy(policy_name == "any-rank"   ? fsdp_muon::OwnerPolicy::kAnyRank
                                : policy_name == "balanced" ? fsdp_muon::OwnerPolicy::kBalanced
                                                            : fsdp_muon::OwnerPolicy::kHoldersOnly)
                  .owner_schedule(schedule_name == "windows" ? fsdp_muon::OwnerSchedule::kWindows
                                                             : fsdp_muon::OwnerSchedule::kRounds)
                  .prefetch_budget_bytes(budget)
                  .replica_newton_schulz(args.replica_newton_schulz))
          .rates(args.rates);
  fsdp_muon::FsdpMuon muon(matrices,
                           fsdp_muon::MuonOptions(0.02).newton_schulz(
                               fsdp_muon::NewtonSchulzOptions().compute_dtype(newton_schulz_dtype)),
                           config);
  const fsdp_muon::OwnerPlan& plan = muon.owner_plan();
  // The plan's ranks: world ranks when owners span the replicas, else shard ranks.
  const int plan_rank = plan.world_size == world ? rank : mesh.shard->rank();

  torch::manual_seed(1000 + rank);
  std::vector<double> sum(kNumPhases, 0.0);
  int64_t gather_bytes = 0, scatter_bytes = 0, transient = 0;
  int64_t inter_bytes = 0, reduce_shard_bytes = 0, reduce_replicate_bytes = 0;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    for (const auto& g : groups) {
      g->zero_grad();
      g->full_grad_buffer().normal_();
    }
    sync(device);
    auto t0 = Clock::now();
    mesh.shard->reset_stats();
    mesh.replicate->reset_stats();
    for (const auto& g : groups) g->reduce_scatter_grads();
    reduce_shard_bytes = mesh.shard->stats().total_bytes();
    reduce_replicate_bytes = mesh.replicate->stats().total_bytes();
    sync(device);
    const double rs = seconds_since(t0);
    t0 = Clock::now();
    muon.step();
    sync(device);
    const double step = seconds_since(t0);
    if (s < warmup) continue;
    const auto& st = muon.last_step_stats();
    const double phases[kNumPhases] = {st.check_seconds,
                                       st.elementwise_seconds,
                                       st.gather_seconds,
                                       st.orthogonalize_seconds,
                                       st.scatter_seconds,
                                       st.apply_seconds,
                                       st.refresh_seconds,
                                       step,
                                       rs};
    for (int p = 0; p < kNumPhases; ++p) sum[p] += phases[p] / steps;
    gather_bytes = st.gather_bytes;
    scatter_bytes = st.scatter_bytes;
    inter_bytes = st.gather_inter_node_bytes + st.scatter_inter_node_bytes;
    transient = std::max(transient, st.max_transient_bytes);
  }

  // GEMM rate of the largest matrix's X·Xᵀ, measured on every rank at once (as NS ran).
  int64_t big_m = 1, big_n = 1;
  for (const auto& group : model.groups) {
    for (const auto& p : group.second) {
      if (p.second.size() != 2) continue;
      const int64_t m = std::min(p.second[0], p.second[1]), n = std::max(p.second[0], p.second[1]);
      if (m * m * n > big_m * big_m * big_n) big_m = m, big_n = n;
    }
  }
  comm->barrier();
  const double gemm_rate = gemm_flops_per_second(big_m, big_n, newton_schulz_dtype, device);

  // Single-device Muon on the same full matrices, every rank at once (what each rank of a
  // replicated data-parallel job would do).
  double muon_step = 0.0;
  if (compare) {
    std::vector<at::Tensor> full;
    torch::manual_seed(1);
    for (const auto& group : model.groups) {
      for (const auto& p : group.second) {
        if (p.second.size() != 2) continue;
        at::Tensor t = (at::randn(p.second) * 0.02).to(device);
        t.mutable_grad() = at::randn_like(t);
        full.push_back(t);
      }
    }
    fsdp_muon::Muon reference(
        full, fsdp_muon::MuonOptions(0.02).newton_schulz(
                  fsdp_muon::NewtonSchulzOptions().compute_dtype(newton_schulz_dtype)));
    comm->barrier();
    for (int64_t s = 0; s < warmup + steps; ++s) {
      sync(device);
      const auto t0 = Clock::now();
      reference.step();
      sync(device);
      if (s >= warmup) muon_step += seconds_since(t0) / steps;
    }
  }

  // Overlap off/on x agreement check on/off, one after the other on the same groups
  // (docs/DESIGN.md §3): exposed communication = step - (elementwise + orthogonalize + apply).
  // The check on is the config's (by default with the non-finite check); off is both off, since
  // the non-finite check needs the agreement.
  std::vector<fsdp_muon::FsdpMuonConfig> settings;
  for (const bool check : {true, false}) {
    for (const bool overlap : {false, true}) {
      fsdp_muon::FsdpMuonConfig setting =
          fsdp_muon::FsdpMuonConfig(config).check_gradient_agreement(check);
      setting.planner().overlap_communication(overlap);
      if (!check) setting.non_finite_gradients(fsdp_muon::NonFiniteGradients::kIgnore);
      settings.push_back(setting);
    }
  }
  // Overlap on, check on, in the fewest rounds that fit the budget (what FsdpMuon ran before the
  // cost model chose the number of rounds): a prohibitive exchange latency, with the other rates
  // those the first optimizer planned with, makes every split cost more than it hides.
  settings.push_back(fsdp_muon::FsdpMuonConfig(config).rates(
      fsdp_muon::CostRates(muon.owner_plan().rates).exchange_latency_seconds(1e3)));
  std::vector<size_t> setting_rounds;
  std::vector<double> setting_predicted;  // the same on every rank (one plan)
  comm->barrier();
  std::vector<double> setting_local;
  for (const SettingTimes& t :
       time_settings(groups, matrices, newton_schulz_dtype, settings, warmup, steps, device)) {
    setting_local.insert(setting_local.end(), {t.step, t.compute, t.exposed, t.check});
    setting_rounds.push_back(t.rounds);
    setting_predicted.push_back(t.predicted);
  }
  at::Tensor setting_max = at::tensor(setting_local, at::kDouble).to(device);
  comm->all_reduce(setting_max, fsdp_muon::ReduceOp::kMax);
  setting_max = setting_max.cpu();

  // Cross-rank: max and mean of every phase, bytes, rates.
  std::vector<double> local(sum);
  local.push_back(static_cast<double>(gather_bytes + scatter_bytes));
  local.push_back(static_cast<double>(plan.gather_bytes_per_rank[plan_rank] +
                                      plan.scatter_bytes_per_rank[plan_rank]));
  local.push_back(static_cast<double>(transient));
  local.push_back(gemm_rate);
  local.push_back(static_cast<double>(plan.cost_per_rank[plan_rank]));
  local.push_back(muon_step);
  local.push_back(static_cast<double>(inter_bytes));
  local.push_back(static_cast<double>(reduce_shard_bytes));
  local.push_back(static_cast<double>(reduce_replicate_bytes));
  const at::Tensor mine = at::tensor(local, at::kDouble).to(device);
  at::Tensor maxes = mine.clone(), sums = mine.clone();
  comm->all_reduce(maxes, fsdp_muon::ReduceOp::kMax);
  comm->all_reduce(sums, fsdp_muon::ReduceOp::kSum);
  // Per-rank measured/minimum bytes, worst rank.
  at::Tensor byte_ratio =
      at::tensor({local[kNumPhases + 1] > 0 ? local[kNumPhases] / local[kNumPhases + 1]
                                            : (local[kNumPhases] > 0 ? 1e9 : 1.0)},
                 at::kDouble)
          .to(device);
  comm->all_reduce(byte_ratio, fsdp_muon::ReduceOp::kMax);
  maxes = maxes.cpu();
  sums = sums.cpu();
  const double worst_byte_ratio = byte_ratio.cpu().item<double>();
  if (rank != 0) return {};

  auto mx = [&](int i) { return maxes[i].item<double>(); };
  auto mean = [&](int i) { return sums[i].item<double>() / world; };
  const double total_flops = static_cast<double>(plan.total_cost());
  const double ortho_sum = sums[kOrthogonalize].item<double>();
  const double ns_rate = ortho_sum > 0 ? total_flops / ortho_sum : 0.0;  // per rank-second
  const double gemm_mean = mean(kNumPhases + 3);

  std::printf(
      "fsdp_muon_bench: %s, %lld groups, %lld matrices (%.1f M elements), W=%d on %s [%s],"
      " NS %s, policy %s, prefetch %s MiB, %lld steps after %lld warm-up\n",
      model.name.c_str(), static_cast<long long>(model.groups.size()),
      static_cast<long long>(model.num_matrices()), model.num_elements() / 1e6, world,
      device.str().c_str(), comm->backend_name().c_str(), newton_schulz_dtype_name.c_str(),
      policy_name.c_str(), prefetch.c_str(), static_cast<long long>(steps),
      static_cast<long long>(warmup));
  std::printf("mesh %s (replicas x shard): %s\n", mesh.shape().c_str(), muon.describe().c_str());
  std::printf(
      "bytes per rank per step (max rank): optimizer %.3f MiB, of it inter-node %.3f MiB; "
      "gradient reduction %.3f MiB in the shard group, %.3f MiB across replicas\n",
      mx(kNumPhases) / kMiB, mx(kNumPhases + 6) / kMiB, mx(kNumPhases + 7) / kMiB,
      mx(kNumPhases + 8) / kMiB);
  if (device.is_cuda()) {
    std::printf(
        "(CUDA: phase times are execution times on the stream, from CUDA events; the step "
        "total is synchronized wall time)\n");
  }
  std::printf("\n%-22s %12s %12s\n", "phase (ms per step)", "max rank", "mean rank");
  for (int p = 0; p < kNumPhases; ++p) {
    std::printf("%-22s %12.3f %12.3f\n", kPhaseNames[p], mx(p) * 1e3, mean(p) * 1e3);
  }
  std::printf("\n%-44s %12s\n", "measure", "value");
  std::printf("%-44s %12.2f\n", "NS GFLOP/s per rank (owned FLOPs / NS time)", ns_rate / 1e9);
  std::printf("%-44s %12.2f\n",
              format("GEMM GFLOP/s per rank (%lldx%lld X*X^T)", static_cast<long long>(big_m),
                     static_cast<long long>(big_n))
                  .c_str(),
              gemm_mean / 1e9);
  std::printf("%-44s %12.2f\n", "NS rate / GEMM rate", gemm_mean > 0 ? ns_rate / gemm_mean : 0.0);
  const double ortho_mean = mean(kOrthogonalize);
  std::printf("%-44s %12.2f\n", "balance: max / mean orthogonalize time",
              ortho_mean > 0 ? mx(kOrthogonalize) / ortho_mean : 1.0);
  std::printf("%-44s %12.2f\n", "plan: NS critical path / ideal (this schedule)",
              plan.critical_path_ratio_planned());
  std::printf("%-44s %12s\n", "plan: rounds (of them overlapping the next)",
              format("%zu (%lld)", plan.rounds.size(),
                     static_cast<long long>(std::count(plan.overlap_with_next.begin(),
                                                       plan.overlap_with_next.end(), true)))
                  .c_str());
  std::printf("%-44s %12.2f\n", "plan: max / mean NS FLOPs per rank",
              total_flops > 0 ? mx(kNumPhases + 4) / (total_flops / world) : 1.0);
  std::printf("%-44s %12.3f\n", "MiB sent per rank, gather + scatter (max)", mx(kNumPhases) / kMiB);
  std::printf("%-44s %12.3f\n", "MiB minimum (DESIGN.md 7) for this plan (max)",
              mx(kNumPhases + 1) / kMiB);
  std::printf("%-44s %12.3f\n", "bytes sent / minimum (worst rank)", worst_byte_ratio);
  std::printf("%-44s %12.3f\n", "transient full-matrix MiB per rank (max)",
              mx(kNumPhases + 2) / kMiB);
  std::printf("\n%-30s %10s %10s %10s %10s\n", "setting (median ms/step, max rank)", "step",
              "compute", "exposed", "check");
  const char* setting_names[] = {"overlap off, check on", "overlap on, check on",
                                 "overlap off, check off", "overlap on, check off",
                                 "overlap on, fewest rounds"};
  for (int k = 0; k < 5; ++k) {
    std::printf(
        "%-30s %10.3f %10.3f %10.3f %10.3f   %zu rounds, predicted %.3f ms\n", setting_names[k],
        setting_max[4 * k].item<double>() * 1e3, setting_max[4 * k + 1].item<double>() * 1e3,
        setting_max[4 * k + 2].item<double>() * 1e3, setting_max[4 * k + 3].item<double>() * 1e3,
        setting_rounds[k], setting_predicted[k] * 1e3);
  }
  std::printf("%-44s %12s\n", "rounds by cost (overlap on, check on)",
              format("%zu -> %zu rounds, %.1f -> %.1f ms", setting_rounds[4], setting_rounds[1],
                     setting_max[16].item<double>() * 1e3, setting_max[4].item<double>() * 1e3)
                  .c_str());
  const double exposed_off = setting_max[2].item<double>();
  const double exposed_on = setting_max[6].item<double>();
  const double check_cost = setting_max[4].item<double>() - setting_max[12].item<double>();
  const double check_phase = setting_max[7].item<double>();
  std::printf("%-44s %12.3f\n", "exposed communication ms, overlap off", exposed_off * 1e3);
  std::printf("%-44s %12.3f\n", "exposed communication ms, overlap on", exposed_on * 1e3);
  std::printf("%-44s %12.3f\n", "agreement check cost ms per step (on - off)", check_cost * 1e3);
  std::printf("%-44s %12.3f\n", "agreement check phase ms per step (overlap on)",
              check_phase * 1e3);
  const double fsdp_step = mx(kStep);
  if (compare) {
    std::printf("%-44s %12.3f\n", "single-device Muon step ms (max rank)",
                mx(kNumPhases + 5) * 1e3);
    std::printf("%-44s %12.3f\n", "FsdpMuon step ms (max rank)", fsdp_step * 1e3);
  }
  std::string headline = format(
      "headline: %s W=%d: FsdpMuon step %.1f ms (orthogonalize %.1f ms max rank), NS %.0f%% of "
      "GEMM rate, bytes %.2fx minimum",
      model.name.c_str(), world, fsdp_step * 1e3, mx(kOrthogonalize) * 1e3,
      gemm_mean > 0 ? 100.0 * ns_rate / gemm_mean : 0.0, worst_byte_ratio);
  headline += format(
      ", exposed communication %.1f -> %.1f ms with overlap, agreement check %.2f ms (phase), "
      "rounds by cost %zu -> %zu: step %.1f -> %.1f ms (exposed %.1f -> %.1f)",
      exposed_off * 1e3, exposed_on * 1e3, check_phase * 1e3, setting_rounds[4], setting_rounds[1],
      setting_max[16].item<double>() * 1e3, setting_max[4].item<double>() * 1e3,
      setting_max[18].item<double>() * 1e3, exposed_on * 1e3);
  if (compare) {
    headline += format(", %.2fx faster than single-device Muon",
                       fsdp_step > 0 ? mx(kNumPhases + 5) / fsdp_step : 0.0);
  }
  std::printf("\n%s\n", headline.c_str());
  MeshRow row;
  row.mesh = mesh.shape();
  row.replica_newton_schulz =
      mesh.replicas() > 1 ? fsdp_muon::to_string(plan.replica_newton_schulz) : "(one replica)";
  row.rounds = plan.rounds.size();
  row.optimizer_mib = mx(kNumPhases) / kMiB;
  row.inter_mib = mx(kNumPhases + 6) / kMiB;
  row.reduce_shard_mib = mx(kNumPhases + 7) / kMiB;
  row.reduce_replicate_mib = mx(kNumPhases + 8) / kMiB;
  row.reduce_ms = mx(kReduceScatter) * 1e3;
  row.step_ms = fsdp_step * 1e3;
  row.orthogonalize_ms = mx(kOrthogonalize) * 1e3;
  return row;
}

// The side-by-side table of the meshes of one run (rank 0).
void print_mesh_table(const std::vector<MeshRow>& rows, int world) {
  std::printf(
      "\nmeshes side by side, W=%d (replicas x shard; max rank; MiB per rank per step; ms per "
      "step):\n",
      world);
  std::printf("%-6s %-20s %6s %11s %9s %12s %12s %10s %10s %10s\n", "mesh", "replica NS", "rounds",
              "optim MiB", "of inter", "grad shard", "grad repl", "grad ms", "NS ms", "step ms");
  for (const MeshRow& r : rows) {
    std::printf("%-6s %-20s %6zu %11.3f %9.3f %12.3f %12.3f %10.1f %10.1f %10.1f\n", r.mesh.c_str(),
                r.replica_newton_schulz.c_str(), r.rounds, r.optimizer_mib, r.inter_mib,
                r.reduce_shard_mib, r.reduce_replicate_mib, r.reduce_ms, r.orthogonalize_ms,
                r.step_ms);
  }
  std::string line = "headline: meshes side by side:";
  for (const MeshRow& r : rows) {
    line += format(" %s %s grad %.1f+%.1f MiB, optimizer %.1f MiB (%.1f inter), step %.1f ms;",
                   r.mesh.c_str(), r.replica_newton_schulz.c_str(), r.reduce_shard_mib,
                   r.reduce_replicate_mib, r.optimizer_mib, r.inter_mib, r.step_ms);
  }
  line.pop_back();
  std::printf("\n%s\n", line.c_str());
}

}  // namespace

int run_measure(Flags& flags) {
  const std::string preset = flags.get("preset", "llama3-layer");
  const int64_t layers = flags.get_int("layers", 0);
  const int64_t experts = flags.get_int("experts", 16);
  const int64_t steps = flags.get_int("steps", 5);
  const int64_t warmup = flags.get_int("warmup", 1);
  const std::string newton_schulz_dtype_name = flags.get("ns-dtype", "bf16");
  const std::string policy_name = flags.get("policy", "holders-only");
  const std::string prefetch = flags.get("prefetch-mib", "1024");
  const std::string schedule_name = flags.get("schedule", "rounds");
  const int64_t threads = flags.get_int("threads", 0);
  // HSDP: groups sharded over this many ranks and replicated over the rest (0: every rank).
  const std::vector<int64_t> shard_sizes = flags.get_ints("shard-size", {0});
  // On meshes of several replicas, who orthogonalizes: one or a list (world,relay), each
  // measured in turn on each mesh of this launch.
  const std::string replica_names = flags.get("replica-ns", "by_cost");
  const bool compare = flags.has("compare");
  const std::string scale_flag = flags.get("scale", "");
  // The cost model's rates, which with overlap decide how many rounds a step has: measured at
  // construction, unless one is given; then the plan is made at those given and CostRates'
  // defaults for the others, and nothing is measured.
  const double absent = std::numeric_limits<double>::quiet_NaN();
  const double ns_gflops = flags.get_double("ns-gflops", absent);
  const double gbps = flags.get_double("gbps", absent);
  const double latency_us = flags.get_double("latency-us", absent);
  std::optional<fsdp_muon::CostRates> rates;
  if (!std::isnan(ns_gflops) || !std::isnan(gbps) || !std::isnan(latency_us)) {
    rates = fsdp_muon::CostRates();
    if (!std::isnan(ns_gflops)) rates->newton_schulz_flops_per_second(ns_gflops * 1e9);
    if (!std::isnan(gbps)) rates->bytes_per_second(gbps * 1e9);
    if (!std::isnan(latency_us)) rates->exchange_latency_seconds(latency_us * 1e-6);
  }
  flags.finish();

  TORCH_CHECK(steps >= 1 && warmup >= 0, "--steps must be >= 1 and --warmup >= 0");
  TORCH_CHECK(newton_schulz_dtype_name == "bf16" || newton_schulz_dtype_name == "fp32",
              "--ns-dtype: bf16 or fp32");
  TORCH_CHECK(
      policy_name == "holders-only" || policy_name == "any-rank" || policy_name == "balanced",
      "--policy: holders-only, any-rank or balanced");
  TORCH_CHECK(schedule_name == "rounds" || schedule_name == "windows",
              "--schedule: rounds or windows");
  TORCH_CHECK(!shard_sizes.empty(), "--shard-size: give one shard size or a list (2,4)");
  std::vector<fsdp_muon::ReplicaNewtonSchulz> replica_modes;
  for (size_t start = 0; start <= replica_names.size();) {
    const size_t comma = std::min(replica_names.find(',', start), replica_names.size());
    const std::string name = replica_names.substr(start, comma - start);
    using R = fsdp_muon::ReplicaNewtonSchulz;
    TORCH_CHECK(name == "world" || name == "relay" || name == "replica" || name == "by_cost",
                "--replica-ns: world, relay, replica or by_cost (or a list of them), got '", name,
                "'");
    replica_modes.push_back(name == "world"     ? R::kOncePerWorld
                            : name == "relay"   ? R::kOncePerWorldRelay
                            : name == "replica" ? R::kOncePerReplica
                                                : R::kByCost);
    start = comma + 1;
  }
  for (const int64_t shard_size : shard_sizes) {
    TORCH_CHECK(shard_size >= 0, "--shard-size must be >= 1 (0: every rank), got ", shard_size);
  }
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));

  const auto comm = fsdp_muon::init_from_env();
  MeasureArgs args{
      preset,      layers,   experts,       steps,      warmup,  newton_schulz_dtype_name,
      policy_name, prefetch, schedule_name, scale_flag, compare, rates};
  // Several shard sizes (and replica modes) run one after the other in this process, each with
  // its own groups and optimizer, so that their figures come from the same launch and the same
  // machine state. A mesh of one replica has no replica mode: it runs once.
  std::vector<MeshRow> rows;
  for (const int64_t shard_size : shard_sizes) {
    const bool replicated = shard_size > 0 && shard_size < comm->size();
    for (size_t m = 0; m < (replicated ? replica_modes.size() : 1); ++m) {
      if (!rows.empty() && comm->rank() == 0) std::printf("\n");
      args.replica_newton_schulz = replica_modes[m];
      rows.push_back(measure_on_mesh(args, comm, shard_size));
    }
  }
  if (rows.size() > 1 && comm->rank() == 0) print_mesh_table(rows, comm->size());
  return 0;
}

}  // namespace fsdp_muon_bench
