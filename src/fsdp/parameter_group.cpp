#include <fsdp_muon/fsdp/parameter_group.h>

#include <algorithm>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include "comm/agreement.h"
#include "fsdp/backward_hooks.h"
#include "fsdp/flat_layout.h"
#include "fsdp/group_agreement.h"
#include "fsdp/sharding_schedule.h"
#include "fsdp/storage_bytes.h"

namespace fsdp_muon {
namespace {

// Sharded parameter -> its group. Keyed by TensorImpl because optimizers hand back tensors
// that share the impl (copies of the handle), never a new one for the same parameter. The
// group pointer is raw: entries are erased (under the mutex) at the top of the group's
// destructor, so a pointer found under the mutex is always alive, and weak_from_this() then
// says whether a shared_ptr still owns it.
struct RegistryEntry {
  FsdpParameterGroup* group = nullptr;
  size_t index = 0;
};

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<const c10::TensorImpl*, RegistryEntry>& registry() {
  static std::unordered_map<const c10::TensorImpl*, RegistryEntry> map;
  return map;
}

// A tensor on `buffer`'s memory that is not an autograd view of it: optimizers call detach_()
// on .grad() in zero_grad(), which views refuse, and a sharded parameter should be a leaf with
// no view metadata, exactly like a parameter.
at::Tensor alias(const at::Tensor& buffer, int64_t offset, at::IntArrayRef shape) {
  at::Tensor t = at::empty({0}, buffer.options());
  t.set_(buffer.storage(), buffer.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  return t;
}

// The start of every message: "fsdp_muon::FsdpParameterGroup: " and, for a named group,
// "group '<name>': ".
std::string label(const std::string& name) {
  const std::string api = "fsdp_muon::FsdpParameterGroup: ";
  return name.empty() ? api : api + "group '" + name + "': ";
}

}  // namespace

struct FsdpParameterGroup::Impl final : public fsdp::ScheduledGroup,
                                        public fsdp::BackwardParticipant {
  std::shared_ptr<Communicator> comm;
  FsdpParameterGroupOptions options;
  fsdp::FlatLayout layout;
  c10::ScalarType compute_dtype = at::kFloat;
  c10::ScalarType reduce_dtype = at::kFloat;

  std::vector<at::Tensor> params;        // the module's own tensors
  std::vector<at::Tensor> weight_views;  // their views into model_weights
  std::vector<at::Tensor> grad_views;    // their .grad(): views into full_grad
  std::vector<at::Tensor> sharded;       // 1-D slices of main_shard
  std::vector<at::Tensor> shard_grads;   // their .grad(): slices of grad_shard

  at::Tensor model_weights;  // padded, compute dtype
  at::Tensor full_grad;      // padded, compute dtype
  at::Tensor main_shard;     // shard_numel, main dtype
  at::Tensor grad_shard;     // shard_numel, main dtype

  // ---- full sharding (docs/DESIGN.md §2, Sharding strategies) ----
  ShardingStrategy strategy = ShardingStrategy::kOptim;
  std::shared_ptr<fsdp::ShardingSchedule> schedule;
  std::shared_ptr<fsdp::ForwardOrder> order = std::make_shared<fsdp::ForwardOrder>();
  int64_t participant = -1;  // id autograd's hooks find this group by
  // kOptimGradsParams with main dtype != compute dtype: the main weights cast to the compute
  // dtype, what the next gather sends (refresh_model_weights() casts into it).
  at::Tensor compute_shard;
  enum class Weights { kLive, kGathering, kResharded };
  Weights weights = Weights::kLive;
  bool user_unsharded = false;  // unshard() called, reshard() not yet
  // One backward pass of this group: kAccumulating from its pre-backward until its gradients
  // are complete (or the pass ends), kReduced after the reduce-scatter was issued.
  enum class Pass { kIdle, kAccumulating, kReduced };
  Pass pass = Pass::kIdle;
  size_t grads_pending = 0;
  bool has_frozen = false;  // a parameter without requires_grad: its weights may be read by
                            // backward nodes after the others' gradients are complete
  bool shard_fresh = true;  // grad_shard zero since zero_grad(): the next reduction writes it
  struct Reduction {
    at::Tensor send;                 // full_grad itself, or its cast to the reduce dtype
    at::Tensor recv;                 // grad_shard itself, or a shard in the reduce dtype
    int64_t cast_bytes = 0;          // bytes of `send` when it is a cast copy
    bool into_shard = false;         // recv is grad_shard
    bool first = false;              // the first reduction since zero_grad(): copy, not add
    std::unique_ptr<CommWork> work;  // declared last: destroyed (and waited for) first
  };
  std::optional<Reduction> reduction;
  int64_t cast_bytes_held = 0;
  int64_t peak_bytes = 0;
  std::unique_ptr<CommWork> gather;  // into model_weights; after the buffers so it dies first

  std::string label() const { return fsdp_muon::label(options.name()); }

  bool shards_grads() const { return strategy != ShardingStrategy::kOptim; }
  bool shards_weights() const { return strategy == ShardingStrategy::kOptimGradsParams; }
  int64_t full_bytes() const {
    return layout.padded_numel * static_cast<int64_t>(c10::elementSize(compute_dtype));
  }
  int64_t held_bytes() const {
    return fsdp::storage_bytes(model_weights) + fsdp::storage_bytes(full_grad) + cast_bytes_held;
  }
  void account(int64_t delta) {
    if (delta == 0) return;
    schedule->add_unsharded_bytes(delta);
    peak_bytes = std::max(peak_bytes, held_bytes());
  }

  // ---- model weights ----
  const at::Tensor& gather_source() const {
    return compute_shard.defined() ? compute_shard : main_shard;
  }
  void start_gather() {
    account(fsdp::set_storage_bytes(model_weights, full_bytes()));
    // Written through model_weights, whose version counter is not the parameters': autograd's
    // saved parameters stay valid when backward gathers the same values again.
    gather = comm->all_gather_async(gather_source(), model_weights);
    weights = Weights::kGathering;
  }
  void wait_gather() {
    if (weights != Weights::kGathering) return;
    std::unique_ptr<CommWork> work = std::move(gather);
    work->wait();
    weights = Weights::kLive;
    // set_data keeps each parameter's identity, version counter and autograd metadata (and so
    // autograd's saved parameters) and points it at the gathered weights again.
    for (size_t i = 0; i < params.size(); ++i) params[i].set_data(weight_views[i]);
  }
  void ensure_weights() {
    if (weights == Weights::kResharded) start_gather();
    wait_gather();
  }
  void free_weights() {
    wait_gather();
    // The parameters let go of the storage and refuse every access with this message, ATen's
    // own check: a resharded weight used outside forward() is a clear error, never stale values
    // and never a read of freed memory (docs/DESIGN.md §2).
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].unsafeGetTensorImpl()->release_storage_and_set_meta_custom_data_ptr_error_msg_(
          label() + "parameter '" + layout.slots[i].name +
          "' is resharded (sharding strategy optim_grads_params): its weights exist only "
          "inside the group's forward() and the backward of what forward() computed, or "
          "between unshard() and reshard(). Call the module through group->forward(fn, "
          "input), or call group->unshard() before using its parameters directly (and "
          "group->reshard() once their backward has run)");
    }
    account(fsdp::set_storage_bytes(model_weights, 0));
    weights = Weights::kResharded;
  }
  void prefetch_weights() override {
    if (shards_weights() && weights == Weights::kResharded) start_gather();
  }
  // Outside forward()/backward and unshard(): give the weights back (a prefetch nobody used).
  void settle_weights() {
    if (shards_weights() && !user_unsharded && weights != Weights::kResharded) free_weights();
  }

