// fsdp_muon_bench --plan-only: the owner plan alone, for real model shapes at large world sizes,
// without processes (docs/DESIGN.md §7).

#include <algorithm>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>
#include <fsdp_muon/planning/owner_plan.h>

#include "bench.h"
#include "bench_util.h"
#include "model_shapes.h"
#include "planning/owner_plan_internal.h"

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
  // The schedule in rounds with this policy, the default budget and overlap.
  double rounds, rounds_over_floor, rounds_bytes_ratio, rounds_held_mib;
  // kBalanced without a byte limit (max_bytes_ratio infinity): critical path / floor, bytes.
  double free_over_floor = 0, free_bytes_ratio = 0;
  // The smallest max_bytes_ratio tried that brings rounds within 1.10x of the floor (0: none),
  // and the busiest rank's bytes / holders-only it then sends.
  double need_ratio = 0, need_bytes_ratio = 0;
  // max_bytes_ratio(kBytesRatioByCost) at the default rates: the limit chosen, rounds / floor,
  // B/min, and the estimated seconds of the orthogonalize critical path plus the busiest rank's
  // bytes, for it and for the default plan.
  double cost_ratio = 0, cost_over_floor = 0, cost_bytes_ratio = 0;
  double cost_seconds = 0, limit15_seconds = 0;
  size_t num_rounds;
};

fsdp_muon::OwnerPlanOptions windows_options(fsdp_muon::OwnerPolicy policy, int64_t budget_bytes) {
  return fsdp_muon::OwnerPlanOptions()
      .owner_policy(policy)
      .owner_schedule(fsdp_muon::OwnerSchedule::kWindows)
      .overlap_communication(false)
      .prefetch_budget_bytes(budget_bytes);
}

Row plan_row(const std::vector<fsdp_muon::PlanGroup>& groups, int world_size,
             fsdp_muon::OwnerPolicy policy, int64_t budget_bytes) {
  const auto plan = [&](const fsdp_muon::OwnerPlanOptions& options) {
    return fsdp_muon::plan_owners(groups, world_size, options);
  };
  const auto unlimited = plan(windows_options(policy, fsdp_muon::kUnlimitedPrefetch));
  const auto one_buffer = plan(windows_options(policy, 0));
  const auto budgeted = plan(windows_options(policy, budget_bytes));
  const fsdp_muon::OwnerPlan rr = round_robin_plan(groups, world_size);
  // What FsdpMuon runs with this policy and budget (the config's defaults otherwise).
  const auto rounds = plan(fsdp_muon::OwnerPlanOptions()
                               .owner_policy(policy)
                               .prefetch_budget_bytes(budget_bytes)
                               .owner_schedule(fsdp_muon::OwnerSchedule::kRounds));
  Row row;
  // seed-1: owners balanced across all groups, but one group run at a time.
  row.seed_budget0 = fsdp_muon::detail::critical_path_ratio_budget0(unlimited);
  row.budget0 = one_buffer.critical_path_ratio_planned();
  row.default_budget = budgeted.critical_path_ratio_planned();
  row.unlimited = unlimited.critical_path_ratio_planned();
  row.rr_budget0 = fsdp_muon::detail::critical_path_ratio_budget0(rr);
  row.rr_unlimited = fsdp_muon::detail::critical_path_ratio_unlimited(rr);
  row.floor = unlimited.floor_ratio();
  row.max_mib = budgeted.max_bytes_per_rank() / kMiB;
  row.mean_mib = mean_bytes(budgeted) / kMiB;
  row.rr_max_mib = rr.max_bytes_per_rank() / kMiB;
  row.rounds = rounds.critical_path_ratio_planned();
  row.rounds_over_floor = row.rounds / rounds.floor_ratio();
  row.rounds_bytes_ratio = rounds.holders_only_max_bytes > 0
                               ? static_cast<double>(rounds.max_bytes_per_rank()) /
                                     static_cast<double>(rounds.holders_only_max_bytes)
                               : 1.0;
  // Held at once: one round, or two where the next is gathered while one is orthogonalized.
  const int64_t held = rounds.max_held_full_bytes();
  row.rounds_held_mib = held / kMiB;
  row.num_rounds = rounds.rounds.size();
  if (policy == fsdp_muon::OwnerPolicy::kBalanced) {
    const auto with_ratio = [&](double ratio) {
      return plan(fsdp_muon::OwnerPlanOptions()
                      .owner_policy(policy)
                      .prefetch_budget_bytes(budget_bytes)
                      .max_bytes_ratio(ratio));
    };
    const auto bytes_ratio = [](const fsdp_muon::OwnerPlan& p) {
      return static_cast<double>(p.max_bytes_per_rank()) /
             static_cast<double>(std::max<int64_t>(p.holders_only_max_bytes, 1));
    };
    const auto free = with_ratio(std::numeric_limits<double>::infinity());
    row.free_over_floor = free.critical_path_ratio_planned() / free.floor_ratio();
    row.free_bytes_ratio = bytes_ratio(free);
    const auto by_cost = with_ratio(fsdp_muon::kBytesRatioByCost);
    row.cost_ratio = by_cost.max_bytes_ratio;
    row.cost_over_floor = by_cost.critical_path_ratio_planned() / by_cost.floor_ratio();
    row.cost_bytes_ratio = bytes_ratio(by_cost);
    row.cost_seconds = by_cost.estimated_seconds();
    row.limit15_seconds = with_ratio(1.5).estimated_seconds();
    for (double ratio : {1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0}) {
      const auto p = with_ratio(ratio);
      if (p.critical_path_ratio_planned() <= 1.10 * p.floor_ratio()) {
        row.need_ratio = ratio;
        row.need_bytes_ratio = bytes_ratio(p);
        break;
      }
    }
  }
  return row;
}

}  // namespace

