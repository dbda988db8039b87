#include "strategies_model.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fsdp_muon_bench {

Gpt2BlockImpl::Gpt2BlockImpl(int64_t width, int64_t heads) : heads_(heads) {
  TORCH_CHECK(heads > 0 && width % heads == 0, "fsdp_strategies_bench: --width (", width,
              ") must be a multiple of --heads (", heads, ")");
  ln_1_ = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  auto attn = register_module("attn", std::make_shared<torch::nn::Module>());
  c_attn_ = attn->register_module("c_attn", torch::nn::Linear(width, 3 * width));
  attn_proj_ = attn->register_module("c_proj", torch::nn::Linear(width, width));
  ln_2_ = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  c_fc_ = mlp->register_module("c_fc", torch::nn::Linear(width, 4 * width));
  mlp_proj_ = mlp->register_module("c_proj", torch::nn::Linear(4 * width, width));
}

at::Tensor Gpt2BlockImpl::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), seq = x.size(1), d = x.size(2);
  auto split = [&](const at::Tensor& t) {  // (B, T, d) -> (B, H, T, d / H)
    return t.reshape({batch, seq, heads_, d / heads_}).transpose(1, 2);
  };
  const auto qkv = c_attn_->forward(ln_1_->forward(x)).chunk(3, /*dim=*/2);
  const at::Tensor y = at::scaled_dot_product_attention(split(qkv[0]), split(qkv[1]), split(qkv[2]),
                                                        /*attn_mask=*/{},
                                                        /*dropout_p=*/0.0, /*is_causal=*/true);
  const at::Tensor h = x + attn_proj_->forward(y.transpose(1, 2).reshape({batch, seq, d}));
  return h + mlp_proj_->forward(at::gelu(c_fc_->forward(ln_2_->forward(h)), "tanh"));
}

Gpt2EmbeddingsImpl::Gpt2EmbeddingsImpl(int64_t vocab, int64_t seq_len, int64_t width) {
  wte_ = register_module("wte", torch::nn::Embedding(vocab, width));
  wpe_ = register_module("wpe", torch::nn::Embedding(seq_len, width));
}

at::Tensor Gpt2EmbeddingsImpl::forward(const at::Tensor& tokens) {
  return wte_->forward(tokens) + wpe_->forward(at::arange(tokens.size(1), tokens.options()));
}

Gpt2HeadImpl::Gpt2HeadImpl(int64_t vocab, int64_t width) {
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  lm_head_ = register_module("lm_head",
                             torch::nn::Linear(torch::nn::LinearOptions(width, vocab).bias(false)));
}

at::Tensor Gpt2HeadImpl::forward(const at::Tensor& x) {
  return lm_head_->forward(ln_f_->forward(x));
}

Gpt2Impl::Gpt2Impl(const Gpt2Config& config) {
  TORCH_CHECK(config.layers > 0 && config.width > 0 && config.vocab > 0 && config.seq_len > 0,
              "fsdp_strategies_bench: --layers, --width, --vocab and --seq-len must be positive");
  embeddings =
      register_module("embeddings", Gpt2Embeddings(config.vocab, config.seq_len, config.width));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i) h->push_back(Gpt2Block(config.width, config.heads));
  head = register_module("head", Gpt2Head(config.vocab, config.width));
}

std::string gpt2_group_of(const std::string& name, const at::Tensor& /*param*/) {
  if (name.rfind("h.", 0) == 0) return name.substr(0, name.find('.', 2));  // "h.<k>"
  return name.substr(0, name.find('.'));                                   // embeddings, head
}

}  // namespace fsdp_muon_bench
