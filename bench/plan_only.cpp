// fsdp_muon_bench --plan-only: the owner plan alone, for real model shapes at large world sizes,
// without processes (docs/DESIGN.md §7).

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <fsdp_muon/optimizer/owner_plan.h>

#include "bench.h"
#include "bench_util.h"
#include "model_shapes.h"

namespace fsdp_muon_bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

double mean_bytes(const fsdp_muon::OwnerPlan& plan) {
  int64_t total = 0;
  for (int r = 0; r < plan.world_size; ++r) {
    total += plan.gather_bytes_per_rank[r] + plan.scatter_bytes_per_rank[r];
  }
  return static_cast<double>(total) / plan.world_size;
}

struct Row {
  double seed_budget0, budget0, default_budget, unlimited, rr_budget0, rr_unlimited, floor;
  double max_mib, mean_mib, rr_max_mib;
};

fsdp_muon::OwnerPlan plan_with(const std::vector<fsdp_muon::PlanGroup>& groups, int world_size,
                               fsdp_muon::OwnerPolicy policy, int64_t budget_bytes) {
  return fsdp_muon::plan_owners(
      groups, world_size,
      fsdp_muon::OwnerPlanOptions().policy(policy).prefetch_budget_bytes(budget_bytes));
}

Row plan_row(const std::vector<fsdp_muon::PlanGroup>& groups, int world_size,
             fsdp_muon::OwnerPolicy policy, int64_t budget_bytes) {
  const auto unlimited = plan_with(groups, world_size, policy, fsdp_muon::kUnlimitedPrefetch);
  const auto one_buffer = plan_with(groups, world_size, policy, 0);
  const auto budgeted = plan_with(groups, world_size, policy, budget_bytes);
  const fsdp_muon::OwnerPlan rr = round_robin_plan(groups, world_size);
  Row row;
  // seed-1: owners balanced across all groups, but one group run at a time.
  row.seed_budget0 = unlimited.critical_path_ratio_budget0();
  row.budget0 = one_buffer.critical_path_ratio_planned();
  row.default_budget = budgeted.critical_path_ratio_planned();
  row.unlimited = unlimited.critical_path_ratio_planned();
  row.rr_budget0 = rr.critical_path_ratio_budget0();
  row.rr_unlimited = rr.critical_path_ratio_unlimited();
  row.floor = unlimited.floor_ratio();
  row.max_mib = budgeted.max_bytes_per_rank() / kMiB;
  row.mean_mib = mean_bytes(budgeted) / kMiB;
  row.rr_max_mib = rr.max_bytes_per_rank() / kMiB;
  return row;
}

ModelShapes model_by_name(const std::string& name) {
  if (name == "llama3-8b") return llama3_8b();
  if (name == "qwen3-30b-a3b") return qwen3_30b_a3b();
  if (name == "gpt2") return gpt2_124m();
  TORCH_CHECK(false, "--models: unknown model '", name,
              "' (known: llama3-8b, qwen3-30b-a3b, gpt2)");
}

}  // namespace

