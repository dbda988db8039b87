#pragma once
// The modes of fsdp_muon_bench.

#include <string>
#include <vector>

#include "bench_util.h"
#include "model_shapes.h"

namespace fsdp_muon_bench {

int run_plan_only(Flags& flags);  // --plan-only: owner plans for real models, no processes
int run_measure(Flags& flags);    // default: FsdpMuon steps on the ranks of a launcher
int run_plan_hsdp(Flags& flags);  // --plan-only --hsdp: plans on replicate x shard meshes
int run_count_ops(Flags& flags);  // --count-ops: ATen calls per FsdpMuon step, one process

// The presets of --models (llama3-8b, qwen3-30b-a3b, gpt2, dense-70b, moe-8x, moe-64x).
ModelShapes model_by_name(const std::string& name);
// "a,b,c" -> {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& list);

}  // namespace fsdp_muon_bench
