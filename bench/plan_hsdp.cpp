// fsdp_muon_bench --plan-only --hsdp: owner plans on replicate x shard meshes (HSDP) for real
// model shapes, without processes (docs/DESIGN.md §7): kOncePerWorld, kOncePerReplica (what
// Dion and torchtitan do) and the 1-D plan over all ranks, priced by the two-level cost model.

#include <algorithm>
#include <cstdio>
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

using fsdp_muon::MeshShape;
using fsdp_muon::OwnerPlan;
using fsdp_muon::OwnerPlanOptions;
using fsdp_muon::ReplicaNewtonSchulz;

constexpr double kMiB = 1024.0 * 1024.0;

MeshShape parse_mesh(const std::string& text) {
  const size_t x = text.find('x');
  TORCH_CHECK(x != std::string::npos && x > 0 && x + 1 < text.size(), "--meshes: '", text,
              "' is not RxS (replicas x shard size, e.g. 32x8)");
  const int replicas = std::stoi(text.substr(0, x));
  const int shard = std::stoi(text.substr(x + 1));
  TORCH_CHECK(replicas >= 1 && shard >= 1, "--meshes: '", text, "' needs positive sizes");
  return MeshShape{replicas, shard};
}

// The 1-D plan over all W ranks of `mesh` with its bytes split by node (ranks [n*S, (n+1)*S) are
// node n): a piece sent between two nodes is inter-node. Planned as FsdpMuon on a 1-D mesh of W
// ranks plans it; its estimated_seconds() then prices both levels.
OwnerPlan one_dimensional(const ModelShapes& model, MeshShape mesh, int64_t newton_schulz_steps,
                          const OwnerPlanOptions& options, const fsdp_muon::CostRates& rates) {
  const int world = mesh.world_size();
  const auto groups = plan_groups(model, world, newton_schulz_steps);
  OwnerPlan plan = fsdp_muon::plan_owners(groups, world, options, rates);
  plan.inter_node_bytes_per_rank.assign(world, 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t eb = fsdp_muon::detail::group_element_bytes(groups[g], plan);
    for (size_t i = 0; i < groups[g].matrices.size(); ++i) {
      const int o = plan.owner[g][i];
      if (o < 0) continue;
      for (int r = 0; r < world; ++r) {
        if (r / mesh.shard_size == o / mesh.shard_size) continue;
        const int64_t bytes = fsdp_muon::detail::held_numel(groups[g].matrices[i], r) * eb;
        plan.inter_node_bytes_per_rank[r] += bytes;  // r's piece to the owner
        plan.inter_node_bytes_per_rank[o] += bytes;  // and its update back
      }
    }
  }
  return plan;
}

struct Cell {
  double inter_mib, intra_mib, ns_over_floor, ms;
  size_t rounds;
};

// NS critical path over the world's floor: max(total NS FLOPs of the model once / W, the largest
// matrix). kOncePerReplica's total counts every matrix once per replica, so it sits near R.
Cell cell(const OwnerPlan& plan, double world_floor) {
  return {plan.max_inter_node_bytes_per_rank() / kMiB, plan.max_intra_node_bytes_per_rank() / kMiB,
          static_cast<double>(plan.critical_path_planned()) / world_floor,
          plan.estimated_seconds() * 1e3, plan.rounds.size()};
}

std::string show(const Cell& c) {
  return format("%8.1f %8.1f %6.2f %4zu %8.2f", c.inter_mib, c.intra_mib, c.ns_over_floor, c.rounds,
                c.ms);
}

// `plan` in the fewest rounds that fit the budget (what FsdpMuon ran before the cost model chose
// the number of rounds): same owners, rounds packed again.
OwnerPlan fewest_rounds(const std::vector<fsdp_muon::PlanGroup>& groups, const OwnerPlan& plan,
                        const OwnerPlanOptions& options) {
  OwnerPlan fewest = plan;
  const int64_t budget = options.prefetch_budget_bytes();
  fsdp_muon::detail::pack_rounds(groups, options.overlap_communication() ? budget / 2 : budget,
                                 fewest);
  fsdp_muon::detail::finish_rounds(groups.size(), budget, options.overlap_communication(), fewest);
  fsdp_muon::detail::transfer_seconds(groups, fewest);
  return fewest;
}

}  // namespace

