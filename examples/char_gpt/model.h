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
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t n_heads);
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t n_heads_;
  torch::nn::LayerNorm attn_norm_{nullptr}, mlp_norm_{nullptr};
  torch::nn::Linear qkv_{nullptr}, attn_out_{nullptr}, mlp_in_{nullptr}, mlp_out_{nullptr};
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

 private:
  ModelConfig config_;
  torch::nn::Embedding token_embedding_{nullptr}, position_embedding_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm final_norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(CharGpt);

// Muon's parameters: the 2-D weights inside the transformer blocks (attention and MLP
// matrices). Everything else (embeddings, norms, biases, the head) goes to AdamW.
bool is_hidden_matrix(const std::string& name, const at::Tensor& param);

// Group key for shard_module: one group per transformer block ("blocks.3"), one for the
// embeddings, one for the final norm and head.
std::string shard_group_of(const std::string& name, const at::Tensor& param);

}  // namespace char_gpt
