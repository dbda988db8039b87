#include "fsdp/group_storage.h"

#include <algorithm>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include "common/check.h"

namespace fsdp_muon::fsdp {
namespace {

// A tensor on `buffer`'s memory that is not an autograd view of it: optimizers call detach_()
// on .grad() in zero_grad(), which views refuse, and a sharded parameter should be a leaf with
// no view metadata, exactly like a parameter.
at::Tensor alias(const at::Tensor& buffer, int64_t offset, at::IntArrayRef shape) {
  at::Tensor t = at::empty({0}, buffer.options());
  t.set_(buffer.storage(), buffer.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  return t;
}

}  // namespace

std::string group_label(const std::string& name) {
  return name.empty() ? std::string() : "group '" + name + "': ";
}

int64_t GroupStorage::full_bytes() const {
  return layout.padded_numel * static_cast<int64_t>(c10::elementSize(compute_dtype));
}

void GroupStorage::check_index(size_t index) const {
  FSDP_MUON_CHECK(index < params.size(), label(), "parameter index ", index, " out of range (",
                  params.size(), " parameters)");
}

void GroupStorage::zero_grad() {
  full_grad.zero_();
  grad_shard.zero_();
  // Whatever a set_to_none zero_grad or autograd left in .grad() is stale now: re-point only.
  install_grads(/*keep_foreign=*/false);
}

void GroupStorage::reduce_scatter_grads() {
  install_grads(/*keep_foreign=*/true);
  const at::Tensor send = reduce_dtype == compute_dtype ? full_grad : full_grad.to(reduce_dtype);
  if (reduce_dtype == options.main_dtype()) {
    comm->reduce_scatter_mean(send, grad_shard);
    if (replicated()) {
      start_replica_sum(grad_shard)->wait();
      finish_replica_average(grad_shard);
    }
  } else {
    at::Tensor reduced = at::empty({layout.shard_numel}, send.options());
    comm->reduce_scatter_mean(send, reduced);
    if (replicated()) {
      start_replica_sum(reduced)->wait();
      finish_replica_average(reduced);
    }
    grad_shard.copy_(reduced);
  }
}

std::unique_ptr<CommWork> GroupStorage::start_replica_sum(const at::Tensor& reduced) const {
  // A sum, not a mean: Communicator has no all-reduce mean, and dividing once afterwards is the
  // same rounding the reduce-scatter's mean does. The all-reduce hands every replica the same
  // bits (each element is reduced once and then copied), so the replicas stay identical.
  return mesh.replicate->all_reduce_async(reduced, ReduceOp::kSum);
}

void GroupStorage::finish_replica_average(const at::Tensor& reduced) const {
  reduced.div_(mesh.replicas());
}

void GroupStorage::refresh_model_weights() {
  const at::Tensor send =
      options.main_dtype() == compute_dtype ? main_shard : main_shard.to(compute_dtype);
  comm->all_gather(send, model_weights);
  // The weights changed under the parameters' feet: bump their version counters so autograd
  // rejects a backward through a graph that saved the old values.
  for (const at::Tensor& p : params) p.unsafeGetTensorImpl()->bump_version();
}

void GroupStorage::install_grads(bool keep_foreign) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& param = params[i];
    if (!param.requires_grad()) {
      // Frozen parameters get no gradient, so optimizers skip them (stock convention).
      if (param.grad().defined()) param.mutable_grad() = at::Tensor();
      if (sharded[i].grad().defined()) sharded[i].mutable_grad() = at::Tensor();
      continue;
    }
    const at::Tensor& grad = param.grad();
    if (!grad.defined() || !grad.is_same(grad_views[i])) {
      if (keep_foreign) {
        if (grad.defined()) {
          FSDP_MUON_CHECK(grad.sizes() == grad_views[i].sizes() && !grad.is_sparse(), label(),
                          "the .grad() of parameter '", layout.slots[i].name, "' has shape ",
                          grad.sizes(), " (or is sparse); expected a dense ",
                          grad_views[i].sizes());
          grad_views[i].copy_(grad);
        } else {
          grad_views[i].zero_();
        }
      }
      param.mutable_grad() = grad_views[i];
    }
    if (!sharded[i].grad().is_same(shard_grads[i])) sharded[i].mutable_grad() = shard_grads[i];
  }
}

