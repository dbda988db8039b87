#pragma once
// QK-clip (the MuonClip rule of the Kimi K2 report) on sharded weights (docs/DESIGN.md §2,
// Clipping): after a step, every attention head whose largest pre-softmax logit exceeded the
// threshold τ has its query and key rows scaled down so that the same logit would be τ.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <fsdp_muon/config.h>

namespace fsdp_muon {

class FsdpParameterGroup;  // parameter_group.h (the engine tier)

// One attention layer: where its query and key projections are, as row ranges of weights held by
// FsdpParameterGroups (by the parameter names the groups use). Separate projections have row
// offsets 0; a fused QKV weight [q + 2·kv, d] names itself twice, the keys at offset
// num_heads · head_dim. Head h's query rows are query_row_offset + [h·head_dim, (h+1)·head_dim),
// key head g's rows likewise from key_row_offset.
struct FSDP_MUON_API QkClipLayer {
  QkClipLayer(std::string query_weight, std::string key_weight, int64_t num_heads, int64_t head_dim)
      : query_weight_(std::move(query_weight)),
        key_weight_(std::move(key_weight)),
        num_heads_(num_heads),
        head_dim_(head_dim) {}
  TORCH_ARG(std::string, query_weight);
  TORCH_ARG(int64_t, query_row_offset) = 0;
  TORCH_ARG(std::string, key_weight);
  TORCH_ARG(int64_t, key_row_offset) = 0;
  TORCH_ARG(int64_t, num_heads);
  // Key heads: 0 means num_heads (multi-head attention); fewer (dividing num_heads) means grouped
  // or multi-query attention, heads h·num_kv_heads/num_heads .. sharing one key head.
  TORCH_ARG(int64_t, num_kv_heads) = 0;
  TORCH_ARG(int64_t, head_dim);
  // Optional biases of the projections (""), scaled with their rows so the bound is exact.
  TORCH_ARG(std::string, query_bias) = "";
  TORCH_ARG(std::string, key_bias) = "";
};

struct FSDP_MUON_API QkClipResult {
  // [layers, num_heads] float64: the largest logit of each head over every data-parallel rank.
  at::Tensor max_logits;
  // [layers, num_heads] float64: γ = min(1, τ / max_logit), the factor each head's logits take.
  at::Tensor factors;
  int64_t clipped_heads = 0;
};

// The report's rule, per head h with S = max_logits[layer][h] (all-reduced, max, over the
// groups' communicator inside) and γ = τ / S when S > τ: with a key head of its own, query and
// key rows of h are multiplied by √γ; with a key head shared by several query heads (grouped or
// multi-query), the query rows take all of γ and the key rows stay (the report's rule for its
// shared key). Then the groups holding those weights refresh their model weights. `max_logits` is
// [layers.size(), num_heads] on any device and this rank's own maxima; every rank calls qk_clip
// with the same layers and groups (a collective). Errors name the layer and the fix.
FSDP_MUON_API QkClipResult qk_clip(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                                   const std::vector<QkClipLayer>& layers, double threshold,
                                   const at::Tensor& max_logits);

}  // namespace fsdp_muon
