#include <fsdp_muon/training/muon_adamw.h>

#include <algorithm>
#include <unordered_set>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <fsdp_muon/fsdp/clip_grad_norm.h>
#include <fsdp_muon/fsdp/parameter_group.h>

#include "common/check.h"

namespace fsdp_muon {
namespace {

// The default routing (MuonAdamWConfig::use_muon): the hidden matrices.
bool is_hidden_matrix(const ShardedModelParameter& p) {
  const int64_t dim = p.meta.dim();
  return (dim == 2 || dim == 3) && !p.embedding && !p.output_head;
}

MatrixLayout default_layout(const ShardedModelParameter& p) {
  FSDP_MUON_CHECK(p.meta.dim() == 2 || p.meta.dim() == 3, "parameter '", p.name, "' (shape ",
                  p.meta.sizes(),
                  ") is routed to Muon but is neither 2-D nor 3-D, so it holds no "
                  "matrix Muon knows: route it to AdamW (MuonAdamWConfig::use_muon) or give it a "
                  "layout (MuonAdamWConfig::matrix_layout)");
  return p.meta.dim() == 2 ? MatrixLayout::whole() : MatrixLayout::batched();
}

template <typename Options>
Options& options_as(torch::optim::OptimizerParamGroup& group, size_t index, const char* kind) {
  auto* options = dynamic_cast<Options*>(&group.options());
  FSDP_MUON_CHECK(options != nullptr, "param group ", index, " must keep its ", kind,
                  " options; replace values on them (set_lr, ...) instead of the options object");
  return *options;
}

}  // namespace

struct FSDP_MUON_LOCAL MuonAdamW::Impl {
  std::shared_ptr<ShardedModel> model;
  std::unique_ptr<FsdpMuon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
  size_t muon_groups = 0;  // param_groups_[0, muon_groups) are FsdpMuon's, the rest AdamW's
  std::unordered_set<std::string> muon_names;
  // Groups FsdpMuon does not refresh: step() refreshes them after both steps.
  std::vector<std::shared_ptr<FsdpParameterGroup>> refresh_after_step;
};

MuonAdamW::MuonAdamW(std::shared_ptr<ShardedModel> model, MuonOptions muon,
                     torch::optim::AdamWOptions adamw, MuonAdamWConfig config)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<MuonOptions>(muon)),
      impl_(std::make_unique<Impl>()) {
  FSDP_MUON_API_SCOPE("MuonAdamW");
  FSDP_MUON_CHECK(model != nullptr, "the model is null; pass what fsdp_muon::shard returned");
  Impl& s = *impl_;
  s.model = std::move(model);

  std::vector<std::pair<MatrixLayout, std::vector<at::Tensor>>> by_layout;
  std::vector<at::Tensor> others;
  for (const ShardedModelParameter& p : s.model->parameters()) {
    const at::Tensor& sharded = p.group->sharded_parameter(p.index);
    const bool muon_param =
        config.use_muon() ? config.use_muon()(p.name, p.meta) : is_hidden_matrix(p);
    if (!muon_param) {
      others.push_back(sharded);
      continue;
    }
    s.muon_names.insert(p.name);
    const MatrixLayout layout =
        config.matrix_layout() ? config.matrix_layout()(p.name, p.meta) : default_layout(p);
    auto it = std::find_if(by_layout.begin(), by_layout.end(),
                           [&](const auto& entry) { return entry.first == layout; });
    if (it == by_layout.end()) it = by_layout.insert(by_layout.end(), {layout, {}});
    it->second.push_back(sharded);
  }

  std::vector<torch::optim::OptimizerParamGroup> muon_groups;
  for (auto& [layout, params] : by_layout) {
    auto options = std::make_unique<MuonOptions>(muon);
    options->matrix_layout(layout);
    muon_groups.emplace_back(std::move(params), std::move(options));
  }
  for (const auto& group : muon_groups) torch::optim::Optimizer::add_param_group(group);
  s.muon_groups = muon_groups.size();
  if (!others.empty()) {
    torch::optim::Optimizer::add_param_group(torch::optim::OptimizerParamGroup(
        others, std::make_unique<torch::optim::AdamWOptions>(adamw)));
  }

  if (!muon_groups.empty()) {
    s.muon = std::make_unique<FsdpMuon>(muon_groups, muon, config.fsdp_muon());
  }
  if (!others.empty()) {
    s.adamw = std::make_unique<torch::optim::AdamW>(others, adamw);
  }
  for (const auto& g : s.model->groups()) {
    const bool refreshed_by_muon =
        s.muon != nullptr && std::find(s.muon->fsdp_groups().begin(), s.muon->fsdp_groups().end(),
                                       g) != s.muon->fsdp_groups().end();
    if (!refreshed_by_muon) s.refresh_after_step.push_back(g);
  }
}

MuonAdamW::~MuonAdamW() = default;