int run_plan_only(Flags& flags) {
  const std::string models_flag = flags.get("models", "llama3-8b,qwen3-30b-a3b,gpt2");
  const std::vector<int64_t> world_sizes = flags.get_ints("world-sizes", {8, 16, 32, 64, 128, 256});
  const int64_t budget_mib = flags.get_int("prefetch-mib", 1024);
  const int64_t ns_steps = flags.get_int("ns-steps", 5);
  flags.finish();
  TORCH_CHECK(budget_mib >= 0, "--prefetch-mib must be >= 0");
  std::vector<std::string> models;
  for (size_t start = 0; start <= models_flag.size();) {
    const size_t comma = std::min(models_flag.find(',', start), models_flag.size());
    models.push_back(models_flag.substr(start, comma - start));
    start = comma + 1;
  }

  std::printf(
      "Owner plan only (no processes): Newton-Schulz critical path of the orthogonalize phase\n"
      "over the ideal (total NS FLOPs / W), one FSDP group per layer, bf16 layout with 16-byte\n"
      "alignment, %lld NS steps, fp32 gathers. Columns:\n"
      "  seed-1  the seed: owners balanced over all groups, run one group at a time\n"
      "  1-buf   owners balanced per group, run one group at a time (prefetch budget 0)\n"
      "  %-6s  the default prefetch budget (%lld MiB of full matrices per rank)\n"
      "  unlim   unlimited prefetch (every group gathered first)\n"
      "  rr-1/rr-u  round-robin ownership (matrix k -> rank k %% W), 1-buf / unlimited\n"
      "  floor   max(mean, largest single matrix) / mean: no whole-matrix plan beats it\n"
      "  MiB     gather + scatter bytes a rank sends per step under the default budget's\n"
      "          plan (max and mean over ranks; rr: round-robin, max)\n",
      static_cast<long long>(ns_steps), format("%lldM", static_cast<long long>(budget_mib)).c_str(),
      static_cast<long long>(budget_mib));

  std::string headline;
  for (const auto& name : models) {
    const ModelShapes model = model_by_name(name);
    double total_flops = 0;
    {
      const auto groups = plan_groups(model, 1, ns_steps);
      for (const auto& g : groups) {
        for (const auto& m : g.matrices) {
          total_flops += fsdp_muon::newton_schulz_flops(m.rows, m.cols, m.ns_steps);
        }
      }
    }
    std::printf(
        "\n== %s: %zu groups, %lld matrices, %.2f G matrix elements, %.1f TFLOP of NS "
        "per step\n",
        model.name.c_str(), model.groups.size(), static_cast<long long>(model.num_matrices()),
        model.num_elements() / 1e9, total_flops / 1e12);
    std::printf("%5s %-13s %7s %7s %7s %7s %7s %7s %7s %10s %10s %10s\n", "W", "policy", "seed-1",
                "1-buf", format("%lldM", static_cast<long long>(budget_mib)).c_str(), "unlim",
                "rr-1", "rr-u", "floor", "MiB max", "MiB mean", "rr MiB max");
    for (int64_t w : world_sizes) {
      TORCH_CHECK(w >= 1, "--world-sizes must be positive");
      const auto groups = plan_groups(model, static_cast<int>(w), ns_steps);
      for (auto policy : {fsdp_muon::OwnerPolicy::kHoldersOnly, fsdp_muon::OwnerPolicy::kAnyRank}) {
        const Row r = plan_row(groups, static_cast<int>(w), policy, budget_mib << 20);
        std::printf("%5lld %-13s %7.2f %7.2f %7.2f %7.2f %7.2f %7.2f %7.2f %10.1f %10.1f %10.1f\n",
                    static_cast<long long>(w), fsdp_muon::to_string(policy), r.seed_budget0,
                    r.budget0, r.default_budget, r.unlimited, r.rr_budget0, r.rr_unlimited, r.floor,
                    r.max_mib, r.mean_mib, r.rr_max_mib);
        if (name == "llama3-8b" && policy == fsdp_muon::OwnerPolicy::kHoldersOnly &&
            (headline.empty() || w == 64)) {
          headline = format(
              "headline: Llama-3-8B at W=%lld, holders-only: NS critical path / ideal %.2fx "
              "(seed, one buffer at a time) -> %.2fx (per-group plan) -> %.2fx (default "
              "budget) -> %.2fx (unlimited prefetch); round-robin %.2fx / %.2fx; floor %.2fx",
              static_cast<long long>(w), r.seed_budget0, r.budget0, r.default_budget, r.unlimited,
              r.rr_budget0, r.rr_unlimited, r.floor);
        }
      }
    }
  }
  if (!headline.empty()) std::printf("\n%s\n", headline.c_str());
  return 0;
}

}  // namespace fsdp_muon_bench
