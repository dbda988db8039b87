// layouts_bench: matrix layouts (docs/DESIGN.md §3, "Layouts") side by side, in one run:
//   1. one Qwen3-30B-A3B MoE layer's experts (gate, up, down) as three batched [E, out, in]
//      tensors against 3·E separate 2-D parameters: the same plan, the same bytes, and
//      FsdpMuon's orthogonalize phase for each;
//   2. the layer's attention as one fused QKV weight [q + 2·kv, d] orthogonalized whole against
//      row_blocks({q, kv, kv}): the Newton–Schulz FLOPs of each and the phase's time.
// Any world size (torchrun); on the CPU the layer is scaled down (as newton_schulz_batching).

#include <algorithm>
#include <cstdio>
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

namespace fsdp_muon_bench {
namespace {

using fsdp_muon::MatrixLayout;
using fsdp_muon::MuonOptions;
using fsdp_muon::NewtonSchulzOptions;

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  int param_group;  // index into the layouts given with the run
};

// One FSDP group of `params` and an FsdpMuon over them with one optimizer group per layout.
struct Run {
  std::shared_ptr<fsdp_muon::FsdpParameterGroup> group;
  std::unique_ptr<fsdp_muon::FsdpMuon> muon;
  double best_seconds = 1e30;  // fastest orthogonalize phase
  int64_t calls = 0, matrices = 0, sent = 0;

  Run(const std::vector<Param>& params, const std::vector<MatrixLayout>& layouts,
      const std::shared_ptr<fsdp_muon::Communicator>& comm, c10::ScalarType newton_schulz_dtype) {
    torch::manual_seed(1);
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const Param& p : params) {
      named.emplace_back(p.name, (at::randn(p.shape) * 0.02).to(comm->device()).requires_grad_());
    }
    group = std::make_shared<fsdp_muon::FsdpParameterGroup>(
        named, comm, fsdp_muon::FsdpParameterGroupOptions().name("layer"));
    std::vector<std::vector<at::Tensor>> members(layouts.size());
    for (size_t i = 0; i < params.size(); ++i) {
      members[params[i].param_group].push_back(group->sharded_parameter(i));
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (size_t g = 0; g < layouts.size(); ++g) {
      if (members[g].empty()) continue;
      groups.emplace_back(
          members[g],
          std::make_unique<MuonOptions>(
              MuonOptions(0.02)
                  .newton_schulz(NewtonSchulzOptions().compute_dtype(newton_schulz_dtype))
                  .matrix_layout(layouts[g])));
    }
    muon = std::make_unique<fsdp_muon::FsdpMuon>(groups);
  }

  void step(bool measured) {
    group->zero_grad();
    group->full_grad_buffer().normal_();
    group->reduce_scatter_grads();
    muon->step();
    if (group->communicator()->device().is_cuda()) torch::cuda::synchronize();
    if (!measured) return;
    const auto& stats = muon->last_step_stats();
    best_seconds = std::min(best_seconds, stats.orthogonalize_seconds);
    calls = stats.newton_schulz_calls;
    matrices = static_cast<int64_t>(muon->matrices().size());
    sent = stats.gather_bytes + stats.scatter_bytes;
  }
};

const char* dtype_name(c10::ScalarType dtype) { return dtype == at::kBFloat16 ? "bf16" : "fp32"; }

// Steps the runs in turn (warm-up first), so that load on the machine hits them alike.
void interleave(std::vector<Run*> runs, int64_t warmup, int64_t steps) {
  for (int64_t s = 0; s < warmup + steps; ++s) {
    for (Run* r : runs) r->step(s >= warmup);
  }
}

int run(Flags& flags) {
  const int64_t threads = flags.get_int("threads", 0);
  const int64_t steps = flags.get_int("steps", 3);
  const int64_t warmup = flags.get_int("warmup", 1);
  const std::string scale_flag = flags.get("scale", "");
  const std::string experts_flag = flags.get("experts", "");
  flags.finish();
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  const auto comm = fsdp_muon::init_from_env();
  const bool cuda = comm->device().is_cuda();
  const int64_t scale = scale_flag.empty() ? (cuda ? 1 : 8) : std::stoll(scale_flag);
  const int64_t experts = experts_flag.empty() ? 128 : std::stoll(experts_flag);
  const int64_t d = 2048 / scale, q = 4096 / scale, kv = 512 / scale, ffn = 768 / scale;
  const bool print = comm->rank() == 0;
  if (print) {
    std::printf(
        "layouts_bench: one Qwen3-30B-A3B layer%s, %lld experts, W=%d on %s, %d intra-op "
        "thread(s), quintic 5 steps; orthogonalize phase = fastest of %lld steps on rank 0\n",
        scale == 1 ? "" : format(" /%lld", static_cast<long long>(scale)).c_str(),
        static_cast<long long>(experts), comm->size(), comm->device().str().c_str(),
        at::get_num_threads(), static_cast<long long>(steps));
  }

  // 1. Experts: batched tensors against separate parameters.
  const std::vector<MatrixLayout> expert_layouts = {MatrixLayout::whole(), MatrixLayout::batched()};
  std::vector<Param> fused = {{"mlp.experts.gate_proj", {experts, ffn, d}, 1},
                              {"mlp.experts.up_proj", {experts, ffn, d}, 1},
                              {"mlp.experts.down_proj", {experts, d, ffn}, 1}};
  std::vector<Param> separate;
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
    for (int64_t e = 0; e < experts; ++e) {
      const bool down = std::string(proj) == "down_proj";
      separate.push_back({"mlp.experts." + std::to_string(e) + "." + proj,
                          down ? std::vector<int64_t>{d, ffn} : std::vector<int64_t>{ffn, d}, 0});
    }
  }
  if (print) {
    std::printf("\n1. experts: 3 batched [E, out, in] tensors vs %lld separate 2-D parameters\n",
                static_cast<long long>(separate.size()));
    std::printf("%-5s %9s %9s %12s %12s %11s %11s %9s\n", "dtype", "matrices", "NS calls",
                "plan FLOPs", "plan bytes", "separate s", "batched s", "batched/");
    std::printf("%-5s %9s %9s %12s %12s %11s %11s %9s\n", "", "sep/bat", "sep/bat", "sep/bat",
                "sep/bat", "", "", "separate");
  }
  double expert_ratio[2] = {0, 0};
  bool same_plan = true;  // the same owners, rounds and bytes for both
  for (c10::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    Run sep(separate, expert_layouts, comm, dtype);
    Run bat(fused, expert_layouts, comm, dtype);
    interleave({&sep, &bat}, warmup, steps);
    const auto& ps = sep.muon->owner_plan();
    const auto& pb = bat.muon->owner_plan();
    expert_ratio[dtype == at::kFloat] = bat.best_seconds / sep.best_seconds;
    bool same_owners = sep.muon->matrices().size() == bat.muon->matrices().size();
    for (size_t k = 0; same_owners && k < sep.muon->matrices().size(); ++k) {
      same_owners = sep.muon->matrices()[k].owner == bat.muon->matrices()[k].owner;
    }
    same_plan = same_plan && same_owners && ps.gather_bytes_per_rank == pb.gather_bytes_per_rank &&
                ps.rounds.size() == pb.rounds.size();
    if (print) {
      std::printf("%-5s %4lld/%-4lld %4lld/%-4lld %5.2f/%-5.2f %5.2f/%-5.2f %11.4f %11.4f %9.2f\n",
                  dtype_name(dtype), static_cast<long long>(sep.matrices),
                  static_cast<long long>(bat.matrices), static_cast<long long>(sep.calls),
                  static_cast<long long>(bat.calls), ps.total_cost() / 1e12, pb.total_cost() / 1e12,
                  ps.max_bytes_per_rank() / 1e6, pb.max_bytes_per_rank() / 1e6, sep.best_seconds,
                  bat.best_seconds, expert_ratio[dtype == at::kFloat]);
      std::printf("      (TFLOPs, MB per rank; bytes sent by rank 0 this step: %lld / %lld)\n",
                  static_cast<long long>(sep.sent), static_cast<long long>(bat.sent));
      std::fflush(stdout);
    }
  }