void MuonAdamW::push_options_to_inner() const {
  const size_t expected = impl_->muon_groups + (impl_->adamw ? 1 : 0);
  FSDP_MUON_CHECK(param_groups_.size() == expected, "it has ", param_groups_.size(),
                  " param groups, built with ", expected,
                  "; the routing is fixed at construction (build a new MuonAdamW for other "
                  "parameters)");
  auto& outer = const_cast<std::vector<torch::optim::OptimizerParamGroup>&>(param_groups_);
  for (size_t i = 0; i < impl_->muon_groups; ++i) {
    options_as<MuonOptions>(impl_->muon->param_groups()[i], i, "MuonOptions") =
        options_as<MuonOptions>(outer[i], i, "MuonOptions");
  }
  if (impl_->adamw) {
    const size_t i = impl_->muon_groups;
    options_as<torch::optim::AdamWOptions>(impl_->adamw->param_groups()[0], i, "AdamWOptions") =
        options_as<torch::optim::AdamWOptions>(outer[i], i, "AdamWOptions");
  }
}

void MuonAdamW::pull_options_from_inner() {
  for (size_t i = 0; i < impl_->muon_groups; ++i) {
    options_as<MuonOptions>(param_groups_[i], i, "MuonOptions") =
        options_as<MuonOptions>(impl_->muon->param_groups()[i], i, "MuonOptions");
  }
  if (impl_->adamw) {
    const size_t i = impl_->muon_groups;
    options_as<torch::optim::AdamWOptions>(param_groups_[i], i, "AdamWOptions") =
        options_as<torch::optim::AdamWOptions>(impl_->adamw->param_groups()[0], i, "AdamWOptions");
  }
}

at::Tensor MuonAdamW::step(LossClosure closure) {
  FSDP_MUON_API_SCOPE("MuonAdamW");
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  FSDP_MUON_CHECK(
      impl_->model->requires_gradient_sync(),
      "step() while the model's gradient sync is off "
      "(set_requires_gradient_sync(false)): the gradients of the micro-batches are not "
      "reduce-scattered yet. Set it back to true before the last micro-batch's backward, "
      "whose end reduce-scatters them all");
  push_options_to_inner();
  // AdamW first: FsdpMuon's step ends by refreshing the model weights of its groups, which must
  // then hold AdamW's update of their other parameters too.
  if (impl_->adamw) impl_->adamw->step();
  if (impl_->muon) impl_->muon->step();
  for (const auto& g : impl_->refresh_after_step) g->refresh_model_weights();
  return loss;
}

void MuonAdamW::zero_grad() { impl_->model->zero_grad(); }

void MuonAdamW::add_param_group(const torch::optim::OptimizerParamGroup& /*param_group*/) {
  FSDP_MUON_API_SCOPE("MuonAdamW");
  FSDP_MUON_CHECK(false,
                  "add_param_group is not supported: the routing of the model's parameters is "
                  "fixed at construction; build a new MuonAdamW");
}

void MuonAdamW::save(torch::serialize::OutputArchive& archive) const {
  FSDP_MUON_API_SCOPE("MuonAdamW");
  push_options_to_inner();
  if (impl_->muon) {
    torch::serialize::OutputArchive part;
    impl_->muon->save(part);
    archive.write("muon", part);
  }
  if (impl_->adamw) {
    torch::serialize::OutputArchive part;
    impl_->adamw->save(part);
    archive.write("adamw", part);
  }
}

void MuonAdamW::load(torch::serialize::InputArchive& archive) {
  FSDP_MUON_API_SCOPE("MuonAdamW");
  if (impl_->muon) {
    torch::serialize::InputArchive part;
    archive.read("muon", part);
    impl_->muon->load(part);
  }
  if (impl_->adamw) {
    torch::serialize::InputArchive part;
    archive.read("adamw", part);
    impl_->adamw->load(part);
  }
  pull_options_from_inner();
}

const std::shared_ptr<ShardedModel>& MuonAdamW::model() const { return impl_->model; }
FsdpMuon* MuonAdamW::muon() const { return impl_->muon.get(); }
torch::optim::AdamW* MuonAdamW::adamw() const { return impl_->adamw.get(); }

bool MuonAdamW::uses_muon(const std::string& name) const {
  return impl_->muon_names.count(name) != 0;
}

std::vector<torch::optim::Optimizer*> MuonAdamW::checkpoint_optimizers() const {
  push_options_to_inner();
  std::vector<torch::optim::Optimizer*> out;
  if (impl_->adamw) out.push_back(impl_->adamw.get());
  if (impl_->muon) out.push_back(impl_->muon.get());
  return out;
}

std::string save_checkpoint(const std::string& dir, const ShardedModel& model,
                            const MuonAdamW& optimizer, const SaveCheckpointOptions& options) {
  return save_checkpoint(dir, model.groups(), optimizer.checkpoint_optimizers(), options);
}

CheckpointUserState load_checkpoint(const std::string& dir, const ShardedModel& model,
                                    MuonAdamW& optimizer) {
  CheckpointUserState user =
      load_checkpoint(dir, model.groups(), optimizer.checkpoint_optimizers());
  optimizer.pull_options_from_inner();
  return user;
}

void export_full_checkpoint(const std::string& path, const ShardedModel& model,
                            const MuonAdamW& optimizer) {
  export_full_checkpoint(path, model.groups(), optimizer.checkpoint_optimizers());
}

double clip_grad_norm(const ShardedModel& model, double max_norm, double norm_type,
                      NonFiniteGradients non_finite) {
  return clip_grad_norm(model.groups(), max_norm, norm_type, non_finite);
}

}  // namespace fsdp_muon
