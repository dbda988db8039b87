#pragma once
// MuonAdamW (docs/DESIGN.md §3, The user tier): one optimizer for a ShardedModel. FsdpMuon steps
// the hidden matrices, torch::optim::AdamW everything else, routed by a policy; one step() steps
// both in the right order and refreshes every group's model weights; one checkpoint call saves or
// loads both.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/checkpoint/checkpoint.h>
#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/sharded_model.h>
#include <fsdp_muon/muon/matrix_layout.h>
#include <fsdp_muon/muon/muon_options.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>

namespace fsdp_muon {

// Called with a parameter's name (as in module.named_parameters()) and a meta tensor of its full
// shape and dtype (ShardedModelParameter::meta).
using ParameterPredicate = std::function<bool(const std::string& name, const at::Tensor& param)>;
using MatrixLayoutPolicy =
    std::function<MatrixLayout(const std::string& name, const at::Tensor& param)>;

struct FSDP_MUON_API MuonAdamWConfig {
  // Which parameters Muon steps (true) and which AdamW (false). nullptr: the default rule, Muon
  // for the hidden matrices: every 2-D and 3-D parameter except those of torch::nn::Embedding /
  // EmbeddingBag modules and of the model's last torch::nn::Linear (the output head); AdamW for
  // those and for every other parameter (biases, norms, scalars, 4-D convolutions).
  TORCH_ARG(ParameterPredicate, use_muon) = nullptr;
  // The MatrixLayout of each Muon parameter (fused QKV: row_blocks). nullptr: whole() for 2-D,
  // batched() for 3-D (the E matrices of an [E, m, n] tensor). Parameters of equal layouts share
  // one param group of FsdpMuon, in order of first appearance.
  TORCH_ARG(MatrixLayoutPolicy, matrix_layout) = nullptr;
  // FsdpMuon's distribution settings.
  TORCH_ARG(FsdpMuonConfig, fsdp_muon) = {};
};

// A torch::optim::Optimizer whose param_groups() are FsdpMuon's (one per matrix layout, with
// MuonOptions) followed by AdamW's (one, with torch::optim::AdamWOptions), so torch's LR
// schedulers drive both learning rates. Options changed on those groups take effect at the next
// step(). Every rank must build it alike and step it alike (FsdpMuon's agreement checks apply).
class FSDP_MUON_API MuonAdamW : public torch::optim::Optimizer {
 public:
  MuonAdamW(std::shared_ptr<ShardedModel> model, MuonOptions muon = MuonOptions(),
            torch::optim::AdamWOptions adamw = torch::optim::AdamWOptions(),
            MuonAdamWConfig config = {});
  ~MuonAdamW() override;

  // AdamW's step, then FsdpMuon's (which refreshes the model weights of the groups it holds a
  // matrix of), then the refresh of every other group. The gradients must be reduce-scattered,
  // which every backward through the model does at its end (ShardedModel): a step while
  // set_requires_gradient_sync(false) is an error.
  at::Tensor step(LossClosure closure = nullptr) override;
  // The model's zero_grad() (the group buffers, in place). It hides Optimizer::zero_grad, which
  // would detach the sharded parameters' gradients and leave the model's full gradients as they
  // are: call it on the MuonAdamW or on the ShardedModel, not through an Optimizer reference.
  void zero_grad();
  // Always throws: the routing is fixed at construction.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  // torch::save / torch::load of both optimizers' state (one archive each).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const std::shared_ptr<ShardedModel>& model() const;
  // The two optimizers inside (null when no parameter is routed to it). Their options are set
  // from param_groups() at every step(), save and load.
  FsdpMuon* muon() const;
  torch::optim::AdamW* adamw() const;
  // Whether `name` (a model parameter) is stepped by Muon.
  bool uses_muon(const std::string& name) const;
  // The inner optimizers in checkpoint order (AdamW, then FsdpMuon; absent ones left out).
  std::vector<torch::optim::Optimizer*> checkpoint_optimizers() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void push_options_to_inner() const;
  void pull_options_from_inner();
  friend FSDP_MUON_API CheckpointUserState load_checkpoint(const std::string& dir,
                                                           const ShardedModel& model,
                                                           MuonAdamW& optimizer);
};

// save_checkpoint / load_checkpoint / export_full_checkpoint of a ShardedModel and its MuonAdamW
// in one call (checkpoint.h says what they do; the optimizers are stored as AdamW, then FsdpMuon).
FSDP_MUON_API std::string save_checkpoint(const std::string& dir, const ShardedModel& model,
                                          const MuonAdamW& optimizer,
                                          const SaveCheckpointOptions& options = {});
FSDP_MUON_API CheckpointUserState load_checkpoint(const std::string& dir, const ShardedModel& model,
                                                  MuonAdamW& optimizer);
FSDP_MUON_API void export_full_checkpoint(const std::string& path, const ShardedModel& model,
                                          const MuonAdamW& optimizer);

// clip_grad_norm over every group of `model`.
FSDP_MUON_API double clip_grad_norm(const ShardedModel& model, double max_norm,
                                    double norm_type = 2.0,
                                    NonFiniteGradients non_finite = NonFiniteGradients::kSkipStep);

}  // namespace fsdp_muon
