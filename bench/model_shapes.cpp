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

}  // namespace fsdp_muon_bench