  // ---- full gradients ----
  void allocate_grads() {
    account(fsdp::set_storage_bytes(full_grad, full_bytes()));
    full_grad.zero_();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].requires_grad()) params[i].mutable_grad() = grad_views[i];
    }
  }
  void detach_module_grads() {
    for (at::Tensor& p : params) {
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();
    }
  }
  void free_grads() {
    detach_module_grads();
    account(fsdp::set_storage_bytes(full_grad, 0));
  }

  // ---- autograd's calls (fsdp/backward_hooks.h) ----
  void pre_backward() override {
    at::NoGradGuard no_grad;
    if (pass == Pass::kIdle) {
      finish_reduction();  // the previous micro-batch's, if still in flight
      if (shards_weights()) ensure_weights();
      grads_pending = 0;
      has_frozen = false;
      for (const at::Tensor& p : params) {
        if (p.requires_grad()) {
          ++grads_pending;
        } else {
          has_frozen = true;
        }
      }
      if (grads_pending > 0) allocate_grads();
      pass = grads_pending > 0 ? Pass::kAccumulating : Pass::kReduced;
      schedule->began_backward(this);
    }
    if (options.prefetch()) {
      if (fsdp::ScheduledGroup* previous = order->before(this)) previous->prefetch_weights();
    }
  }

  void gradient_accumulated(size_t index) override {
    at::NoGradGuard no_grad;
    TORCH_CHECK(pass == Pass::kAccumulating, label(), "parameter '", layout.slots[index].name,
                "' received a gradient outside the group's forward(): under sharding strategy ",
                to_string(strategy),
                " a group collects gradients only for what its forward() computed. Call the "
                "module through group->forward(fn, input), or use ShardingStrategy::kOptim");
    at::Tensor& param = params[index];
    if (!param.grad().is_same(grad_views[index])) {
      // Autograd replaced the view (create_graph=true sums out of place): keep its sum.
      if (param.grad().defined()) grad_views[index].copy_(param.grad());
      param.mutable_grad() = grad_views[index];
    }
    TORCH_CHECK(grads_pending > 0, label(), "internal error: more gradients than parameters");
    if (--grads_pending == 0) start_reduction();
  }

  // ---- reduce-scatter of the full gradients into the gradient shard ----
  void start_reduction() {
    at::NoGradGuard no_grad;
    detach_module_grads();  // nothing may accumulate into what is being sent
    Reduction r;
    if (reduce_dtype == compute_dtype) {
      r.send = full_grad;
    } else {
      r.send = full_grad.to(reduce_dtype);
      r.cast_bytes = fsdp::storage_bytes(r.send);
      cast_bytes_held += r.cast_bytes;
      account(r.cast_bytes);
      account(fsdp::set_storage_bytes(full_grad, 0));
    }
    // The first reduction after zero_grad() writes the shard exactly as kOptim's single
    // reduce-scatter does; later micro-batches add into it.
    r.first = shard_fresh;
    r.into_shard = shard_fresh && reduce_dtype == options.main_dtype();
    r.recv = r.into_shard ? grad_shard : at::empty({layout.shard_numel}, r.send.options());
    r.work = comm->reduce_scatter_mean_async(r.send, r.recv);
    shard_fresh = false;
    reduction = std::move(r);
    pass = Pass::kReduced;
    if (shards_weights() && !has_frozen && !user_unsharded) free_weights();
    if (options.prefetch()) {
      schedule->reduction_started(this);
    } else {
      finish_reduction();
    }
  }

  void finish_reduction() override {
    if (!reduction) return;
    Reduction r = std::move(*reduction);
    reduction.reset();
    schedule->reduction_finished(this);
    r.work->wait();
    at::NoGradGuard no_grad;
    if (!r.into_shard) {
      if (r.first) {
        grad_shard.copy_(r.recv);
      } else {
        grad_shard.add_(r.recv);
      }
    }
    if (r.cast_bytes > 0) {
      cast_bytes_held -= r.cast_bytes;
      r.send = at::Tensor();
      account(-r.cast_bytes);
    } else {
      account(fsdp::set_storage_bytes(full_grad, 0));
    }
  }

  void end_backward() override {
    // Parameters that got no gradient in this pass never completed the count: their full
    // gradients are zero, and the reduction goes out now, in the order the groups began.
    if (pass == Pass::kAccumulating) start_reduction();
    pass = Pass::kIdle;
    settle_weights();
  }

  // A backward pass that threw never ended: drop what it left.
  void abandon_backward() {
    if (pass == Pass::kIdle) return;
    pass = Pass::kIdle;
    schedule->abandon_backward();
  }

  void check_index(size_t index) const {
    TORCH_CHECK(index < params.size(), label(), "parameter index ", index, " out of range (",
                params.size(), " parameters)");
  }

  // Points .grad() of the module parameters and of the sharded parameters back at the
  // buffers. A module gradient that autograd re-created elsewhere (after a set_to_none
  // zero_grad, or with create_graph=true) is first copied into the buffer so nothing is lost;
  // an undefined one means nothing was accumulated since it was cleared, i.e. zeros.
  void install_grads(bool keep_foreign) {
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
            TORCH_CHECK(grad.sizes() == grad_views[i].sizes() && !grad.is_sparse(), label(),
                        "the .grad() of parameter '", layout.slots[i].name, "' has shape ",
                        grad.sizes(), " (or is sparse); expected a dense ", grad_views[i].sizes());
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

  // Points .grad() of the sharded parameters (those that require grad) at the gradient shard.
  void install_shard_grads() {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].requires_grad()) {
        if (sharded[i].grad().defined()) sharded[i].mutable_grad() = at::Tensor();
      } else if (!sharded[i].grad().is_same(shard_grads[i])) {
        sharded[i].mutable_grad() = shard_grads[i];
      }
    }
  }

  void check_model_parameters_alias() const {
    if (weights != Weights::kLive) return;  // resharded parameters hold no storage to compare
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      const at::Tensor& v = weight_views[i];
      TORCH_CHECK(p.is_alias_of(v) && p.storage_offset() == v.storage_offset() &&
                      p.sizes() == v.sizes() && p.strides() == v.strides() &&
                      p.scalar_type() == v.scalar_type(),
                  label(), "parameter '", layout.slots[i].name,
                  "' no longer points into the group's model-weight buffer (was the module "
                  "moved or cast, e.g. with Module::to(), after sharding?). Move or cast the "
                  "module before sharding it.");
    }
  }
};

