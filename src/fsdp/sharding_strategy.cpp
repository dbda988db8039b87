#include <fsdp_muon/fsdp/parameter_group.h>

#include "common/enum_names.h"

namespace fsdp_muon {
namespace {

constexpr detail::EnumName<ShardingStrategy> kStrategyNames[] = {
    {ShardingStrategy::kOptim, "optim"},
    {ShardingStrategy::kOptimGrads, "optim_grads"},
    {ShardingStrategy::kOptimGradsParams, "optim_grads_params"},
};
static_assert(detail::rows_in_enumerator_order(kStrategyNames));

}  // namespace

const char* to_string(ShardingStrategy strategy) {
  return detail::name_of(kStrategyNames, strategy);
}

std::optional<ShardingStrategy> parse_sharding_strategy(std::string_view text) {
  return detail::value_named(kStrategyNames, text);
}

}  // namespace fsdp_muon
