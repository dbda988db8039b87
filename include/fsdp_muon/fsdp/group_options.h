#pragma once
// FsdpParameterGroupOptions and the sharding strategies (docs/DESIGN.md §2): what a group is
// built with, apart from the group itself (parameter_group.h, the engine tier).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <fsdp_muon/config.h>

namespace fsdp_muon {

// What a group keeps unsharded between uses (docs/DESIGN.md §2, Sharding strategies). The names
// are Megatron-FSDP's; the ZeRO stages they are.
enum class ShardingStrategy {
  // ZeRO-1: full model weights and full gradients persist; only main weights, gradient shards
  // and optimizer state are sharded. Modules may be called directly (no forward() needed).
  kOptim,
  // ZeRO-2: full model weights persist; full gradients live only during the backward of the
  // group (reduce-scattered into the gradient shard as soon as they are complete).
  kOptimGrads,
  // ZeRO-3: full model weights live only inside forward()/backward of the group (or between
  // unshard() and reshard()); full gradients as under kOptimGrads.
  kOptimGradsParams,
};

// "optim", "optim_grads", "optim_grads_params".
FSDP_MUON_API const char* to_string(ShardingStrategy strategy);
// The inverse of to_string(); nullopt for any other text.
FSDP_MUON_API std::optional<ShardingStrategy> parse_sharding_strategy(std::string_view text);

struct FSDP_MUON_API FsdpParameterGroupOptions {
  // dtype of the unsharded model weights the module computes with; default: the parameters'.
  TORCH_ARG(std::optional<c10::ScalarType>, compute_dtype) = std::nullopt;
  // dtype of the sharded main weights optimizers update (and of the gradient shards).
  TORCH_ARG(c10::ScalarType, main_dtype) = at::kFloat;
  // Each parameter starts at a multiple of this many bytes of the compute dtype in the flat
  // buffer.
  TORCH_ARG(int64_t, alignment_bytes) = 16;
  // dtype the gradients are averaged in by reduce_scatter_grads(); default: the compute dtype
  // (least traffic). Set it to the main dtype (e.g. fp32 under bf16 compute) to average in
  // higher precision at the cost of casting the full gradient first and sending more bytes.
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
  // Broadcast the parameters from rank 0 at construction; false when they already agree.
  TORCH_ARG(bool, broadcast_from_rank0) = true;
  // Used in error messages and checkpoints.
  TORCH_ARG(std::string, name) = "";
  // What stays unsharded between uses. kOptim keeps every loop that calls the module directly
  // working; the others need the group's forward() (README, "Sharding strategies").
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kOptim;
  // Overlap communication with compute: forward() all-gathers the next group in forward order
  // while this one computes, backward the previous one, and gradient reduce-scatters run while
  // backward goes on. false: every collective is waited for where it is started. Results are
  // bitwise the same either way.
  TORCH_ARG(bool, prefetch) = true;
};

}  // namespace fsdp_muon