int run_plan_hsdp(Flags& flags) {
  const std::vector<std::string> models =
      split_list(flags.get("models", "dense-70b,qwen3-30b-a3b,gpt2"));
  std::vector<MeshShape> meshes;
  for (const std::string& m : split_list(flags.get("meshes", "8x8,32x8,128x8"))) {
    meshes.push_back(parse_mesh(m));
  }
  const int64_t newton_schulz_steps = flags.get_int("ns-steps", 5);
  const OwnerPlanOptions defaults;  // FsdpMuonConfig().planner()
  const fsdp_muon::CostRates rate_defaults;
  const double intra = flags.get_double("intra-gbps", rate_defaults.bytes_per_second() / 1e9) * 1e9;
  const double inter =
      flags.get_double("inter-gbps", rate_defaults.inter_node_bytes_per_second() / 1e9) * 1e9;
  const double flops =
      flags.get_double("ns-tflops", rate_defaults.newton_schulz_flops_per_second() / 1e12) * 1e12;
  flags.finish();
  const OwnerPlanOptions& options = defaults;
  const fsdp_muon::CostRates rates = fsdp_muon::CostRates(rate_defaults)
                                         .newton_schulz_flops_per_second(flops)
                                         .bytes_per_second(intra)
                                         .inter_node_bytes_per_second(inter);
  std::printf(
      "HSDP owner plans (no processes), replicas x shard size, one FSDP group per layer, bf16\n"
      "layout, %lld NS steps, fp32 exchange, OwnerPlanOptions' defaults (policy %s, schedule %s,\n"
      "max_bytes_ratio %s, %lld MiB budget, overlap). Rates: Newton-Schulz %.0f TFLOP/s,\n"
      "within a node %.0f GB/s per rank (H200 NVLink estimate), across nodes %.0f GB/s per rank\n"
      "(InfiniBand estimate: 400 Gb/s per GPU under all-to-all). Per plan, per rank per step:\n"
      "  inter   MiB the busiest rank sends across nodes (replicas)\n"
      "  intra   MiB the busiest rank sends within its node\n"
      "  NS/fl   Newton-Schulz critical path / the world floor max(total once / W, largest\n"
      "          matrix): kOncePerReplica repeats every matrix in each replica\n"
      "  #r      rounds (exchanges) per step\n"
      "  ms      the cost model's prediction: NS path + busiest intra + busiest inter, no overlap\n"
      "Plans: world = kOncePerWorld, replica = kOncePerReplica (Dion / torchtitan), 1-D = FSDP\n"
      "over all W ranks (no mesh; a piece between two nodes counts as inter-node).\n"
      "  by_cost  what kReplicaNewtonSchulz::kByCost (the default) picks, its ms;\n"
      "  /w,r     by_cost ms / the better of world and replica (goal <= 1.00);\n"
      "  /1-D     by_cost ms / 1-D ms (the optimizer step only: HSDP's cheaper gradient\n"
      "           reduction is not in it);\n"
      "  /Dion    by_cost ms / replica ms\n"
      "  rounds   by_cost's rounds and pipelined ms (OwnerPlan::pipelined_seconds: the step's\n"
      "           timeline with overlap, %.0f us per exchange) in the fewest rounds that fit ->\n"
      "           as many as the cost model chose\n",
      static_cast<long long>(newton_schulz_steps), fsdp_muon::to_string(defaults.owner_policy()),
      fsdp_muon::to_string(defaults.owner_schedule()),
      bytes_ratio_name(defaults.max_bytes_ratio()).c_str(),
      static_cast<long long>(defaults.prefetch_budget_bytes() >> 20), flops / 1e12, intra / 1e9,
      inter / 1e9, rates.exchange_latency_seconds() * 1e6);
  const std::string cols = "   inter    intra  NS/fl   #r       ms";
  const auto title = [&](const char* plan) {
    const std::string t = std::string(" ") + plan + " ";
    const size_t pad = cols.size() - t.size();
    return std::string(pad / 2, '-') + t + std::string(pad - pad / 2, '-');
  };
  std::printf("\n%-16s %7s | %s | %s | %s |\n", "", "", title("world").c_str(),
              title("replica").c_str(), title("1-D").c_str());
  std::printf("%-16s %7s |%s |%s |%s | %-16s %8s %6s %6s %6s | %9s %17s\n", "model", "mesh",
              cols.c_str(), cols.c_str(), cols.c_str(), "by_cost", "ms", "/w,r", "/1-D", "/Dion",
              "rounds", "pipelined ms");
  double worst_pipe = 0, best_pipe = 1e300;
  double worst_best = 0, best_dion = 1e300, worst_dion = 0, best_flat = 1e300, worst_flat = 0;
  std::string worst_where;
  for (const std::string& name : models) {
    const ModelShapes model = model_by_name(name);
    for (const MeshShape mesh : meshes) {
      const auto groups = plan_groups(model, mesh.shard_size, newton_schulz_steps);
      const auto with = [&](ReplicaNewtonSchulz mode) {
        return fsdp_muon::plan_owners(groups, mesh,
                                      OwnerPlanOptions(options).replica_newton_schulz(mode), rates);
      };
      const OwnerPlan world = with(ReplicaNewtonSchulz::kOncePerWorld);
      const OwnerPlan replica = with(ReplicaNewtonSchulz::kOncePerReplica);
      const OwnerPlan by_cost = with(ReplicaNewtonSchulz::kByCost);
      const OwnerPlan flat = one_dimensional(model, mesh, newton_schulz_steps, options, rates);
      const double floor = std::max(static_cast<double>(world.total_cost()) / mesh.world_size(),
                                    static_cast<double>(world.largest_matrix_cost()));
      const double chosen = by_cost.estimated_seconds();
      const double over_best =
          chosen / std::min(world.estimated_seconds(), replica.estimated_seconds());
      const double over_flat = chosen / flat.estimated_seconds();
      const double over_dion = chosen / replica.estimated_seconds();
      const std::string mesh_name = format("%dx%d", mesh.replicas, mesh.shard_size);
      const OwnerPlan fewest = fewest_rounds(groups, by_cost, options);
      std::printf(
          "%-16s %7s |%s |%s |%s | %-16s %8.2f %6.2f %6.2f %6.2f | %4zu->%-4zu %8.2f->%-8.2f\n",
          model.name.substr(0, 16).c_str(), mesh_name.c_str(), show(cell(world, floor)).c_str(),
          show(cell(replica, floor)).c_str(), show(cell(flat, floor)).c_str(),
          fsdp_muon::to_string(by_cost.replica_newton_schulz), chosen * 1e3, over_best, over_flat,
          over_dion, fewest.rounds.size(), by_cost.rounds.size(), fewest.pipelined_seconds() * 1e3,
          by_cost.pipelined_seconds() * 1e3);
      worst_pipe = std::max(worst_pipe, by_cost.pipelined_seconds() / fewest.pipelined_seconds());
      best_pipe = std::min(best_pipe, by_cost.pipelined_seconds() / fewest.pipelined_seconds());
      if (over_best > worst_best) {
        worst_best = over_best;
        worst_where = model.name + " " + mesh_name;
      }
      worst_flat = std::max(worst_flat, over_flat);
      best_flat = std::min(best_flat, over_flat);
      best_dion = std::min(best_dion, over_dion);
      worst_dion = std::max(worst_dion, over_dion);
    }
  }
  std::printf(
      "\nheadline: kByCost's predicted optimizer-step time / the better of kOncePerWorld and "
      "kOncePerReplica: worst %.2f (%s); / Dion's and torchtitan's scheme (kOncePerReplica): "
      "%.2f to %.2f; / the 1-D plan over all ranks: %.2f to %.2f; rounds by cost: pipelined "
      "time %.2f to %.2f of the fewest rounds'\n",
      worst_best, worst_where.c_str(), best_dion, worst_dion, best_flat, worst_flat, best_pipe,
      worst_pipe);
  return 0;
}

}  // namespace fsdp_muon_bench
