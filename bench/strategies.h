#pragma once
// fsdp_strategies_bench: the sharding strategies (ZeRO-1/2/3) on a GPT-2-shaped model, against
// PyTorch FSDP2 + torch.optim.Muon (bench/peers/fsdp2_muon.py).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "bench_util.h"

namespace fsdp_muon_bench {

// One measured configuration, as the worker prints it ("strategy: key=value ...") and the
// driver parses it back; the peer's line ("peer: ...") has the same form.
using ResultLine = std::map<std::string, std::string>;
ResultLine parse_result_line(const std::string& line, const std::string& prefix);

int run_strategies_worker(Flags& flags);  // --worker: the ranks of one launch, every strategy
int run_strategies_driver(Flags& flags);  // default: launches workers and the peer per W

}  // namespace fsdp_muon_bench