FsdpParameterGroup::FsdpParameterGroup(std::vector<std::pair<std::string, at::Tensor>> named_params,
                                       std::shared_ptr<Communicator> comm,
                                       FsdpParameterGroupOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.options = std::move(options);
  const std::string who = d.label();
  TORCH_CHECK(comm != nullptr, who, "the communicator is null");
  d.comm = std::move(comm);

  // ---- validate, then agree across ranks before the first collective ----
  // A local error is not thrown here but described, so that every rank learns of it through
  // the same exchange and throws too: a rank that threw alone would leave the others hanging in
  // the broadcast below (docs/DESIGN.md §5, Agreement).
  const c10::Device device = d.comm->device();
  c10::ScalarType param_dtype = at::kFloat;
  std::vector<std::pair<std::string, std::vector<int64_t>>> named_shapes;
  int64_t element_size = 1;
  int64_t alignment_bytes = 1;
  auto validate = [&] {
    TORCH_CHECK(!named_params.empty(), who, "no parameters given; a group needs at least one");
    param_dtype = named_params.front().second.defined() ? named_params.front().second.scalar_type()
                                                        : at::kFloat;
    std::unordered_set<std::string> names;
    std::unordered_set<const c10::TensorImpl*> impls;
    named_shapes.reserve(named_params.size());
    for (const auto& [name, t] : named_params) {
      TORCH_CHECK(!name.empty(), who,
                  "a parameter has an empty name; every parameter needs a "
                  "unique non-empty name (they key checkpoints and error messages)");
      TORCH_CHECK(names.insert(name).second, who, "parameter name '", name,
                  "' appears twice; names must be unique within a group");
      TORCH_CHECK(t.defined(), who, "parameter '", name, "' is an undefined tensor");
      TORCH_CHECK(impls.insert(t.unsafeGetTensorImpl()).second, who, "parameter '", name,
                  "' is the same tensor as an earlier parameter (tied weights); pass it once");
      TORCH_CHECK(
          t.layout() == at::kStrided && !t.is_mkldnn() && !t.is_quantized() && !t.is_nested(), who,
          "parameter '", name, "' is not a dense strided tensor (layout ", t.layout(),
          "); only dense parameters can be sharded");
      TORCH_CHECK(at::isFloatingType(t.scalar_type()), who, "parameter '", name, "' has dtype ",
                  t.scalar_type(), "; only floating-point parameters can be sharded");
      TORCH_CHECK(t.scalar_type() == param_dtype, who, "parameter '", name, "' has dtype ",
                  t.scalar_type(), " but '", named_params.front().first, "' has ", param_dtype,
                  "; all parameters of a group must share one dtype (put them in separate groups, "
                  "e.g. with a ShardModuleOptions::policy)");
      TORCH_CHECK(t.device() == device, who, "parameter '", name, "' is on ", t.device(),
                  " but the communicator (", d.comm->backend_name(), ") moves tensors on ", device,
                  "; move the module to ", device, " before sharding");
      TORCH_CHECK(t.is_leaf(), who, "parameter '", name,
                  "' is not a leaf tensor (it has a grad_fn); shard the module's parameters, not "
                  "results of computations");
      named_shapes.emplace_back(name, t.sizes().vec());
    }
    d.compute_dtype = d.options.compute_dtype().value_or(param_dtype);
    d.reduce_dtype = d.options.reduce_dtype().value_or(d.compute_dtype);
    TORCH_CHECK(at::isFloatingType(d.compute_dtype), who, "compute dtype ", d.compute_dtype,
                " is not a floating-point type");
    TORCH_CHECK(at::isFloatingType(d.options.main_dtype()), who, "main dtype ",
                d.options.main_dtype(), " is not a floating-point type");
    TORCH_CHECK(at::isFloatingType(d.reduce_dtype), who, "reduce dtype ", d.reduce_dtype,
                " is not a floating-point type");
    element_size = static_cast<int64_t>(c10::elementSize(d.compute_dtype));
    alignment_bytes = d.options.alignment_bytes();
    TORCH_CHECK(alignment_bytes >= 1 &&
                    (alignment_bytes <= element_size || alignment_bytes % element_size == 0),
                who, "alignment_bytes ", alignment_bytes, " must be positive and a multiple of ",
                "the compute dtype's element size (", element_size, " bytes)");
  };
  std::vector<std::string> description;
  try {
    validate();
    description = fsdp::describe_group(named_params, d.options);
  } catch (...) {
    description = {"error", detail::current_exception_message()};
  }
  const std::string text = fsdp::join_lines(description);
  const std::vector<int> differ = detail::ranks_that_differ(*d.comm, text);
  if (!differ.empty()) {
    const std::vector<std::string> texts = fsdp::gather_descriptions(*d.comm, text);
    std::string ranks;
    for (const int r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    const int r = differ.front();
    TORCH_CHECK(false, who, "the ranks built different groups (rank",
                differ.size() > 1 ? "s " : " ", ranks, " differ", differ.size() > 1 ? "" : "s",
                " from rank 0; this is rank ", d.comm->rank(), " of ", d.comm->size(),
                "); first difference, ",
                fsdp::first_difference(fsdp::split_lines(texts[0]), fsdp::split_lines(texts[r]), r),
                ". Every rank must build the same group: the same parameters, names, shapes and "
                "dtypes in the same order, and the same options");
  }
  // Every rank failed alike (or this is a world of one): the local message is the error.
  TORCH_CHECK(description[0] == "ok", description[1]);

  // ---- layout ----
  const int world = d.comm->size();
  const int rank = d.comm->rank();
  d.layout = fsdp::compute_flat_layout(named_shapes,
                                       std::max<int64_t>(1, alignment_bytes / element_size), world);
  const int64_t padded = d.layout.padded_numel;
  const int64_t shard = d.layout.shard_numel;

  // ---- buffers ----
  at::NoGradGuard no_grad;
  // Pack the parameters in their own dtype first, so rank 0's values are broadcast exactly and
  // the main weights start from them rather than from a compute-dtype rounding.
  const auto param_options = at::TensorOptions().dtype(param_dtype).device(device);
  at::Tensor staging = at::zeros({padded}, param_options);
  for (size_t i = 0; i < named_params.size(); ++i) {
    const ParameterSlot& slot = d.layout.slots[i];
    staging.narrow(0, slot.offset, slot.numel).copy_(named_params[i].second.reshape({-1}));
  }
  if (d.options.broadcast_from_rank0() && world > 1) d.comm->broadcast(staging, 0);
  d.main_shard = staging.narrow(0, static_cast<int64_t>(rank) * shard, shard)
                     .to(d.options.main_dtype(), /*non_blocking=*/false, /*copy=*/true);
  d.model_weights = d.compute_dtype == param_dtype ? staging : staging.to(d.compute_dtype);
  staging = at::Tensor();
  d.full_grad = at::zeros({padded}, param_options.dtype(d.compute_dtype));
  d.grad_shard = at::zeros({shard}, param_options.dtype(d.options.main_dtype()));

  // ---- views ----
  for (size_t i = 0; i < named_params.size(); ++i) {
    const ParameterSlot& slot = d.layout.slots[i];
    at::Tensor param = named_params[i].second;
    d.weight_views.push_back(d.model_weights.narrow(0, slot.offset, slot.numel).view(slot.shape));
    d.grad_views.push_back(alias(d.full_grad, slot.offset, slot.shape));
    // set_data keeps the tensor object (and so the module's registration, requires_grad and
    // autograd identity) and swaps its storage for the view.
    param.set_data(d.weight_views.back());
    d.params.push_back(std::move(param));

    const auto [first, second] = d.layout.held_range(i, rank);
    const int64_t local = d.layout.shard_offset(i, rank);
    const int64_t len = second - first;
    at::Tensor sp = alias(d.main_shard, local, {len});
    sp.requires_grad_(d.params.back().requires_grad());
    d.sharded.push_back(std::move(sp));
    d.shard_grads.push_back(alias(d.grad_shard, local, {len}));
  }
  d.install_grads(/*keep_foreign=*/false);

  // ---- sharding strategy (docs/DESIGN.md §2, Sharding strategies) ----
  d.strategy = d.options.sharding_strategy();
  d.schedule = fsdp::ShardingSchedule::of(*d.comm);
  d.account(d.held_bytes());
  if (d.shards_grads()) {
    d.participant = fsdp::register_participant(&d);
    for (size_t i = 0; i < d.params.size(); ++i) {
      if (d.params[i].requires_grad()) fsdp::set_accumulate_hook(d.params[i], d.participant, i);
    }
    d.free_grads();
  }
  if (d.shards_weights()) {
    if (d.options.main_dtype() != d.compute_dtype)
      d.compute_shard = d.main_shard.to(d.compute_dtype);
    d.free_weights();
  }

  std::lock_guard<std::mutex> lock(registry_mutex());
  for (size_t i = 0; i < d.sharded.size(); ++i) {
    registry()[d.sharded[i].unsafeGetTensorImpl()] = RegistryEntry{this, i};
  }
}

FsdpParameterGroup::~FsdpParameterGroup() {
  Impl& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (const at::Tensor& sp : d.sharded) {
      auto it = registry().find(sp.unsafeGetTensorImpl());
      if (it != registry().end() && it->second.group == this) registry().erase(it);
    }
  }
  if (d.participant >= 0) {
    fsdp::unregister_participant(d.participant);
    for (const at::Tensor& p : d.params) {
      if (p.requires_grad()) fsdp::clear_accumulate_hook(p);
    }
  }
  // Collectives in flight finish before their buffers go (CommWork's destructor waits).
  d.gather.reset();
  d.reduction.reset();
  d.schedule->remove(&d);
  d.order->remove(&d);
  d.schedule->add_unsharded_bytes(-d.held_bytes());
}

