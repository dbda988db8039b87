#include "model.h"

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>
#include <torch/utils.h>

namespace char_gpt {

BlockImpl::BlockImpl(int64_t d_model, int64_t n_heads, int64_t n_experts) : n_heads_(n_heads) {
  TORCH_CHECK(n_heads > 0 && d_model % n_heads == 0, "char_gpt: --d-model (", d_model,
              ") must be a multiple of --heads (", n_heads, ")");
  attn_norm_ =
      register_module("attn_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  attn_out_ = register_module("attn_out", torch::nn::Linear(d_model, d_model));
  mlp_norm_ =
      register_module("mlp_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  TORCH_CHECK(n_experts >= 0, "char_gpt: --moe must be >= 0, got ", n_experts);
  if (n_experts == 0) {
    mlp_in_ = register_module("mlp_in", torch::nn::Linear(d_model, 4 * d_model));
    mlp_out_ = register_module("mlp_out", torch::nn::Linear(4 * d_model, d_model));
    return;
  }
  router_ = register_module(
      "router", torch::nn::Linear(torch::nn::LinearOptions(d_model, n_experts).bias(false)));
  // torch::nn::Linear's initialization, expert by expert: U(-1/√fan_in, 1/√fan_in).
  const double in_bound = 1.0 / std::sqrt(static_cast<double>(d_model));
  const double out_bound = 1.0 / std::sqrt(static_cast<double>(4 * d_model));
  experts_in_ = register_parameter(
      "experts_in", at::empty({n_experts, 4 * d_model, d_model}).uniform_(-in_bound, in_bound));
  experts_out_ = register_parameter(
      "experts_out", at::empty({n_experts, d_model, 4 * d_model}).uniform_(-out_bound, out_bound));
}

at::Tensor BlockImpl::mlp(const at::Tensor& h) {
  if (!router_) return mlp_out_->forward(at::gelu(mlp_in_->forward(h)));
  // Top-1 routing: each token goes to the expert of its largest gate, scaled by that gate (so
  // the router learns). An expert no token chose gets a zero gradient slice this step.
  const at::Tensor x = h.reshape({-1, h.size(-1)});
  const at::Tensor gates = at::softmax(router_->forward(x), /*dim=*/-1);
  const at::Tensor choice = gates.argmax(/*dim=*/-1);
  at::Tensor out = at::zeros_like(x);
  for (int64_t e = 0; e < experts_in_.size(0); ++e) {
    const at::Tensor tokens = (choice == e).nonzero().squeeze(1);
    if (tokens.numel() == 0) continue;
    const at::Tensor y = at::linear(at::gelu(at::linear(x.index_select(0, tokens), experts_in_[e])),
                                    experts_out_[e]);
    out = out.index_add(0, tokens, y * gates.index_select(0, tokens).select(1, e).unsqueeze(1));
  }
  return out.reshape(h.sizes());
}

at::Tensor BlockImpl::max_logits_on(const at::Tensor& x) {
  at::NoGradGuard no_grad;
  const int64_t batch = x.size(0), seq = x.size(1), d = x.size(2), dh = d / n_heads_;
  auto heads = [&](const at::Tensor& t) {  // (B, T, d) -> (B, H, T, dh)
    return t.reshape({batch, seq, n_heads_, dh}).transpose(1, 2).to(at::kFloat);
  };
  const auto qkv = qkv_->forward(attn_norm_->forward(x)).chunk(3, /*dim=*/2);
  const at::Tensor future = at::ones({seq, seq}, x.options().dtype(at::kBool)).triu(1);
  const at::Tensor logits = at::matmul(heads(qkv[0]), heads(qkv[1]).transpose(-2, -1))
                                .div(std::sqrt(static_cast<double>(dh)))
                                .masked_fill(future, -std::numeric_limits<float>::infinity());
  return logits.amax({0, 2, 3});  // (B, H, T, T) -> [H]
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), seq = x.size(1), d = x.size(2);
  auto heads = [&](const at::Tensor& t) {  // (B, T, d) -> (B, H, T, d / H)
    return t.reshape({batch, seq, n_heads_, d / n_heads_}).transpose(1, 2);
  };
  const auto qkv = qkv_->forward(attn_norm_->forward(x)).chunk(3, /*dim=*/2);
  if (record_max_logits_) {
    recorded_input_ = x.detach();
    max_logits_ = max_logits_on(x);
  }
  const at::Tensor attended =
      at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]),
                                       /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
  const at::Tensor h = x + attn_out_->forward(attended.transpose(1, 2).reshape({batch, seq, d}));
  return h + mlp(mlp_norm_->forward(h));
}

