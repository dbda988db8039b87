// fsdp_muon_bench --plan-only --hsdp: owner plans on replicate x shard meshes (HSDP) for real
// model shapes, without processes (docs/DESIGN.md §7): kOncePerWorld, kOncePerReplica (what
// Dion and torchtitan do) and the 1-D plan over all ranks, priced by the two-level cost model.
// Then the whole step (bench/RESULTS.md §10.7): the FSDP collectives of each sharding strategy
// added to each plan, against DMuon's dedicated owners (whole_step.h).

#include <algorithm>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>
#include <fsdp_muon/planning/owner_plan.h>

#include "bench.h"
#include "bench_util.h"
#include "model_shapes.h"
#include "planning/owner_plan_internal.h"
#include "whole_step.h"

namespace fsdp_muon_bench {
namespace {

using fsdp_muon::MeshShape;
using fsdp_muon::OwnerPlan;
using fsdp_muon::OwnerPlanOptions;
using fsdp_muon::ReplicaNewtonSchulz;
using fsdp_muon::ShardingStrategy;

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

// ---- the whole step ----

// The strategy columns: with one micro-batch per step ZeRO-1 and ZeRO-2 send the same bytes
// (ZeRO-2 reduces each group as its backward ends, ZeRO-1 after backward), so one column.
constexpr ShardingStrategy kStrategies[] = {ShardingStrategy::kOptimGrads,
                                            ShardingStrategy::kOptimGradsParams};
constexpr const char* kStrategyNames[] = {"ZeRO-1/2", "ZeRO-3"};
constexpr int kNumStrategies = 2;

// One row of the whole-step table: a mesh and who orthogonalizes on it. Bytes are one rank's
// per step (the optimizer's: the busiest rank's).
struct StepRow {
  std::string scheme;
  bool choice = true;                   // false: a bound, or another row again (not ranked)
  Traffic fsdp[kNumStrategies];         // the FSDP collectives, per kStrategies
  Traffic optimizer;                    // the optimizer step's exchange
  double newton_schulz_seconds = 0;     // its critical path
  double optimizer_seconds = 0;         // Newton–Schulz + exchange, no overlap
  double seconds[kNumStrategies] = {};  // the FSDP collectives + optimizer_seconds
};

// The prices of the whole step: the planner's rates, and the latency of one collective step.
struct StepPrices {
  fsdp_muon::CostRates rates;
  double latency_step_seconds = 0;
};

struct StepBlock {
  std::string model, mesh;
  std::vector<StepRow> rows;
};

// A row whose FSDP collectives are `fsdp`'s and whose optimizer step is `plan`'s.
StepRow plan_row(std::string scheme, const std::function<Traffic(ShardingStrategy)>& fsdp,
                 const OwnerPlan& plan, const StepPrices& prices) {
  const fsdp_muon::CostRates& rates = prices.rates;
  StepRow row;
  row.scheme = std::move(scheme);
  row.optimizer = {static_cast<double>(plan.max_intra_node_bytes_per_rank()),
                   static_cast<double>(plan.max_inter_node_bytes_per_rank())};
  row.newton_schulz_seconds =
      static_cast<double>(plan.critical_path_planned()) / rates.newton_schulz_flops_per_second();
  row.optimizer_seconds = plan.estimated_seconds(rates);
  for (int k = 0; k < kNumStrategies; ++k) {
    row.fsdp[k] = fsdp(kStrategies[k]);
    row.seconds[k] =
        row.fsdp[k].seconds(rates, prices.latency_step_seconds) + row.optimizer_seconds;
  }
  return row;
}

// DMuon's row: no exchange in the step, Newton–Schulz on the dedicated owners.
StepRow dmuon_row(const ModelElements& elements, const DedicatedOwners& owners, MeshShape mesh,
                  const StepPrices& prices) {
  const fsdp_muon::CostRates& rates = prices.rates;
  StepRow row;
  row.scheme = "DMuon";
  row.newton_schulz_seconds =
      static_cast<double>(owners.critical_path) / rates.newton_schulz_flops_per_second();
  row.optimizer_seconds = row.newton_schulz_seconds;
  for (int k = 0; k < kNumStrategies; ++k) {
    row.fsdp[k] = dmuon_traffic(elements, owners, mesh, kStrategies[k]);
    row.seconds[k] =
        row.fsdp[k].seconds(rates, prices.latency_step_seconds) + row.optimizer_seconds;
  }
  return row;
}

// The rows of one model on one mesh: the 1-D mesh over all ranks (ring; the direct bound), HSDP
// under each ReplicaNewtonSchulz mode, DMuon on the same mesh.
StepBlock step_block(const ModelShapes& model, MeshShape mesh,
                     const std::vector<fsdp_muon::PlanGroup>& groups, const OwnerPlan& flat,
                     const OwnerPlan& world, const OwnerPlan& replica, const OwnerPlan& by_cost,
                     const StepPrices& prices) {
  const ModelElements sharded = model_elements(model, mesh.shard_size);
  const ModelElements over_world = model_elements(model, mesh.world_size());
  const auto hsdp = [&](ShardingStrategy s) { return hsdp_fsdp_traffic(sharded, mesh, s); };
  const auto ring = [&](ShardingStrategy s) { return flat_fsdp_traffic_ring(over_world, mesh, s); };
  const auto direct = [&](ShardingStrategy s) {
    return flat_fsdp_traffic_direct(over_world, mesh, s);
  };
  const ReplicaNewtonSchulz picked = by_cost.replica_newton_schulz;
  const bool repeats_a_row = picked == ReplicaNewtonSchulz::kOncePerWorld ||
                             picked == ReplicaNewtonSchulz::kOncePerReplica;
  const char* pick = picked == ReplicaNewtonSchulz::kOncePerWorld     ? "world"
                     : picked == ReplicaNewtonSchulz::kOncePerReplica ? "replica"
                                                                      : "relay";
  StepBlock block{model.name, format("%dx%d", mesh.replicas, mesh.shard_size), {}};
  block.rows.push_back(plan_row("1-D ring", ring, flat, prices));
  block.rows.push_back(plan_row("1-D direct (bound)", direct, flat, prices));
  block.rows.back().choice = false;
  block.rows.push_back(plan_row("HSDP world", hsdp, world, prices));
  block.rows.push_back(plan_row("HSDP replica", hsdp, replica, prices));
  block.rows.push_back(plan_row(std::string("HSDP by_cost=") + pick, hsdp, by_cost, prices));
  // A repeat of the world or replica row is not ranked again; the relay has no row of its own.
  block.rows.back().choice = !repeats_a_row;
  block.rows.push_back(dmuon_row(sharded, dedicated_owners(groups, mesh), mesh, prices));
  return block;
}

// A ranked choice: a row and a strategy column.
struct Choice {
  const StepRow* row = nullptr;
  int strategy = 0;
  double seconds() const { return row->seconds[strategy]; }
  std::string name() const { return row->scheme + " " + kStrategyNames[strategy]; }
};

// The cheapest choice among `strategies` of the block's rows, leaving out `except`'s row.
Choice cheapest(const StepBlock& block, std::initializer_list<int> strategies,
                const StepRow* except = nullptr) {
  Choice best;
  for (const StepRow& row : block.rows) {
    if (!row.choice || &row == except) continue;
    for (const int k : strategies) {
      if (!best.row || row.seconds[k] < best.seconds()) best = {&row, k};
    }
  }
  return best;
}

std::string time_text(double seconds) {
  return seconds >= 1 ? format("%.2f s", seconds) : format("%.2f ms", seconds * 1e3);
}

void print_whole_step(const std::vector<StepBlock>& blocks, const StepPrices& prices) {
  std::printf(
      "\nThe whole step: FSDP collectives + optimizer step, per rank, nodes of S ranks (the shard\n"
      "size), priced with nothing overlapped and no forward/backward compute (what nothing\n"
      "hides): bytes at %.0f GB/s within a node and %.0f GB/s across (the rates above), %.1f us\n"
      "per collective step (--step-latency-us; a ring over n ranks takes n-1 steps per pass, each\n"
      "FSDP group runs its own), the optimizer as OwnerPlan::estimated_seconds. Dtypes: compute\n"
      "bf16 (weights, their all-gathers), reduce_dtype = compute (bf16 reduce-scatter and\n"
      "replica all-reduce), main fp32 (optimizer exchange). One micro-batch per step (ZeRO-1 =\n"
      "ZeRO-2 in bytes; with M, ZeRO-2/3 reduce M times and ZeRO-3 gathers 2M times). Ring\n"
      "collectives: per rank, all-gather/reduce-scatter (n-1)/n of the buffer, all-reduce\n"
      "2(n-1)/n. Models: the presets' layer groups (no embeddings).\n"
      "  1-D ring    FSDP over all W ranks, NCCL rings one per NIC: per gather/reduce-scatter\n"
      "              (W-1)/W of the model, 1/S of it across nodes; optimizer: the 1-D plan\n"
      "  1-D direct  the same, each rank's piece sent to each other rank directly: (W-S)/W\n"
      "              of the model across nodes, the ring's steps (a bound, not ranked)\n"
      "  HSDP        gathers and reduce-scatter within the node ((S-1)/S), the replica\n"
      "              all-reduce of the bf16 shard across (ring: 2(R-1)/R x model/S, 2(R-1)\n"
      "              steps); optimizer:\n"
      "              kOncePerWorld (world), kOncePerReplica (replica), kByCost's pick\n"
      "              (relay: kOncePerWorldRelay, ranked as it has no row of its own)\n"
      "              (a repeat, not ranked)\n"
      "  DMuon       dedicated owners on the same mesh (X-Square-Robot/dmuon, its published\n"
      "              design): matrices whole with their momentum on an owner (LPT by NS cost\n"
      "              over W); forward broadcasts each matrix from its owner's column in every\n"
      "              node ((S-1)/S, bf16), backward reduces the gradient there and across the\n"
      "              column's replicas to the owner, the owner publishes its fp32 master across\n"
      "              the replicas after the step ((R-1)/R x the busiest column's matrices, bf16 +\n"
      "              fp32); no exchange in the step, NS once per world; norms by FSDP2's HSDP.\n"
      "              ZeRO-1/2 = DMuon-Z2, ZeRO-3 = DMuon-Z3 (broadcast again in backward)\n"
      "Columns: per strategy the FSDP collectives' MiB within / across nodes and their latency\n"
      "(steps x --step-latency-us); the optimizer step's exchange MiB (busiest rank), its NS\n"
      "critical path and NS + exchange ms; step ms per strategy; /best: over the block's\n"
      "cheapest ranked choice.\n",
      prices.rates.bytes_per_second() / 1e9, prices.rates.inter_node_bytes_per_second() / 1e9,
      prices.latency_step_seconds * 1e6);
  std::printf("\n%-16s %6s %-20s | %-26s | %-26s | %-35s | %-17s | %-11s\n", "", "", "",
              "ZeRO-1/2 FSDP", "ZeRO-3 FSDP", "optimizer step", "step ms", "/best");
  std::printf("%-16s %6s %-20s | %8s %8s %8s | %8s %8s %8s | %8s %8s %8s %8s | %8s %8s | %5s %5s\n",
              "model", "mesh", "scheme", "intra MiB", "inter", "lat ms", "intra", "inter", "lat ms",
              "intra MiB", "inter", "NS ms", "ms", kStrategyNames[0], kStrategyNames[1], "1/2",
              "3");
  for (const StepBlock& block : blocks) {
    const double best = cheapest(block, {0, 1}).seconds();
    for (const StepRow& r : block.rows) {
      std::printf(
          "%-16s %6s %-20s | %8.0f %8.0f %8.2f | %8.0f %8.0f %8.2f | %8.0f %8.0f %8.2f %8.2f | "
          "%8.2f %8.2f | %5.2f %5.2f\n",
          block.model.substr(0, 16).c_str(), block.mesh.c_str(), r.scheme.c_str(),
          r.fsdp[0].intra / kMiB, r.fsdp[0].inter / kMiB,
          r.fsdp[0].latency_steps * prices.latency_step_seconds * 1e3, r.fsdp[1].intra / kMiB,
          r.fsdp[1].inter / kMiB, r.fsdp[1].latency_steps * prices.latency_step_seconds * 1e3,
          r.optimizer.intra / kMiB, r.optimizer.inter / kMiB, r.newton_schulz_seconds * 1e3,
          r.optimizer_seconds * 1e3, r.seconds[0] * 1e3, r.seconds[1] * 1e3, r.seconds[0] / best,
          r.seconds[1] / best);
    }
  }

  std::printf(
      "\nCheapest whole step per model and mesh, and its margin (x) over the next: the cheapest "
      "of\nanother mesh/mode (its better strategy); the same for ZeRO-3 alone.\n");
  std::printf("%-16s %6s | %-22s %9s | %-22s %9s %6s | %-18s %9s | %-18s %9s %6s\n", "model",
              "mesh", "cheapest", "", "next", "", "x", "cheapest ZeRO-3", "", "next ZeRO-3", "",
              "x");
  std::string headline;
  for (const StepBlock& block : blocks) {
    const Choice first = cheapest(block, {0, 1});
    const Choice next = cheapest(block, {0, 1}, first.row);
    const Choice first3 = cheapest(block, {1});
    const Choice next3 = cheapest(block, {1}, first3.row);
    std::printf("%-16s %6s | %-22s %9s | %-22s %9s %6.2f | %-18s %9s | %-18s %9s %6.2f\n",
                block.model.substr(0, 16).c_str(), block.mesh.c_str(), first.name().c_str(),
                time_text(first.seconds()).c_str(), next.name().c_str(),
                time_text(next.seconds()).c_str(), next.seconds() / first.seconds(),
                first3.row->scheme.c_str(), time_text(first3.seconds()).c_str(),
                next3.row->scheme.c_str(), time_text(next3.seconds()).c_str(),
                next3.seconds() / first3.seconds());
    headline += format("%s%s %s %s %s (%.2fx)", headline.empty() ? "" : "; ", block.model.c_str(),
                       block.mesh.c_str(), first.name().c_str(), time_text(first.seconds()).c_str(),
                       next.seconds() / first.seconds());
  }
  std::printf(
      "\nheadline (whole step): cheapest mesh/mode/strategy per model x mesh (x: the next other "
      "mesh/mode's time over it): %s\n",
      headline.c_str());
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
  // The whole step's latency of one collective step: NCCL's tuning model (src/graph/tuning.cc,
  // hwLat, ring with the Simple protocol of large messages) prices one at 5.7 us over NVLink and
  // 6.6 us over the network.
  const double step_us = flags.get_double("step-latency-us", 6);
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
  std::vector<StepBlock> whole_step;
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
      whole_step.push_back(step_block(model, mesh, groups, flat, world, replica, by_cost,
                                      StepPrices{rates, step_us * 1e-6}));
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
  print_whole_step(whole_step, StepPrices{rates, step_us * 1e-6});
  return 0;
}

}  // namespace fsdp_muon_bench