const std::string& FsdpParameterGroup::name() const { return impl_->options.name(); }
size_t FsdpParameterGroup::num_parameters() const { return impl_->params.size(); }

const ParameterSlot& FsdpParameterGroup::slot(size_t index) const {
  impl_->check_index(index);
  return impl_->layout.slots[index];
}

int64_t FsdpParameterGroup::padded_numel() const { return impl_->layout.padded_numel; }
int64_t FsdpParameterGroup::shard_numel() const { return impl_->layout.shard_numel; }

std::pair<int64_t, int64_t> FsdpParameterGroup::held_range(size_t index, int rank) const {
  impl_->check_index(index);
  return impl_->layout.held_range(index, rank);
}

std::pair<int64_t, int64_t> FsdpParameterGroup::held_range(size_t index) const {
  return held_range(index, impl_->comm->rank());
}

int64_t FsdpParameterGroup::shard_offset(size_t index, int rank) const {
  impl_->check_index(index);
  return impl_->layout.shard_offset(index, rank);
}

std::optional<size_t> FsdpParameterGroup::index_of(const std::string& name) const {
  for (size_t i = 0; i < impl_->layout.slots.size(); ++i) {
    if (impl_->layout.slots[i].name == name) return i;
  }
  return std::nullopt;
}

c10::ScalarType FsdpParameterGroup::compute_dtype() const { return impl_->compute_dtype; }
c10::ScalarType FsdpParameterGroup::main_dtype() const { return impl_->options.main_dtype(); }