CharGptImpl::CharGptImpl(const ModelConfig& config) : config_(config) {
  TORCH_CHECK(config.vocab_size > 0 && config.seq_len > 0 && config.n_layers > 0,
              "char_gpt: vocabulary, --seq-len and --layers must be positive");
  token_embedding_ =
      register_module("token_embedding", torch::nn::Embedding(config.vocab_size, config.d_model));
  position_embedding_ =
      register_module("position_embedding", torch::nn::Embedding(config.seq_len, config.d_model));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layers; ++i) {
    blocks_->push_back(Block(config.d_model, config.n_heads, config.n_experts));
  }
  final_norm_ = register_module(
      "final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model})));
  head_ = register_module("head", torch::nn::Linear(config.d_model, config.vocab_size));
  // GPT-2's embedding scale; unit-variance embeddings swamp the residual stream of a model
  // this narrow.
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(token_embedding_->weight, 0.0, 0.02);
  torch::nn::init::normal_(position_embedding_->weight, 0.0, 0.02);
}

at::Tensor CharGptImpl::forward(const at::Tensor& tokens) {
  at::Tensor x = embed(tokens);
  for (int64_t i = 0; i < config_.n_layers; ++i) x = block(i, x);
  return head(x);
}

at::Tensor CharGptImpl::embed(const at::Tensor& tokens) {
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= config_.seq_len, "char_gpt: sequence of ", seq,
              " tokens is longer than the model's --seq-len ", config_.seq_len);
  return token_embedding_->forward(tokens) +
         position_embedding_->forward(at::arange(seq, tokens.options()));
}

at::Tensor CharGptImpl::block(int64_t index, const at::Tensor& x) {
  return blocks_[index]->as<Block>()->forward(x);
}

void CharGptImpl::record_max_logits(bool on) {
  for (int64_t i = 0; i < config_.n_layers; ++i) blocks_[i]->as<Block>()->record_max_logits(on);
}

at::Tensor CharGptImpl::max_logits() const {
  std::vector<at::Tensor> per_layer;
  for (int64_t i = 0; i < config_.n_layers; ++i) {
    const at::Tensor& m = blocks_->ptr(i)->as<Block>()->max_logits();
    TORCH_CHECK(m.defined(),
                "char_gpt: no attention logits recorded; call record_max_logits(true) "
                "before the forward");
    per_layer.push_back(m);
  }
  return at::stack(per_layer);
}

at::Tensor CharGptImpl::recheck_max_logits() {
  std::vector<at::Tensor> per_layer;
  for (int64_t i = 0; i < config_.n_layers; ++i) {
    auto* b = blocks_[i]->as<Block>();
    TORCH_CHECK(b->recorded_input().defined(), "char_gpt: no block input recorded");
    per_layer.push_back(b->max_logits_on(b->recorded_input()));
  }
  return at::stack(per_layer);
}

at::Tensor CharGptImpl::head(const at::Tensor& x) {
  return head_->forward(final_norm_->forward(x));
}

bool is_hidden_matrix(const std::string& name, const at::Tensor& param) {
  return (param.dim() == 2 || param.dim() == 3) && name.rfind("blocks.", 0) == 0;
}

std::string shard_group_of(const std::string& name, const at::Tensor& /*param*/) {
  if (name.rfind("blocks.", 0) == 0) {
    return name.substr(0, name.find('.', 7));  // "blocks.<i>"
  }
  if (name.rfind("token_embedding", 0) == 0 || name.rfind("position_embedding", 0) == 0) {
    return "embeddings";
  }
  return "head";  // final_norm and head
}

}  // namespace char_gpt
