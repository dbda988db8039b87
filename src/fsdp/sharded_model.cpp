#include <fsdp_muon/fsdp/sharded_model.h>

#include <fsdp_muon/fsdp/parameter_group.h>

#include <unordered_map>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "common/check.h"

namespace fsdp_muon {

// The state the autograd hooks reach: shared with them through weak pointers, so a hook that
// outlives its ShardedModel does nothing.
struct FSDP_MUON_LOCAL ShardedModel::Impl {
  DeviceMesh mesh;
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<ShardedModelParameter> parameters;
  std::unordered_map<const c10::TensorImpl*, size_t> group_of_param;  // module tensor -> group
  std::vector<std::pair<at::Tensor, unsigned>> hooks;                 // module tensor, hook id
  bool sync = true;
  bool callback_queued = false;

  // A gradient of this model arrived: the backward that carries it ends with the reduce-scatter.
  // The callback runs once the whole backward has finished, on the thread that ran it (the
  // engine drops it when the backward fails; zero_grad() then forgets the flag).
  void gradient_arrived(const std::weak_ptr<Impl>& self) {
    if (!sync || callback_queued) return;
    callback_queued = true;
    torch::autograd::Engine::get_default_engine().queue_callback([self] {
      if (auto impl = self.lock()) {
        impl->callback_queued = false;
        for (const auto& g : impl->groups) g->reduce_scatter_grads();
      }
    });
  }
};

namespace {

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

ShardedModel::ShardedModel(torch::nn::Module& module, std::shared_ptr<Communicator> comm,
                           const ShardModuleOptions& options)
    : ShardedModel(
          module,
          [&] {
            FSDP_MUON_API_SCOPE("shard");
            FSDP_MUON_CHECK(comm != nullptr, "the communicator is null");
            return one_dimensional_mesh(std::move(comm));
          }(),
          options) {}

ShardedModel::ShardedModel(torch::nn::Module& module, const DeviceMesh& mesh,
                           const ShardModuleOptions& options)
    : impl_(std::make_shared<Impl>()) {
  FSDP_MUON_API_SCOPE("shard");
  Impl& s = *impl_;
  s.mesh = mesh;

  // What each parameter's module says about it, read before sharding re-points the tensors.
  std::unordered_map<std::string, ShardedModelParameter> described;
  std::string last_linear;
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const torch::nn::Module& m = *item.value();
    const bool embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(&m) != nullptr ||
                           dynamic_cast<const torch::nn::EmbeddingBagImpl*>(&m) != nullptr;
    if (dynamic_cast<const torch::nn::LinearImpl*>(&m) != nullptr) last_linear = item.key();
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      ShardedModelParameter d;
      d.name = join_name(item.key(), p.key());
      d.module_type = m.name();
      d.embedding = embedding;
      d.meta = at::empty(p.value().sizes(), p.value().options().device(at::kMeta));
      described.emplace(d.name, std::move(d));
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    named.emplace_back(item.key(), item.value());
  }

  s.groups = shard_module(module, mesh, options);

