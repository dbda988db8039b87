// A program outside the repository, built against the installed package: it uses the public
// names of docs/DESIGN.md §8 through the umbrella header only.
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/newton_schulz/newton_schulz.h>

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

  // Sharded, the README's loop: an embedding, a hidden matrix and a head; Muon steps the hidden
  // matrix alone, AdamW the rest, a scheduler drives both learning rates.
  auto comm = fsdp_muon::init_from_env();
  torch::nn::Sequential net(torch::nn::Embedding(10, 6), torch::nn::Linear(6, 6),
                            torch::nn::Linear(6, 10));
  auto model = fsdp_muon::shard(*net, comm);
  fsdp_muon::MuonAdamW optimizer(model, fsdp_muon::MuonOptions(0.02),
                                 torch::optim::AdamWOptions(1e-3));
  torch::optim::StepLR scheduler(optimizer, /*step_size=*/1, /*gamma=*/0.5);
  TORCH_CHECK(optimizer.uses_muon("1.weight") && !optimizer.uses_muon("0.weight") &&
                  !optimizer.uses_muon("2.weight") && !optimizer.uses_muon("1.bias"),
              "MuonAdamW routed the parameters wrongly");
  const auto tokens = torch::randint(0, 10, {3});
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(tokens), tokens).backward();
    optimizer.step();
    scheduler.step();
  }
  TORCH_CHECK(optimizer.param_groups().front().options().get_lr() == 0.02 / 4,
              "the scheduler did not reach Muon's learning rate");
  std::cout << "consumer ok (fsdp_muon " << FSDP_MUON_VERSION << ", world size " << comm->size()
            << ")" << std::endl;
  return 0;
}
