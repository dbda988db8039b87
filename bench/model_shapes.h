#pragma once
// Parameter shapes of real models, one FSDP group per transformer layer, in the order the
// reference implementations register them (rows = out features, cols = in features). Groups
// include the 1-D norms and biases: they take space in the flat layout and so move the shard
// boundaries, though only the 2-D matrices go to Muon.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_muon_bench {

using NamedShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

struct ModelShapes {
  std::string name;
  std::vector<std::pair<std::string, NamedShapes>> groups;  // (group name, parameters)
  int64_t num_matrices() const;
  int64_t num_elements() const;  // of the 2-D matrices
};

// GPT-2 124M: 12 layers of width 768 (c_attn 2304x768, c_proj, c_fc 3072x768, mlp c_proj).
ModelShapes gpt2_124m(int64_t layers = 12, int64_t width = 768);
// Llama-3-8B: 32 layers, width 4096, 8 KV heads of 128, FFN 14336. `scale` divides every
// width (one layer scaled to fit a CPU run: scale 8 gives width 512, FFN 1792).
ModelShapes llama3_8b(int64_t layers = 32, int64_t scale = 1);
// Qwen3-30B-A3B: 48 layers, width 2048, 32 query and 4 KV heads of 128, a 128x2048 router and
// 128 experts of FFN 768 (gate, up, down) per layer. `experts` and `scale` shrink it.
ModelShapes qwen3_30b_a3b(int64_t layers = 48, int64_t experts = 128, int64_t scale = 1);

// Made-up shapes of model classes the presets above do not cover (docs/DESIGN.md §7):
// dense 70B-class: 80 layers, width 8192, 8 KV heads of 128, FFN 28672 (Llama-3-70B-like).
ModelShapes dense_70b(int64_t layers = 80);
// 8-expert MoE (Mixtral-8x7B-like): 32 layers, width 4096, 8 KV heads of 128, an 8x4096 router
// and 8 experts of FFN 14336 (w1, w3, w2) per layer.
ModelShapes moe_8_experts(int64_t layers = 32);
// Fine-grained 64-expert MoE (DeepSeek-MoE-16B-like): 28 layers, width 2048, 16 heads of 128
// (q, k, v, o all 2048x2048), a 64x2048 router, 2 shared experts of FFN 1408 fused into one
// 2816-wide FFN, and 64 routed experts of FFN 1408 per layer.
ModelShapes moe_64_experts(int64_t layers = 28);

}  // namespace fsdp_muon_bench
