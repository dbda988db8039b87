// Single-device quick start: a small MLP learns a random teacher network. Muon trains the hidden
// weight matrices; AdamW trains the biases and the output layer (Muon is for hidden matrices).
// Prints the loss as it falls; exits non-zero if it did not fall by at least 10x.

#include <cstdio>
#include <vector>

#include <torch/torch.h>

#include <fsdp_muon/muon/muon.h>

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        head(register_module("head", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::tanh(fc2(torch::tanh(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(Mlp);

int main() {
  torch::manual_seed(0);
  const int64_t in = 16, hidden = 64, out = 4, samples = 1024;

  // Data: a random teacher of the same architecture, so the task is learnable exactly.
  Mlp teacher(in, hidden, out);
  const torch::Tensor x = torch::randn({samples, in});
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = teacher->forward(x);
  }

  Mlp model(in, hidden, out);
  // Hidden matrices to Muon; everything else (biases, the output head) to AdamW.
  std::vector<torch::Tensor> matrices{model->fc1->weight, model->fc2->weight};
  std::vector<torch::Tensor> others{model->fc1->bias, model->fc2->bias, model->head->weight,
                                    model->head->bias};
  // fp32 Newton-Schulz: most CPUs have no fast bf16 GEMM (on a GPU keep the bf16 default).
  fsdp_muon::Muon muon(matrices,
                       fsdp_muon::MuonOptions(0.02).newton_schulz(
                           fsdp_muon::NewtonSchulzOptions().compute_dtype(torch::kFloat)));
  torch::optim::AdamW adamw(others, torch::optim::AdamWOptions(3e-3).weight_decay(0.0));

  const int steps = 200;
  double first = 0.0, last = 0.0;
  for (int step = 0; step <= steps; ++step) {
    muon.zero_grad();
    adamw.zero_grad();
    const torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    muon.step();
    adamw.step();
    const double value = loss.item<double>();
    if (step == 0) first = value;
    last = value;
    if (step % 20 == 0) {
      std::printf("step %4d  loss %.6f\n", step, value);
    }
  }
  std::printf("loss fell from %.6f to %.6f (%.1fx)\n", first, last, first / last);
  return last < first / 10 ? 0 : 1;
}