  std::unordered_map<std::string, std::pair<size_t, size_t>> slot_of;  // name -> (group, index)
  for (size_t g = 0; g < s.groups.size(); ++g) {
    for (size_t i = 0; i < s.groups[g]->num_parameters(); ++i) {
      slot_of.emplace(s.groups[g]->slot(i).name, std::make_pair(g, i));
    }
  }
  for (const auto& [name, tensor] : named) {
    auto it = described.find(name);
    FSDP_MUON_CHECK(it != described.end() && slot_of.count(name) == 1, "parameter '", name,
                    "' is not where named_modules() and the groups put it");
    ShardedModelParameter p = it->second;
    const auto [g, i] = slot_of.at(name);
    p.group = s.groups[g];
    p.index = i;
    const std::string owner =
        name.substr(0, name.rfind('.') == std::string::npos ? 0 : name.rfind('.'));
    p.output_head = !last_linear.empty() && owner == last_linear;
    s.parameters.push_back(std::move(p));
    s.group_of_param.emplace(tensor.unsafeGetTensorImpl(), g);
    if (tensor.requires_grad()) {
      std::weak_ptr<Impl> weak = impl_;
      const unsigned id = tensor.register_hook([weak](const at::Tensor&) {
        if (auto impl = weak.lock()) impl->gradient_arrived(weak);
      });
      s.hooks.emplace_back(tensor, id);
    }
  }
}

ShardedModel::~ShardedModel() {
  for (auto& [tensor, id] : impl_->hooks) tensor.remove_hook(id);
}

const std::vector<std::shared_ptr<FsdpParameterGroup>>& ShardedModel::groups() const {
  return impl_->groups;
}

const std::vector<ShardedModelParameter>& ShardedModel::parameters() const {
  return impl_->parameters;
}

const DeviceMesh& ShardedModel::mesh() const { return impl_->mesh; }

void ShardedModel::zero_grad() {
  impl_->callback_queued = false;
  for (const auto& g : impl_->groups) g->zero_grad();
}

void ShardedModel::set_requires_gradient_sync(bool sync) {
  FSDP_MUON_API_SCOPE("ShardedModel::set_requires_gradient_sync");
  if (!sync) {
    for (const auto& g : impl_->groups) {
      FSDP_MUON_CHECK(
          g->sharding_strategy() == ShardingStrategy::kOptim,
          "cannot turn the sync off (set_requires_gradient_sync(false)): group '", g->name(),
          "' uses sharding strategy ", to_string(g->sharding_strategy()),
          ", which frees the full gradients after each backward, so there is nothing to "
          "accumulate them in: leave the sync on (each backward's reduce-scattered "
          "gradients add up in the gradient shards), or shard with "
          "ShardingStrategy::kOptim");
    }
  }
  impl_->sync = sync;
}

bool ShardedModel::requires_gradient_sync() const { return impl_->sync; }

void ShardedModel::reduce_scatter_grads() {
  for (const auto& g : impl_->groups) g->reduce_scatter_grads();
}

void ShardedModel::refresh_model_weights() {
  for (const auto& g : impl_->groups) g->refresh_model_weights();
}

FsdpParameterGroup& ShardedModel::group_of(const torch::nn::Module& child) const {
  FSDP_MUON_API_SCOPE("ShardedModel::group_of");
  std::optional<size_t> group;
  for (const auto& p : child.parameters(/*recurse=*/true)) {
    auto it = impl_->group_of_param.find(p.unsafeGetTensorImpl());
    FSDP_MUON_CHECK(it != impl_->group_of_param.end(), "module '", child.name(),
                    "' has a parameter (shape ", p.sizes(),
                    ") that is not one of this model's: pass a submodule of the sharded module");
    FSDP_MUON_CHECK(
        !group || *group == it->second, "module '", child.name(), "' has parameters in groups '",
        impl_->groups[*group]->name(), "' and '", impl_->groups[it->second]->name(),
        "'; run a module whose parameters are in one group (ShardModuleOptions::policy "
        "decides the groups), or each group's part through FsdpParameterGroup::forward");
    group = it->second;
  }
  FSDP_MUON_CHECK(group.has_value(), "module '", child.name(),
                  "' has no parameters, so it belongs to no group; call it directly");
  return *impl_->groups[*group];
}

at::Tensor ShardedModel::forward(const torch::nn::Module& child,
                                 const std::function<at::Tensor(const at::Tensor&)>& fn,
                                 const at::Tensor& input) {
  return group_of(child).forward(fn, input);
}

std::shared_ptr<ShardedModel> shard(torch::nn::Module& module, std::shared_ptr<Communicator> comm,
                                    const ShardModuleOptions& options) {
  return std::make_shared<ShardedModel>(module, std::move(comm), options);
}

std::shared_ptr<ShardedModel> shard(torch::nn::Module& module, const DeviceMesh& mesh,
                                    const ShardModuleOptions& options) {
  return std::make_shared<ShardedModel>(module, mesh, options);
}

}  // namespace fsdp_muon
