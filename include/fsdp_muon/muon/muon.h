#pragma once
// Single-device Muon (docs/DESIGN.md §1, §4): every parameter is full on one device, one 2-D
// matrix or the matrices of its MatrixLayout.
// It is the reference every distributed result (FsdpMuon) is compared with.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/muon/muon_options.h>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace fsdp_muon {

struct FSDP_MUON_API MuonParamState
    : public torch::optim::OptimizerCloneableParamState<MuonParamState> {
  // Number of steps taken for this parameter (it only counts; the update does not use it).
  TORCH_ARG(int64_t, step) = 0;
  // Created lazily at the first step with a gradient: zeros, the parameter's shape and dtype.
  TORCH_ARG(at::Tensor, momentum_buffer);
  // Normalization::kNorMuon only: the per-row second moment of the orthogonalized update, a 1-D
  // tensor of one entry per row in the parameter's dtype (E·m for a batched [E, m, n]
  // parameter; each matrix of a MatrixLayout owns its rows), created as zeros at the first such
  // step.
  TORCH_ARG(at::Tensor, normuon_variance);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend FSDP_MUON_API bool operator==(const MuonParamState& lhs, const MuonParamState& rhs);
};

// Muon for 2-D parameters (use torch::optim::AdamW for biases, norms and embeddings), or for the
// matrices a param group's MuonOptions::matrix_layout divides them into (row blocks, 3-D
// experts). Per step and parameter with a gradient: weight decay, momentum and Nesterov input
// over the whole parameter, then per matrix Newton-Schulz and its scale, then apply.
//
// Per-group options are kept exactly as given: LibTorch's Optimizer::add_param_group has, in some
// releases, replaced the options of groups whose optimizer type it does not know with the
// optimizer's defaults; Muon's constructor and add_param_group restore the group's own options.
class FSDP_MUON_API Muon : public torch::optim::Optimizer {
 public:
  explicit Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                MuonOptions defaults = MuonOptions());
  explicit Muon(std::vector<at::Tensor> params, MuonOptions defaults = MuonOptions());

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Hides Optimizer::add_param_group (which is not virtual): call it on a Muon, not through an
  // Optimizer reference, so the group keeps its options and is validated.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

 private:
  void add_group(const torch::optim::OptimizerParamGroup& param_group, std::string& skipped);
  // Validates the options and parameters of param_groups_[index]; appends the non-2-D ones that
  // skip_non_matrix lets through to `skipped`.
  void check_group(size_t index, std::string& skipped);
  static void warn_skipped(const std::string& skipped);
};

}  // namespace fsdp_muon
