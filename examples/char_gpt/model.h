#pragma once
// A small GPT-style character language model: token and position embeddings, pre-norm
// transformer blocks (causal self-attention, then a GELU MLP), a final norm and a linear head.

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

namespace char_gpt {

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t seq_len = 64;
  int64_t d_model = 96;
  int64_t n_layers = 3;
  int64_t n_heads = 4;
  // 0: a dense GELU MLP per block; E > 0: E experts per block, stored fused as two 3-D weights
  // ([E, 4·d, d] and [E, d, 4·d]) and chosen per token by a top-1 router.
  int64_t n_experts = 0;
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t n_heads, int64_t n_experts = 0);
  at::Tensor forward(const at::Tensor& x);
  // While on, forward() keeps its input and each head's largest causal attention logit
  // (q·k/√dh over the batch; [n_heads], float, no gradient), which QK-clip needs.
  void record_max_logits(bool on) { record_max_logits_ = on; }
  const at::Tensor& max_logits() const { return max_logits_; }
  const at::Tensor& recorded_input() const { return recorded_input_; }
  // Each head's largest causal attention logit on input x with the current weights.
  at::Tensor max_logits_on(const at::Tensor& x);

 private:
  at::Tensor mlp(const at::Tensor& h);  // dense or mixture of experts
  int64_t n_heads_;
  bool record_max_logits_ = false;
  at::Tensor max_logits_, recorded_input_;
  torch::nn::LayerNorm attn_norm_{nullptr}, mlp_norm_{nullptr};
  torch::nn::Linear qkv_{nullptr}, attn_out_{nullptr}, mlp_in_{nullptr}, mlp_out_{nullptr};
  torch::nn::Linear router_{nullptr};
  at::Tensor experts_in_, experts_out_;  // [E, 4·d, d], [E, d, 4·d]
};
TORCH_MODULE(Block);

class CharGptImpl : public torch::nn::Module {
 public:
  explicit CharGptImpl(const ModelConfig& config);
  // tokens: (batch, seq) int64 -> logits (batch, seq, vocab); head(blocks(embed(tokens))).
  at::Tensor forward(const at::Tensor& tokens);
  // The parts forward() runs, one per FSDP group (shard_group_of), so that each can run
  // inside its group's FsdpParameterGroup::forward.
  at::Tensor embed(const at::Tensor& tokens);            // -> (batch, seq, d_model)
  at::Tensor block(int64_t index, const at::Tensor& x);  // blocks.<index>
  at::Tensor head(const at::Tensor& x);                  // final norm + head -> logits
  const ModelConfig& config() const { return config_; }
  // Every block's record_max_logits; max_logits() stacks the recorded maxima as [layers,
  // heads]; recheck_max_logits() recomputes them on the recorded inputs with today's weights.
  void record_max_logits(bool on);
  at::Tensor max_logits() const;
  at::Tensor recheck_max_logits();

 private:
  ModelConfig config_;
  torch::nn::Embedding token_embedding_{nullptr}, position_embedding_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm final_norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(CharGpt);

// Muon's parameters: the 2-D and 3-D weights inside the transformer blocks (attention, MLP and
// router matrices, fused experts). Everything else (embeddings, norms, biases, the head) goes to
// AdamW.
bool is_hidden_matrix(const std::string& name, const at::Tensor& param);

// Group key for shard_module: one group per transformer block ("blocks.3"), one for the
// embeddings, one for the final norm and head.
std::string shard_group_of(const std::string& name, const at::Tensor& param);

}  // namespace char_gpt