void GroupStorage::install_shard_grads() {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) {
      if (sharded[i].grad().defined()) sharded[i].mutable_grad() = at::Tensor();
    } else if (!sharded[i].grad().is_same(shard_grads[i])) {
      sharded[i].mutable_grad() = shard_grads[i];
    }
  }
}

void GroupStorage::check_parameters_alias() const {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& v = weight_views[i];
    FSDP_MUON_CHECK(p.is_alias_of(v) && p.storage_offset() == v.storage_offset() &&
                        p.sizes() == v.sizes() && p.strides() == v.strides() &&
                        p.scalar_type() == v.scalar_type(),
                    label(), "parameter '", layout.slots[i].name,
                    "' no longer points into the group's model-weight buffer (was the module "
                    "moved or cast, e.g. with Module::to(), after sharding?). Move or cast the "
                    "module before sharding it.");
  }
}

ValidatedParameters validate_parameters(
    GroupStorage& s, const std::vector<std::pair<std::string, at::Tensor>>& named_params) {
  const std::string who = s.label();
  const c10::Device device = s.comm->device();
  FSDP_MUON_CHECK(!named_params.empty(), who, "no parameters given; a group needs at least one");
  ValidatedParameters v;
  v.param_dtype = named_params.front().second.defined() ? named_params.front().second.scalar_type()
                                                        : at::kFloat;
  std::unordered_set<std::string> names;
  std::unordered_set<const c10::TensorImpl*> impls;
  v.named_shapes.reserve(named_params.size());
  for (const auto& [name, t] : named_params) {
    FSDP_MUON_CHECK(!name.empty(), who,
                    "a parameter has an empty name; every parameter needs a "
                    "unique non-empty name (they key checkpoints and error messages)");
    FSDP_MUON_CHECK(names.insert(name).second, who, "parameter name '", name,
                    "' appears twice; names must be unique within a group");
    FSDP_MUON_CHECK(t.defined(), who, "parameter '", name, "' is an undefined tensor");
    FSDP_MUON_CHECK(impls.insert(t.unsafeGetTensorImpl()).second, who, "parameter '", name,
                    "' is the same tensor as an earlier parameter (tied weights); pass it once");
    FSDP_MUON_CHECK(
        t.layout() == at::kStrided && !t.is_mkldnn() && !t.is_quantized() && !t.is_nested(), who,
        "parameter '", name, "' is not a dense strided tensor (layout ", t.layout(),
        "); only dense parameters can be sharded");
    FSDP_MUON_CHECK(at::isFloatingType(t.scalar_type()), who, "parameter '", name, "' has dtype ",
                    t.scalar_type(), "; only floating-point parameters can be sharded");
    FSDP_MUON_CHECK(
        t.scalar_type() == v.param_dtype, who, "parameter '", name, "' has dtype ", t.scalar_type(),
        " but '", named_params.front().first, "' has ", v.param_dtype,
        "; all parameters of a group must share one dtype (put them in separate groups, "
        "e.g. with a ShardModuleOptions::policy)");
    FSDP_MUON_CHECK(t.device() == device, who, "parameter '", name, "' is on ", t.device(),
                    " but the communicator (", s.comm->backend_name(), ") moves tensors on ",
                    device, "; move the module to ", device, " before sharding");
    FSDP_MUON_CHECK(t.is_leaf(), who, "parameter '", name,
                    "' is not a leaf tensor (it has a grad_fn); shard the module's parameters, not "
                    "results of computations");
    v.named_shapes.emplace_back(name, t.sizes().vec());
  }
  s.compute_dtype = s.options.compute_dtype().value_or(v.param_dtype);
  s.reduce_dtype = s.options.reduce_dtype().value_or(s.compute_dtype);
  FSDP_MUON_CHECK(at::isFloatingType(s.compute_dtype), who, "compute dtype ", s.compute_dtype,
                  " is not a floating-point type");
  FSDP_MUON_CHECK(at::isFloatingType(s.options.main_dtype()), who, "main dtype ",
                  s.options.main_dtype(), " is not a floating-point type");
  FSDP_MUON_CHECK(at::isFloatingType(s.reduce_dtype), who, "reduce dtype ", s.reduce_dtype,
                  " is not a floating-point type");
  const auto element_size = static_cast<int64_t>(c10::elementSize(s.compute_dtype));
  const int64_t alignment_bytes = s.options.alignment_bytes();
  FSDP_MUON_CHECK(alignment_bytes >= 1 &&
                      (alignment_bytes <= element_size || alignment_bytes % element_size == 0),
                  who, "alignment_bytes ", alignment_bytes, " must be positive and a multiple of ",
                  "the compute dtype's element size (", element_size, " bytes)");
  v.alignment = std::max<int64_t>(1, alignment_bytes / element_size);
  return v;
}