  // 2. Fused QKV: whole against split into q, k and v.
  const std::vector<MatrixLayout> qkv_layouts = {MatrixLayout::whole(),
                                                 MatrixLayout::row_blocks({q, kv, kv})};
  if (print) {
    std::printf("\n2. fused QKV [%lld, %lld]: whole vs row_blocks{%lld, %lld, %lld}\n",
                static_cast<long long>(q + 2 * kv), static_cast<long long>(d),
                static_cast<long long>(q), static_cast<long long>(kv), static_cast<long long>(kv));
    std::printf("%-5s %12s %12s %9s %10s %10s %9s\n", "dtype", "whole FLOPs", "split FLOPs",
                "split/", "whole s", "split s", "split/");
  }
  double qkv_ratio[2] = {0, 0}, qkv_flops_ratio = 0;
  for (c10::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    Run whole({{"self_attn.qkv_proj", {q + 2 * kv, d}, 0}}, qkv_layouts, comm, dtype);
    Run split({{"self_attn.qkv_proj", {q + 2 * kv, d}, 1}}, qkv_layouts, comm, dtype);
    interleave({&whole, &split}, warmup, steps);
    const double fw = static_cast<double>(whole.muon->owner_plan().total_cost());
    const double fs = static_cast<double>(split.muon->owner_plan().total_cost());
    qkv_flops_ratio = fs / fw;
    qkv_ratio[dtype == at::kFloat] = split.best_seconds / whole.best_seconds;
    if (print) {
      std::printf("%-5s %12.3g %12.3g %9.2f %10.4f %10.4f %9.2f\n", dtype_name(dtype), fw, fs,
                  fs / fw, whole.best_seconds, split.best_seconds, qkv_ratio[dtype == at::kFloat]);
      std::fflush(stdout);
    }
  }
  if (print) {
    std::printf(
        "\nheadline: W=%d, experts batched/separate orthogonalize %.2fx bf16, %.2fx fp32 (%s); "
        "fused QKV split/whole %.2fx bf16, %.2fx fp32 for %.2fx the FLOPs\n",
        comm->size(), expert_ratio[0], expert_ratio[1],
        same_plan ? "same plan and bytes" : "PLANS DIFFER", qkv_ratio[0], qkv_ratio[1],
        qkv_flops_ratio);
  }
  return 0;
}

}  // namespace
}  // namespace fsdp_muon_bench

int main(int argc, char** argv) {
  return fsdp_muon_bench::run_main(
      argc, argv, "layouts_bench",
      "usage: layouts_bench [--experts 128] [--scale S] [--steps 3] [--warmup 1] [--threads T]\n"
      "  any world size (torchrun); CUDA when available (scale 1), else the CPU (scale 8)",
      fsdp_muon_bench::run);
}
