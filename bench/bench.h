#pragma once
// The modes of fsdp_muon_bench.

#include "bench_util.h"

namespace fsdp_muon_bench {

int run_plan_only(Flags& flags);  // --plan-only: owner plans for real models, no processes
int run_measure(Flags& flags);    // default: FsdpMuon steps on the ranks of a launcher

}  // namespace fsdp_muon_bench