void allocate_buffers(GroupStorage& s,
                      const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                      c10::ScalarType param_dtype) {
  at::NoGradGuard no_grad;
  const int64_t padded = s.layout.padded_numel;
  const int64_t shard = s.layout.shard_numel;
  // Pack the parameters in their own dtype first, so rank 0's values are broadcast exactly and
  // the main weights start from them rather than from a compute-dtype rounding.
  const auto param_options = at::TensorOptions().dtype(param_dtype).device(s.comm->device());
  at::Tensor staging = at::zeros({padded}, param_options);
  for (size_t i = 0; i < named_params.size(); ++i) {
    const ParameterSlot& slot = s.layout.slots[i];
    staging.narrow(0, slot.offset, slot.numel).copy_(named_params[i].second.reshape({-1}));
  }
  if (s.options.broadcast_from_rank0()) {
    // World rank 0's values to every rank in two steps that move the fewest bytes between
    // replicas (docs/DESIGN.md §2, Meshes): world rank 0 sends one copy to shard rank 0 of every
    // other replica (the other shard ranks' replicate groups have nothing to send and skip it),
    // then each replica broadcasts within its shard group. A broadcast over the world would send
    // (replicas - 1) * shard_size copies across replicas instead of replicas - 1. On a 1-D mesh
    // only the second step runs: today's broadcast.
    if (s.replicated() && s.comm->rank() == 0) s.mesh.replicate->broadcast(staging, 0);
    if (s.comm->size() > 1) s.comm->broadcast(staging, 0);
  }
  s.main_shard = staging.narrow(0, static_cast<int64_t>(s.comm->rank()) * shard, shard)
                     .to(s.options.main_dtype(), /*non_blocking=*/false, /*copy=*/true);
  s.model_weights = s.compute_dtype == param_dtype ? staging : staging.to(s.compute_dtype);
  staging = at::Tensor();
  s.full_grad = at::zeros({padded}, param_options.dtype(s.compute_dtype));
  s.grad_shard = at::zeros({shard}, param_options.dtype(s.options.main_dtype()));
}

void attach_parameters(GroupStorage& s,
                       std::vector<std::pair<std::string, at::Tensor>> named_params) {
  at::NoGradGuard no_grad;
  const int rank = s.comm->rank();
  for (size_t i = 0; i < named_params.size(); ++i) {
    const ParameterSlot& slot = s.layout.slots[i];
    at::Tensor param = std::move(named_params[i].second);
    s.weight_views.push_back(s.model_weights.narrow(0, slot.offset, slot.numel).view(slot.shape));
    s.grad_views.push_back(alias(s.full_grad, slot.offset, slot.shape));
    // set_data keeps the tensor object (and so the module's registration, requires_grad and
    // autograd identity) and swaps its storage for the view.
    param.set_data(s.weight_views.back());
    s.params.push_back(std::move(param));

    const auto [first, second] = s.layout.held_range(i, rank);
    const int64_t local = s.layout.shard_offset(i, rank);
    const int64_t len = second - first;
    at::Tensor sp = alias(s.main_shard, local, {len});
    sp.requires_grad_(s.params.back().requires_grad());
    s.sharded.push_back(std::move(sp));
    s.shard_grads.push_back(alias(s.grad_shard, local, {len}));
  }
  s.install_grads(/*keep_foreign=*/false);
}

}  // namespace fsdp_muon::fsdp