const std::shared_ptr<Communicator>& FsdpParameterGroup::communicator() const {
  return impl_->comm;
}

const FsdpParameterGroupOptions& FsdpParameterGroup::options() const { return impl_->options; }

std::vector<at::Tensor> FsdpParameterGroup::sharded_parameters() const { return impl_->sharded; }

const at::Tensor& FsdpParameterGroup::sharded_parameter(size_t index) const {
  impl_->check_index(index);
  return impl_->sharded[index];
}

const at::Tensor& FsdpParameterGroup::model_weights() const {
  const Impl& d = *impl_;
  // The buffer of a resharded group has no bytes; a kernel reading it would read a null
  // pointer, so the accessor refuses instead (docs/DESIGN.md §2).
  TORCH_CHECK(d.weights == Impl::Weights::kLive, d.label(),
              "model_weights(): the model weights are resharded (sharding strategy ",
              to_string(d.strategy), "); call unshard() first, and reshard() when done");
  return d.model_weights;
}

const at::Tensor& FsdpParameterGroup::full_grad_buffer() const {
  const Impl& d = *impl_;
  TORCH_CHECK(!d.shards_grads() || fsdp::storage_bytes(d.full_grad) > 0, d.label(),
              "full_grad_buffer(): under sharding strategy ", to_string(d.strategy),
              " the full gradients exist only during the group's backward and are "
              "reduce-scattered into grad_shard() as soon as they are complete; read "
              "grad_shard() instead");
  return d.full_grad;
}
const at::Tensor& FsdpParameterGroup::main_weight_shard() const { return impl_->main_shard; }
const at::Tensor& FsdpParameterGroup::grad_shard() const { return impl_->grad_shard; }
std::vector<at::Tensor> FsdpParameterGroup::model_parameters() const { return impl_->params; }

