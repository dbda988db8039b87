#include <fsdp_muon/fsdp/parameter_group.h>

namespace fsdp_muon {

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kOptim:
      return "optim";
    case ShardingStrategy::kOptimGrads:
      return "optim_grads";
    case ShardingStrategy::kOptimGradsParams:
      return "optim_grads_params";
  }
  return "unknown";
}

std::optional<ShardingStrategy> parse_sharding_strategy(std::string_view text) {
  for (const ShardingStrategy s : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                   ShardingStrategy::kOptimGradsParams}) {
    if (text == to_string(s)) return s;
  }
  return std::nullopt;
}

}  // namespace fsdp_muon
