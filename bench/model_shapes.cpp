#include "model_shapes.h"

#include <string>

namespace fsdp_muon_bench {

int64_t ModelShapes::num_matrices() const {
  int64_t n = 0;
  for (const auto& group : groups) {
    for (const auto& p : group.second) n += p.second.size() == 2;
  }
  return n;
}

int64_t ModelShapes::num_elements() const {
  int64_t n = 0;
  for (const auto& group : groups) {
    for (const auto& p : group.second) {
      if (p.second.size() == 2) n += p.second[0] * p.second[1];
    }
  }
  return n;
}

ModelShapes gpt2_124m(int64_t layers, int64_t width) {
  ModelShapes model{"GPT-2 124M", {}};
  if (width != 768) model.name = "GPT-2 (width " + std::to_string(width) + ")";
  const int64_t d = width;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    model.groups.push_back({p.substr(0, p.size() - 1),
                            {{p + "ln_1.weight", {d}},
                             {p + "ln_1.bias", {d}},
                             {p + "attn.c_attn.weight", {3 * d, d}},
                             {p + "attn.c_attn.bias", {3 * d}},
                             {p + "attn.c_proj.weight", {d, d}},
                             {p + "attn.c_proj.bias", {d}},
                             {p + "ln_2.weight", {d}},
                             {p + "ln_2.bias", {d}},
                             {p + "mlp.c_fc.weight", {4 * d, d}},
                             {p + "mlp.c_fc.bias", {4 * d}},
                             {p + "mlp.c_proj.weight", {d, 4 * d}},
                             {p + "mlp.c_proj.bias", {d}}}});
  }
  return model;
}

ModelShapes llama3_8b(int64_t layers, int64_t scale) {
  ModelShapes model{"Llama-3-8B", {}};
  if (scale != 1) model.name += " /" + std::to_string(scale);
  const int64_t d = 4096 / scale, kv = 1024 / scale, ffn = 14336 / scale;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    model.groups.push_back({p.substr(0, p.size() - 1),
                            {{p + "self_attn.q_proj.weight", {d, d}},
                             {p + "self_attn.k_proj.weight", {kv, d}},
                             {p + "self_attn.v_proj.weight", {kv, d}},
                             {p + "self_attn.o_proj.weight", {d, d}},
                             {p + "mlp.gate_proj.weight", {ffn, d}},
                             {p + "mlp.up_proj.weight", {ffn, d}},
                             {p + "mlp.down_proj.weight", {d, ffn}},
                             {p + "input_layernorm.weight", {d}},
                             {p + "post_attention_layernorm.weight", {d}}}});
  }
  return model;
}

ModelShapes qwen3_30b_a3b(int64_t layers, int64_t experts, int64_t scale) {
  ModelShapes model{"Qwen3-30B-A3B", {}};
  if (experts != 128 || scale != 1) {
    model.name += " (" + std::to_string(experts) + " experts" +
                  (scale != 1 ? ", /" + std::to_string(scale) : std::string()) + ")";
  }
  const int64_t d = 2048 / scale, q = 4096 / scale, kv = 512 / scale, head = 128 / scale,
                ffn = 768 / scale;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    NamedShapes shapes = {
        {p + "self_attn.q_proj.weight", {q, d}},  {p + "self_attn.k_proj.weight", {kv, d}},
        {p + "self_attn.v_proj.weight", {kv, d}}, {p + "self_attn.o_proj.weight", {d, q}},
        {p + "self_attn.q_norm.weight", {head}},  {p + "self_attn.k_norm.weight", {head}},
        {p + "mlp.gate.weight", {experts, d}}};
    for (int64_t e = 0; e < experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      shapes.push_back({x + "gate_proj.weight", {ffn, d}});
      shapes.push_back({x + "up_proj.weight", {ffn, d}});
      shapes.push_back({x + "down_proj.weight", {d, ffn}});
    }
    shapes.push_back({p + "input_layernorm.weight", {d}});
    shapes.push_back({p + "post_attention_layernorm.weight", {d}});
    model.groups.push_back({p.substr(0, p.size() - 1), std::move(shapes)});
  }
  return model;
}

namespace {

// Attention (q, k, v, o) of a layer with `kv` key/value width.
void add_attention(NamedShapes& shapes, const std::string& p, int64_t d, int64_t kv) {
  shapes.push_back({p + "self_attn.q_proj.weight", {d, d}});
  shapes.push_back({p + "self_attn.k_proj.weight", {kv, d}});
  shapes.push_back({p + "self_attn.v_proj.weight", {kv, d}});
  shapes.push_back({p + "self_attn.o_proj.weight", {d, d}});
}

// A gated FFN (gate, up, down) of width `ffn`.
void add_ffn(NamedShapes& shapes, const std::string& p, int64_t d, int64_t ffn) {
  shapes.push_back({p + "gate_proj.weight", {ffn, d}});
  shapes.push_back({p + "up_proj.weight", {ffn, d}});
  shapes.push_back({p + "down_proj.weight", {d, ffn}});
}

void add_norms(NamedShapes& shapes, const std::string& p, int64_t d) {
  shapes.push_back({p + "input_layernorm.weight", {d}});
  shapes.push_back({p + "post_attention_layernorm.weight", {d}});
}

}  // namespace

ModelShapes dense_70b(int64_t layers) {
  ModelShapes model{"dense 70B-class", {}};
  const int64_t d = 8192, kv = 1024, ffn = 28672;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    NamedShapes shapes;
    add_attention(shapes, p, d, kv);
    add_ffn(shapes, p + "mlp.", d, ffn);
    add_norms(shapes, p, d);
    model.groups.push_back({p.substr(0, p.size() - 1), std::move(shapes)});
  }
  return model;
}

ModelShapes moe_8_experts(int64_t layers) {
  ModelShapes model{"8-expert MoE (Mixtral-like)", {}};
  const int64_t d = 4096, kv = 1024, ffn = 14336;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    NamedShapes shapes;
    add_attention(shapes, p, d, kv);
    shapes.push_back({p + "mlp.gate.weight", {8, d}});
    for (int64_t e = 0; e < 8; ++e) {
      add_ffn(shapes, p + "mlp.experts." + std::to_string(e) + ".", d, ffn);
    }
    add_norms(shapes, p, d);
    model.groups.push_back({p.substr(0, p.size() - 1), std::move(shapes)});
  }
  return model;
}

ModelShapes moe_64_experts(int64_t layers) {
  ModelShapes model{"64-expert fine-grained MoE", {}};
  const int64_t d = 2048, ffn = 1408;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    NamedShapes shapes;
    add_attention(shapes, p, d, d);
    shapes.push_back({p + "mlp.gate.weight", {64, d}});
    add_ffn(shapes, p + "mlp.shared_experts.", d, 2 * ffn);
    for (int64_t e = 0; e < 64; ++e) {
      add_ffn(shapes, p + "mlp.experts." + std::to_string(e) + ".", d, ffn);
    }
    add_norms(shapes, p, d);
    model.groups.push_back({p.substr(0, p.size() - 1), std::move(shapes)});
  }
  return model;
}

}  // namespace fsdp_muon_bench