void FsdpParameterGroup::zero_grad() {
  Impl& d = *impl_;
  at::NoGradGuard no_grad;
  if (d.shards_grads()) {
    // A reduction in flight would write the shard after it is zeroed: finish it first.
    d.finish_reduction();
    d.abandon_backward();
    d.free_grads();
    d.settle_weights();
    d.grad_shard.zero_();
    d.shard_fresh = true;
    d.install_shard_grads();
    return;
  }
  d.full_grad.zero_();
  d.grad_shard.zero_();
  // Whatever a set_to_none zero_grad or autograd left in .grad() is stale now: re-point only.
  d.install_grads(/*keep_foreign=*/false);
}

void FsdpParameterGroup::reduce_scatter_grads() {
  Impl& d = *impl_;
  at::NoGradGuard no_grad;
  if (d.shards_grads()) {
    // The reduce-scatters were issued during backward (docs/DESIGN.md §2): wait for this
    // group's, and give back the weights of a prefetch no backward used.
    if (d.pass != Impl::Pass::kIdle) d.end_backward();
    d.finish_reduction();
    d.settle_weights();
    for (size_t i = 0; i < d.params.size(); ++i) {
      TORCH_CHECK(!d.params[i].grad().defined(), d.label(), "parameter '", d.layout.slots[i].name,
                  "' has a .grad() that did not come from a backward through the group's "
                  "forward(); under sharding strategy ",
                  to_string(d.strategy),
                  " gradients reach the gradient shard only that way. Call the module through "
                  "group->forward(fn, input), or use ShardingStrategy::kOptim");
    }
    d.install_shard_grads();
    return;
  }
  d.install_grads(/*keep_foreign=*/true);
  const at::Tensor send =
      d.reduce_dtype == d.compute_dtype ? d.full_grad : d.full_grad.to(d.reduce_dtype);
  if (d.reduce_dtype == d.options.main_dtype()) {
    d.comm->reduce_scatter_mean(send, d.grad_shard);
  } else {
    at::Tensor reduced = at::empty({d.layout.shard_numel}, send.options());
    d.comm->reduce_scatter_mean(send, reduced);
    d.grad_shard.copy_(reduced);
  }
}

