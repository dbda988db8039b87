#pragma once
// The small model the FSDP and HSDP tests shard: blocks of Linear -> tanh -> * gain (a matrix for
// Muon, a bias and a gain for AdamW in every block), stacked over `dims`, which the tests pick so
// that rows and columns of 1 and sizes no world size divides put parameter boundaries in awkward
// places.

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace fsdp_muon::testing {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t in, int64_t out) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    gain = register_parameter("gain", at::ones({out}));
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)) * gain; }
  torch::nn::Linear fc{nullptr};
  at::Tensor gain;
};
TORCH_MODULE(Block);

// Block i maps dims[i] features to dims[i + 1]; registered as "b<i>".
struct StackImpl : torch::nn::Module {
  explicit StackImpl(const std::vector<int64_t>& dims) {
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      blocks.push_back(register_module("b" + std::to_string(i), Block(dims[i], dims[i + 1])));
    }
  }
  at::Tensor forward(at::Tensor h) {
    for (auto& b : blocks) h = b->forward(h);
    return h;
  }
  std::vector<Block> blocks;
};
TORCH_MODULE(Stack);

}  // namespace fsdp_muon::testing
