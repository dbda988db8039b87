// fsdp_muon_bench: FsdpMuon on model-shape presets (launch with torchrun/mpirun), or the owner
// plan alone for real models at large world sizes (--plan-only, no processes).

#include <cstdio>
#include <exception>
#include <string>

#include "bench.h"
#include "bench_util.h"

namespace {
const char* kUsage = R"(usage:
  fsdp_muon_bench --plan-only
                  [--models llama3-8b,qwen3-30b-a3b,gpt2,dense-70b,moe-8x,moe-64x]
                  [--world-sizes 8,16,32,64,128,256] [--prefetch-mib 1024] [--ns-steps 5]
  fsdp_muon_bench --plan-only --hsdp [--models dense-70b,qwen3-30b-a3b,gpt2]
                  [--meshes 8x8,32x8,128x8] [--ns-tflops 400] [--intra-gbps 150]
                  [--inter-gbps 25] [--step-latency-us 6] [--ns-steps 5]
                  (owner plans per ReplicaNewtonSchulz mode, then the whole step: FSDP
                  collectives per sharding strategy + optimizer step, against DMuon)
  fsdp_muon_bench --count-ops [--layers 2] [--scale 16] [--experts 128]
                  (ATen operator calls per FsdpMuon step on the Qwen3-30B-A3B and GPT-2
                  presets, one process)
  torchrun --standalone --no-python --nproc_per_node=W fsdp_muon_bench
                  [--preset llama3-layer|gpt2|moe] [--layers N] [--scale S] [--experts E]
                  [--steps 5] [--warmup 1] [--ns-dtype bf16|fp32]
                  [--policy holders-only|any-rank|balanced] [--schedule rounds|windows]
                  [--prefetch-mib 1024|unlimited]
                  [--threads N] [--compare] [--ns-gflops G] [--gbps B] [--latency-us L]
                  [--shard-size N[,N...]] [--replica-ns world|relay|replica|by_cost[,...]]
  Presets (full size on a GPU; on a CPU --scale defaults to 8 for llama3-layer and moe and
  gpt2 runs 2 layers): gpt2 = GPT-2 124M layers; llama3-layer = one Llama-3-8B layer (widths
  divided by --scale); moe = one Qwen3-30B-A3B layer with --experts experts (default 16).
  --ns-gflops/--gbps/--latency-us: the cost model's rates, which decide how many rounds a step
  has with overlap (default: measured at construction; one given: the plan is made at those
  given and CostRates' defaults for the rest, nothing measured).
  --shard-size N: HSDP, groups sharded over N ranks and replicated over W/N (default: W).
  A list (--shard-size 2,4) measures each mesh in turn in this one run and ends with a table
  of the meshes side by side: bytes per communicator, gradient reduction and step times.
  --replica-ns: on meshes of several replicas, who orthogonalizes (default by_cost); a list
  (world,relay) measures each mode in turn on each such mesh, in the same table.
)";
}  // namespace

int main(int argc, char** argv) {
  return fsdp_muon_bench::run_main(argc, argv, "fsdp_muon_bench", kUsage,
                                   [](fsdp_muon_bench::Flags& flags) {
                                     if (flags.has("plan-only"))
                                       return fsdp_muon_bench::run_plan_only(flags);
                                     if (flags.has("count-ops"))
                                       return fsdp_muon_bench::run_count_ops(flags);
                                     return fsdp_muon_bench::run_measure(flags);
                                   });
}