void FsdpParameterGroup::refresh_model_weights() {
  Impl& d = *impl_;
  at::NoGradGuard no_grad;
  d.check_model_parameters_alias();
  if (d.shards_weights()) {
    // A gather in flight (an unused prefetch) carries the old values: drop it.
    d.wait_gather();
    if (d.compute_shard.defined()) d.compute_shard.copy_(d.main_shard);
    if (d.weights == Impl::Weights::kLive && d.user_unsharded) {
      d.comm->all_gather(d.gather_source(), d.model_weights);
    } else {
      // Only the cast shard is refreshed; the next forward() or unshard() gathers it.
      d.settle_weights();
    }
    for (const at::Tensor& p : d.params) p.unsafeGetTensorImpl()->bump_version();
    return;
  }
  const at::Tensor send =
      d.options.main_dtype() == d.compute_dtype ? d.main_shard : d.main_shard.to(d.compute_dtype);
  d.comm->all_gather(send, d.model_weights);
  // The weights changed under the parameters' feet: bump their version counters so autograd
  // rejects a backward through a graph that saved the old values.
  for (const at::Tensor& p : d.params) p.unsafeGetTensorImpl()->bump_version();
}

ShardingStrategy FsdpParameterGroup::sharding_strategy() const { return impl_->strategy; }

