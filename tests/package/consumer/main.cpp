// A program outside the repository, built against the installed package: it uses the public
// names of docs/DESIGN.md §8 through the umbrella header only.
#include <fsdp_muon/fsdp_muon.h>

#include <torch/torch.h>

#include <iostream>

int main() {
  torch::manual_seed(0);
  auto x = torch::randn({8, 16});
  auto o = fsdp_muon::newton_schulz(x, fsdp_muon::NewtonSchulzOptions().compute_dtype(at::kFloat));
  TORCH_CHECK(o.sizes() == x.sizes(), "newton_schulz changed the shape");

  // Single device: Muon on a matrix.
  auto w = torch::randn({4, 6}, torch::requires_grad());
  fsdp_muon::Muon muon({w}, fsdp_muon::MuonOptions(0.02));
  w.sum().backward();
  muon.step();

  // Sharded, one process: shard a module, step FsdpMuon + AdamW.
  auto comm = fsdp_muon::init_from_env();
  torch::nn::Linear lin(6, 4);
  auto groups = fsdp_muon::shard_module(*lin, comm);
  std::vector<torch::Tensor> matrices, others;
  for (auto& g : groups) {
    for (size_t i = 0; i < g->num_parameters(); ++i) {
      (g->slot(i).shape.size() == 2 ? matrices : others).push_back(g->sharded_parameter(i));
    }
  }
  fsdp_muon::FsdpMuon opt(matrices, fsdp_muon::MuonOptions(0.02));
  torch::optim::AdamW adamw(others, torch::optim::AdamWOptions(1e-3));
  for (auto& g : groups) g->zero_grad();
  lin->forward(torch::randn({3, 6})).pow(2).sum().backward();
  for (auto& g : groups) g->reduce_scatter_grads();
  opt.step();
  adamw.step();
  for (auto& g : groups) g->refresh_model_weights();
  std::cout << "consumer ok (fsdp_muon " << FSDP_MUON_VERSION << ", world size " << comm->size()
            << ")" << std::endl;
  return 0;
}
