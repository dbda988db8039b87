// fsdp_strategies_bench: the sharding strategies (ZeRO-1, -2, -3) of FsdpParameterGroup on a
// GPT-2-shaped model, prefetch on and off, against PyTorch FSDP2 + torch.optim.Muon.

#include <cstdio>
#include <exception>
#include <string>

#include "bench_util.h"
#include "strategies.h"

namespace {
const char* kUsage = R"(usage:
  fsdp_strategies_bench [--world-sizes 1,2,4] [--shard-size N] [--out-dir DIR] [--python PY]
                        [--peer-script bench/peers/fsdp2_muon.py] [--plot-script bench/plot_memory.py]
                        [model flags] [--threads N]
      For each W: launches `PY -m torch.distributed.run --nproc_per_node=W` on this executable
      (--worker: ours, every strategy, prefetch on and off) and on the peer script (FSDP2 +
      torch.optim.Muon), on the CPU with Gloo, and prints them side by side; writes
      DIR/memory.tsv and DIR/memory.png (default DIR: fsdp_strategies_bench_out). PY defaults to
      $FSDP_MUON_PYTHON (scripts/env.sh). --threads (intra-op threads per rank,
      both sides) defaults to 1: on a loaded 2-core machine two OpenMP threads per rank made
      the Python peer's forward + backward 8x slower (bench/RESULTS.md section 5).
      --shard-size N (default 0: every rank, the 1-D run): HSDP, both sides on a mesh of W / N
      replicas of N shard ranks (FSDP2: init_device_mesh (W/N, N), "replicate" x "shard");
      every W must be a multiple of N, else nothing is launched and the error names both. The
      tables then show the mesh and our bytes per rank per step by communicator, and
      FsdpMuon's replica_newton_schulz choice.
  torchrun --standalone --no-python --nproc_per_node=W fsdp_strategies_bench --worker
                        [model flags] [--strategies optim,optim_grads,optim_grads_params]
                        [--prefetch on,off] [--threads N] [--sequential] [--shard-size N]
      One launch: every strategy on these ranks (a single process works too, e.g. on one GPU,
      where the CUDA caching allocator's peak is reported as well). On a CPU the
      configurations live side by side and take their steps in turn, so that load from
      elsewhere falls on all alike (each one's peak is its own: the others hold still while
      it steps); --sequential, and always on a GPU, runs them one after another.
      --shard-size N: the groups on fsdp_muon::make_device_mesh(comm, N); the run fails (exit
      1, after its table) when a configuration's bytes by communicator are not what the mesh
      and FsdpMuon's plan make them, as it does when final losses differ.
  model flags: [--layers L] [--width D] [--heads H] [--vocab V] [--seq-len T] [--batch B]
               [--steps S] [--warmup N]
      Defaults: on a CPU 4 layers, width 256, 4 heads, vocab 8192, 4 x 128 tokens per rank,
      5 steps after 1 warm-up (about a second per step on 2 cores); on a GPU (--worker)
      GPT-2 124M itself (12 layers, width 768, vocab 50257), 8 x 1024 tokens, 5 steps. Times
      are the median step of each rank, the slowest rank's.
)";
}  // namespace

int main(int argc, char** argv) {
  return fsdp_muon_bench::run_main(argc, argv, "fsdp_strategies_bench", kUsage,
                                   [](fsdp_muon_bench::Flags& flags) {
                                     if (flags.has("worker"))
                                       return fsdp_muon_bench::run_strategies_worker(flags);
                                     return fsdp_muon_bench::run_strategies_driver(flags);
                                   });
}
