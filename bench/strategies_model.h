#pragma once
// The model of fsdp_strategies_bench: GPT-2 (124M at the default sizes), the same modules,
// names and shapes as its peer bench/peers/fsdp2_muon.py. One FSDP group per direct part:
// "embeddings" (wte, wpe), "h.<k>" per block, "head" (ln_f and an untied lm_head: each group
// is used once per forward, which FsdpParameterGroup::forward asks for).

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

namespace fsdp_muon_bench {

struct Gpt2Config {
  int64_t layers = 12;
  int64_t width = 768;
  int64_t heads = 12;
  int64_t vocab = 50257;
  int64_t seq_len = 1024;
};

class Gpt2BlockImpl : public torch::nn::Module {
 public:
  Gpt2BlockImpl(int64_t width, int64_t heads);
  at::Tensor forward(const at::Tensor& x);  // (batch, seq, width) -> same

 private:
  int64_t heads_;
  torch::nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  torch::nn::Linear c_attn_{nullptr}, attn_proj_{nullptr}, c_fc_{nullptr}, mlp_proj_{nullptr};
};
TORCH_MODULE(Gpt2Block);

class Gpt2EmbeddingsImpl : public torch::nn::Module {
 public:
  Gpt2EmbeddingsImpl(int64_t vocab, int64_t seq_len, int64_t width);
  at::Tensor forward(const at::Tensor& tokens);  // (batch, seq) int64 -> (batch, seq, width)

 private:
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
};
TORCH_MODULE(Gpt2Embeddings);

class Gpt2HeadImpl : public torch::nn::Module {
 public:
  Gpt2HeadImpl(int64_t vocab, int64_t width);
  at::Tensor forward(const at::Tensor& x);  // (batch, seq, width) -> (batch, seq, vocab)

 private:
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
};
TORCH_MODULE(Gpt2Head);

class Gpt2Impl : public torch::nn::Module {
 public:
  explicit Gpt2Impl(const Gpt2Config& config);
  Gpt2Embeddings embeddings{nullptr};
  torch::nn::ModuleList h{nullptr};
  Gpt2Head head{nullptr};
};
TORCH_MODULE(Gpt2);

// shard_module policy: "embeddings", "h.<k>", "head".
std::string gpt2_group_of(const std::string& name, const at::Tensor& param);

}  // namespace fsdp_muon_bench