at::Tensor FsdpParameterGroup::forward(const std::function<at::Tensor(const at::Tensor&)>& fn,
                                       const at::Tensor& input) {
  TORCH_CHECK(fn, impl_->label(), "forward(): the function is empty");
  const std::vector<at::Tensor> outputs =
      forward([&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
              std::vector<at::Tensor>{input});
  return outputs[0];
}

std::vector<at::Tensor> FsdpParameterGroup::forward(
    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn,
    const std::vector<at::Tensor>& inputs) {
  Impl& d = *impl_;
  TORCH_CHECK(fn, d.label(), "forward(): the function is empty");
  d.order->record(&d);
  if (d.shards_weights()) d.ensure_weights();
  d.check_model_parameters_alias();
  if (d.options.prefetch()) {
    // The next group's gather runs while this one computes (docs/DESIGN.md §2, Prefetch).
    if (fsdp::ScheduledGroup* next = d.order->after(&d)) next->prefetch_weights();
  }
  std::vector<at::Tensor> outputs;
  try {
    outputs = fn(inputs);
  } catch (...) {
    d.settle_weights();
    throw;
  }
  if (d.shards_weights() && !d.user_unsharded) {
    for (const at::Tensor& out : outputs) {
      // The weights are freed below: an output on their memory would read a null pointer.
      if (out.defined() && out.has_storage() && out.is_alias_of(d.model_weights)) {
        d.settle_weights();
        TORCH_CHECK(false, d.label(),
                    "forward(): fn returned a view of the group's weights, which are resharded "
                    "when fn returns (sharding strategy optim_grads_params); return a result "
                    "computed from them, or keep them with unshard() until you are done");
      }
    }
  }
  if (d.shards_grads() && at::GradMode::is_enabled()) {
    outputs = fsdp::before_backward(d.participant, outputs);
  }
  // Called again inside the group's own backward (a recomputation), the weights stay: that
  // backward still needs them.
  if (d.pass == Impl::Pass::kIdle) d.settle_weights();
  return outputs;
}

void FsdpParameterGroup::unshard() {
  Impl& d = *impl_;
  if (!d.shards_weights()) return;
  d.user_unsharded = true;
  d.ensure_weights();
}

void FsdpParameterGroup::reshard() {
  Impl& d = *impl_;
  if (!d.shards_weights()) return;
  d.user_unsharded = false;
  // Inside this group's backward, the weights stay until its gradients are complete.
  if (d.pass == Impl::Pass::kIdle) d.settle_weights();
}

int64_t FsdpParameterGroup::unsharded_bytes() const { return impl_->held_bytes(); }
int64_t FsdpParameterGroup::peak_unsharded_bytes() const { return impl_->peak_bytes; }
void FsdpParameterGroup::reset_peak_unsharded_bytes() { impl_->peak_bytes = impl_->held_bytes(); }

void share_forward_order(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  auto order = std::make_shared<fsdp::ForwardOrder>();
  for (const auto& g : groups) {
    TORCH_CHECK(g != nullptr, "fsdp_muon::share_forward_order: a group is null");
    g->impl_->order->remove(g->impl_.get());
    g->impl_->order = order;
  }
}

int64_t total_unsharded_bytes(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  int64_t total = 0;
  for (const auto& g : groups) {
    if (g) total += g->unsharded_bytes();
  }
  return total;
}

namespace {
fsdp::ShardingSchedule& shared_schedule(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups, const char* api) {
  TORCH_CHECK(!groups.empty() && groups.front(), "fsdp_muon::", api,
              ": no groups given; pass the groups shard_module() returned");
  const Communicator* comm = groups.front()->communicator().get();
  for (const auto& g : groups) {
    TORCH_CHECK(g && g->communicator().get() == comm, "fsdp_muon::", api,
                ": the groups do not share one communicator; the peak is kept per communicator, "
                "so pass the groups of one communicator");
  }
  return *fsdp::ShardingSchedule::of(*comm);
}
}  // namespace

int64_t peak_total_unsharded_bytes(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  return shared_schedule(groups, "peak_total_unsharded_bytes").peak_unsharded_bytes();
}

void reset_peak_total_unsharded_bytes(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  shared_schedule(groups, "reset_peak_total_unsharded_bytes").reset_peak_unsharded_bytes();
}

std::optional<ShardedParameterInfo> find_sharded_parameter(const at::Tensor& tensor) {
  if (!tensor.defined()) return std::nullopt;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(tensor.unsafeGetTensorImpl());
  if (it == registry().end()) return std::nullopt;
  std::shared_ptr<FsdpParameterGroup> group = it->second.group->weak_from_this().lock();
  if (!group) return std::nullopt;
  return ShardedParameterInfo{std::move(group), it->second.index};
}

}  // namespace fsdp_muon