ModelShapes model_by_name(const std::string& name) {
  if (name == "llama3-8b") return llama3_8b();
  if (name == "qwen3-30b-a3b") return qwen3_30b_a3b();
  if (name == "gpt2") return gpt2_124m();
  if (name == "dense-70b") return dense_70b();
  if (name == "moe-8x") return moe_8_experts();
  if (name == "moe-64x") return moe_64_experts();
  TORCH_CHECK(false, "--models: unknown model '", name,
              "' (known: llama3-8b, qwen3-30b-a3b, gpt2, dense-70b, moe-8x, moe-64x)");
}

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  for (size_t start = 0; start <= list.size();) {
    const size_t comma = std::min(list.find(',', start), list.size());
    items.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return items;
}

int run_plan_only(Flags& flags) {
  if (flags.has("hsdp")) return run_plan_hsdp(flags);
  const std::string models_flag =
      flags.get("models", "llama3-8b,qwen3-30b-a3b,gpt2,dense-70b,moe-8x,moe-64x");
  const std::vector<int64_t> world_sizes = flags.get_ints("world-sizes", {8, 16, 32, 64, 128, 256});
  const int64_t budget_mib = flags.get_int("prefetch-mib", 1024);
  const int64_t newton_schulz_steps = flags.get_int("ns-steps", 5);
  flags.finish();
  TORCH_CHECK(budget_mib >= 0, "--prefetch-mib must be >= 0");
  const std::vector<std::string> models = split_list(models_flag);

  const fsdp_muon::OwnerPlanOptions defaults;  // FsdpMuonConfig().planner()
  const fsdp_muon::CostRates rate_defaults;
  std::printf(
      "Owner plan only (no processes): Newton-Schulz critical path of the orthogonalize phase\n"
      "over the ideal (total NS FLOPs / W), one FSDP group per layer, bf16 layout with 16-byte\n"
      "alignment, %lld NS steps, fp32 gathers. Windows (OwnerSchedule::kWindows, no overlap):\n"
      "  seed-1  the seed: owners balanced over all groups, run one group at a time\n"
      "  1-buf   owners balanced per group, run one group at a time (prefetch budget 0)\n"
      "  %-6s  the prefetch budget (%lld MiB of full matrices per rank)\n"
      "  unlim   unlimited prefetch (every group gathered first)\n"
      "  rr-1/rr-u  round-robin ownership (matrix k -> rank k %% W), 1-buf / unlimited\n"
      "  floor   max(mean, largest single matrix) / mean: no whole-matrix plan beats it\n"
      "  MiB     gather + scatter bytes a rank sends per step under the %s windows'\n"
      "          plan (max and mean over ranks; rr: round-robin, max)\n"
      "Rounds (OwnerSchedule::kRounds, the %s budget, overlap: two rounds in flight, each\n"
      "packed to half the budget; max_bytes_ratio %s for balanced):\n"
      "  rounds  critical path / ideal (sum over rounds of the busiest rank's round)\n"
      "  /floor  rounds / floor (goal: <= 1.10)\n"
      "  B/min   busiest rank's gather + scatter bytes / the holders-only plan's busiest rank\n"
      "  #rnd    rounds (exchanges) per step\n"
      "  heldMiB full-matrix bytes a rank holds at once (two consecutive rounds where they\n"
      "          overlap, which they do only where both fit the budget)\n"
      "  free    balanced without a byte limit (max_bytes_ratio infinity): rounds / floor\n"
      "          and B/min\n"
      "  need    the smallest max_bytes_ratio of 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32 that brings\n"
      "          rounds within 1.10x of the floor, and the B/min it then sends (-: none)\n"
      "  cost    max_bytes_ratio(kBytesRatioByCost): the limit the cost model picks at %.0f\n"
      "          TFLOP/s of Newton-Schulz and %.0f GB/s per rank (estimates for an H200\n"
      "          NVLink node), its rounds / floor and B/min, and the estimated ms of NS critical\n"
      "          path + busiest rank's bytes for the 1.5x limit's plan (the default before the\n"
      "          cost model became it) -> the cost model's plan\n"
      "Default FsdpMuonConfig().planner(): policy %s, schedule %s.\n",
      static_cast<long long>(newton_schulz_steps),
      format("%lldM", static_cast<long long>(budget_mib)).c_str(),
      static_cast<long long>(budget_mib),
      format("%lldM", static_cast<long long>(budget_mib)).c_str(),
      format("%lldM", static_cast<long long>(budget_mib)).c_str(),
      bytes_ratio_name(defaults.max_bytes_ratio()).c_str(),
      rate_defaults.newton_schulz_flops_per_second() / 1e12, rate_defaults.bytes_per_second() / 1e9,
      fsdp_muon::to_string(defaults.owner_policy()),
      fsdp_muon::to_string(defaults.owner_schedule()));

  double worst = 0;
  std::string worst_where;
  double worst_cost = 0, worst_cost_bytes = 0, best_gain = 0;
  for (const auto& name : models) {
    const ModelShapes model = model_by_name(name);
    double total_flops = 0;
    {
      const auto groups = plan_groups(model, 1, newton_schulz_steps);
      for (const auto& g : groups) {
        for (const auto& m : g.matrices) {
          total_flops += fsdp_muon::plan_matrix_flops(m);
        }
      }
    }
    std::printf(
        "\n== %s: %zu groups, %lld matrices, %.2f G matrix elements, %.1f TFLOP of NS "
        "per step\n",
        model.name.c_str(), model.groups.size(), static_cast<long long>(model.num_matrices()),
        model.num_elements() / 1e9, total_flops / 1e12);
    std::printf(
        "%5s %-13s %6s %6s %6s %6s %6s %6s %6s %9s %9s %9s | %6s %6s %5s %5s %8s | %11s | %11s | "
        "%31s\n",
        "W", "policy", "seed-1", "1-buf",
        format("%lldM", static_cast<long long>(budget_mib)).c_str(), "unlim", "rr-1", "rr-u",
        "floor", "MiB max", "MiB mean", "rrMiBmax", "rounds", "/floor", "B/min", "#rnd", "heldMiB",
        "free", "need", "cost: ratio /floor B/min ms->ms");
    for (int64_t w : world_sizes) {
      TORCH_CHECK(w >= 1, "--world-sizes must be positive");
      const auto groups = plan_groups(model, static_cast<int>(w), newton_schulz_steps);
      for (auto policy : {fsdp_muon::OwnerPolicy::kHoldersOnly, fsdp_muon::OwnerPolicy::kAnyRank,
                          fsdp_muon::OwnerPolicy::kBalanced}) {
        const Row r = plan_row(groups, static_cast<int>(w), policy, budget_mib << 20);
        std::printf(
            "%5lld %-13s %6.2f %6.2f %6.2f %6.2f %6.2f %6.2f %6.2f %9.1f %9.1f %9.1f | %6.2f "
            "%6.2f %5.2f %5zu %8.1f | %s | %s | %s\n",
            static_cast<long long>(w), fsdp_muon::to_string(policy), r.seed_budget0, r.budget0,
            r.default_budget, r.unlimited, r.rr_budget0, r.rr_unlimited, r.floor, r.max_mib,
            r.mean_mib, r.rr_max_mib, r.rounds, r.rounds_over_floor, r.rounds_bytes_ratio,
            r.num_rounds, r.rounds_held_mib,
            policy == fsdp_muon::OwnerPolicy::kBalanced
                ? format("%5.2f %5.2f", r.free_over_floor, r.free_bytes_ratio).c_str()
                : "-",
            policy != fsdp_muon::OwnerPolicy::kBalanced ? "-"
            : r.need_ratio > 0 ? format("%5.1f %5.2f", r.need_ratio, r.need_bytes_ratio).c_str()
                               : "none",
            policy == fsdp_muon::OwnerPolicy::kBalanced
                ? format("%5.1f %5.2f %5.2f %6.1f->%6.1f", r.cost_ratio, r.cost_over_floor,
                         r.cost_bytes_ratio, r.limit15_seconds * 1e3, r.cost_seconds * 1e3)
                      .c_str()
                : "-");
        if (policy == fsdp_muon::OwnerPolicy::kBalanced) {
          worst_cost = std::max(worst_cost, r.cost_over_floor);
          worst_cost_bytes = std::max(worst_cost_bytes, r.cost_bytes_ratio);
          best_gain = std::max(best_gain, r.limit15_seconds / r.cost_seconds);
        }
        if (policy == defaults.owner_policy() && r.rounds_over_floor > worst) {
          worst = r.rounds_over_floor;
          worst_where = format("%s at W=%lld (%.2fx ideal, floor %.2fx, bytes %.2fx holders-only)",
                               model.name.c_str(), static_cast<long long>(w), r.rounds, r.floor,
                               r.rounds_bytes_ratio);
        }
      }
    }
  }
  std::printf(
      "\ncost model (max_bytes_ratio(kBytesRatioByCost), H200 estimates): worst rounds / floor "
      "%.2fx, worst B/min %.2fx, estimated NS + bytes time up to %.2fx lower than the 1.5x "
      "limit's\n",
      worst_cost, worst_cost_bytes, best_gain);
  std::printf(
      "\nheadline: default schedule (%s, %s, %lld MiB budget): worst NS critical path / floor "
      "over the table %.2fx, %s\n",
      fsdp_muon::to_string(defaults.owner_schedule()),
      fsdp_muon::to_string(defaults.owner_policy()), static_cast<long long>(budget_mib), worst,
      worst_where.c_str());
  return 0;
}

}  // namespace fsdp_muon_bench
