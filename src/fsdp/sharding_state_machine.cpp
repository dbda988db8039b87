#include "fsdp/sharding_state_machine.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "common/check.h"
#include "fsdp/storage_bytes.h"

namespace fsdp_muon::fsdp {

ShardingStateMachine::~ShardingStateMachine() {
  if (!schedule_) return;  // construction stopped before start()
  if (participant_ >= 0) {
    unregister_participant(participant_);
    for (const at::Tensor& p : s_.params) {
      if (p.requires_grad()) clear_accumulate_hook(p);
    }
  }
  // Collectives in flight finish before their buffers go (CommWork's destructor waits).
  gather_.reset();
  reduction_.reset();
  schedule_->remove(this);
  order_->remove(this);
  schedule_->add_unsharded_bytes(-held_bytes());
}

void ShardingStateMachine::start(ShardingStrategy strategy) {
  strategy_ = strategy;
  schedule_ = ShardingSchedule::of(*s_.comm);
  account(held_bytes());
  // Every strategy hooks the parameters: full sharding keeps their gradients in its buffers,
  // kOptim only notes that a backward wrote some (unreduced()).
  participant_ = register_participant(this);
  for (size_t i = 0; i < s_.params.size(); ++i) {
    if (s_.params[i].requires_grad()) set_accumulate_hook(s_.params[i], participant_, i);
  }
  if (shards_grads()) free_grads();
  if (shards_weights()) {
    if (s_.options.main_dtype() != s_.compute_dtype) {
      compute_shard_ = s_.main_shard.to(s_.compute_dtype);
    }
    free_weights();
  }
}

int64_t ShardingStateMachine::held_bytes() const {
  return storage_bytes(s_.model_weights) + storage_bytes(s_.full_grad) + cast_bytes_held_;
}

void ShardingStateMachine::account(int64_t delta) {
  if (delta == 0) return;
  schedule_->add_unsharded_bytes(delta);
  peak_bytes_ = std::max(peak_bytes_, held_bytes());
}

void ShardingStateMachine::set_forward_order(std::shared_ptr<ForwardOrder> order) {
  order_->remove(this);
  order_ = std::move(order);
}

// ---- model weights ----

const at::Tensor& ShardingStateMachine::gather_source() const {
  return compute_shard_.defined() ? compute_shard_ : s_.main_shard;
}

void ShardingStateMachine::start_gather() {
  account(set_storage_bytes(s_.model_weights, s_.full_bytes()));
  // Written through model_weights, whose version counter is not the parameters': autograd's
  // saved parameters stay valid when backward gathers the same values again.
  gather_ = s_.comm->all_gather_async(gather_source(), s_.model_weights);
  weights_ = Weights::kGathering;
}

void ShardingStateMachine::wait_gather() {
  if (weights_ != Weights::kGathering) return;
  std::unique_ptr<CommWork> work = std::move(gather_);
  try {
    work->wait();
  } catch (...) {
    // The gather failed (a timeout, an aborted communicator): its buffer holds no weights.
    // Back to resharded, so that zero_grad(), reshard() and the destructor find a consistent
    // state and the next forward() or unshard() gathers anew (and fails as clearly while the
    // communicator stays broken).
    weights_ = Weights::kResharded;
    account(set_storage_bytes(s_.model_weights, 0));
    FSDP_MUON_CHECK(false, s_.label(),
                    "gathering the weights failed: ", detail::current_exception_message(),
                    ". The group is resharded again; the communicator may be unusable now");
  }
  weights_ = Weights::kLive;
  // set_data keeps each parameter's identity, version counter and autograd metadata (and so
  // autograd's saved parameters) and points it at the gathered weights again.
  for (size_t i = 0; i < s_.params.size(); ++i) s_.params[i].set_data(s_.weight_views[i]);
}

void ShardingStateMachine::ensure_weights() {
  if (weights_ == Weights::kResharded) start_gather();
  wait_gather();
}

void ShardingStateMachine::free_weights() {
  wait_gather();
  // The parameters let go of the storage and refuse every access with this message, ATen's
  // own check: a resharded weight used outside forward() is a clear error, never stale values
  // and never a read of freed memory (docs/DESIGN.md §2).
  for (size_t i = 0; i < s_.params.size(); ++i) {
    s_.params[i].unsafeGetTensorImpl()->release_storage_and_set_meta_custom_data_ptr_error_msg_(
        c10::str(detail::ApiPrefix{}) + s_.label() + "parameter '" + s_.layout.slots[i].name +
        "' is resharded (sharding strategy optim_grads_params): its weights exist only "
        "inside the group's forward() and the backward of what forward() computed, or "
        "between unshard() and reshard(). Call the module through group->forward(fn, "
        "input), or call group->unshard() before using its parameters directly (and "
        "group->reshard() once their backward has run)");
  }
  account(set_storage_bytes(s_.model_weights, 0));
  weights_ = Weights::kResharded;
}

void ShardingStateMachine::prefetch_weights() {
  if (shards_weights() && weights_ == Weights::kResharded) start_gather();
}

void ShardingStateMachine::settle_weights() {
  if (shards_weights() && !user_unsharded_ && weights_ != Weights::kResharded) free_weights();
}

void ShardingStateMachine::check_parameters_alias() const {
  if (weights_ != Weights::kLive) return;  // resharded parameters hold no storage to compare
  s_.check_parameters_alias();
}

// ---- full gradients ----

void ShardingStateMachine::allocate_grads() {
  account(set_storage_bytes(s_.full_grad, s_.full_bytes()));
  s_.full_grad.zero_();
  for (size_t i = 0; i < s_.params.size(); ++i) {
    if (s_.params[i].requires_grad()) s_.params[i].mutable_grad() = s_.grad_views[i];
  }
}

void ShardingStateMachine::detach_module_grads() {
  for (at::Tensor& p : s_.params) {
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
  }
}

void ShardingStateMachine::free_grads() {
  detach_module_grads();
  account(set_storage_bytes(s_.full_grad, 0));
}

// ---- autograd's calls (fsdp/backward_hooks.h) ----

void ShardingStateMachine::pre_backward() {
  at::NoGradGuard no_grad;
  if (pass_ == Pass::kIdle) {
    // Before this pass's first collective: the ranks ran the same groups' forward().
    // Over the world: every replica must also start its all-reduces in the same order.
    schedule_->check_forward_agreement(*s_.mesh.world);
    finish_reduction();  // the previous micro-batch's, if still in flight
    if (shards_weights()) ensure_weights();
    grads_pending_ = 0;
    has_frozen_ = false;
    for (const at::Tensor& p : s_.params) {
      if (p.requires_grad()) {
        ++grads_pending_;
      } else {
        has_frozen_ = true;
      }
    }
    if (grads_pending_ > 0) allocate_grads();
    pass_ = grads_pending_ > 0 ? Pass::kAccumulating : Pass::kReduced;
    schedule_->began_backward(this);
  }
  if (s_.options.prefetch()) {
    if (ScheduledGroup* previous = order_->before(this)) previous->prefetch_weights();
  }
}

void ShardingStateMachine::gradient_accumulated(size_t index) {
  if (!shards_grads()) {
    // kOptim: the gradient stays where autograd put it until reduce_scatter_grads().
    unreduced_ = true;
    return;
  }
  at::NoGradGuard no_grad;
  FSDP_MUON_CHECK(pass_ != Pass::kIdle, s_.label(), "parameter '", s_.layout.slots[index].name,
                  "' received a gradient outside the group's forward(): under sharding strategy ",
                  to_string(strategy_),
                  " a group collects gradients only for what its forward() computed. Call the "
                  "module through group->forward(fn, input), or use ShardingStrategy::kOptim");
  FSDP_MUON_CHECK(pass_ == Pass::kAccumulating, s_.label(), "parameter '",
                  s_.layout.slots[index].name,
                  "' received a gradient after the group's reduce-scatter started, i.e. after the "
                  "backward of its forward() had reached that forward()'s inputs: every use of the "
                  "group's parameters must be inside its forward(fn, input) and computed from its "
                  "inputs' graph, or pass the inputs of the uses outside as detached tensors");
  at::Tensor& param = s_.params[index];
  if (!param.grad().is_same(s_.grad_views[index])) {
    // Autograd replaced the view (create_graph=true sums out of place): keep its sum.
    if (param.grad().defined()) s_.grad_views[index].copy_(param.grad());
    param.mutable_grad() = s_.grad_views[index];
  }
  FSDP_MUON_CHECK(grads_pending_ > 0, s_.label(), "internal error: more gradients than parameters");
  // Not the last gradient but the post-backward hook starts the reduction: which parameters
  // get a gradient may differ between the ranks (an expert without tokens), and the
  // reduce-scatters must start in the same order on every rank (docs/DESIGN.md §2).
  --grads_pending_;
}

void ShardingStateMachine::post_backward() {
  if (forwards_hooked_ > 0) --forwards_hooked_;
  if (pass_ == Pass::kAccumulating && forwards_hooked_ == 0 && !forward_unhooked_) {
    start_reduction();
  }
}

// ---- reduce-scatter of the full gradients into the gradient shard ----

void ShardingStateMachine::start_reduction() {
  at::NoGradGuard no_grad;
  detach_module_grads();  // nothing may accumulate into what is being sent
  Reduction r;
  if (s_.reduce_dtype == s_.compute_dtype) {
    r.send = s_.full_grad;
  } else {
    r.send = s_.full_grad.to(s_.reduce_dtype);
    r.cast_bytes = storage_bytes(r.send);
    cast_bytes_held_ += r.cast_bytes;
    account(r.cast_bytes);
    account(set_storage_bytes(s_.full_grad, 0));
  }
  // The first reduction after zero_grad() writes the shard exactly as kOptim's single
  // reduce-scatter does; later micro-batches add into it.
  r.first = shard_fresh_;
  r.into_shard = shard_fresh_ && s_.reduce_dtype == s_.options.main_dtype();
  r.recv = r.into_shard ? s_.grad_shard : at::empty({s_.layout.shard_numel}, r.send.options());
  r.work = s_.comm->reduce_scatter_mean_async(r.send, r.recv);
  shard_fresh_ = false;
  reduction_ = std::move(r);
  pass_ = Pass::kReduced;
  if (shards_weights() && !has_frozen_ && !user_unsharded_) free_weights();
  if (s_.options.prefetch()) {
    schedule_->reduction_started(this);
  } else {
    finish_reduction();
  }
}

void ShardingStateMachine::finish_shard_stage(Reduction& r) {
  if (r.sent) return;
  r.work->wait();
  r.sent = true;
  if (r.cast_bytes > 0) {
    cast_bytes_held_ -= r.cast_bytes;
    r.send = at::Tensor();
    account(-r.cast_bytes);
  } else {
    account(set_storage_bytes(s_.full_grad, 0));
  }
  // The second stage (docs/DESIGN.md §2, Meshes) goes out as soon as the shard is reduced.
  if (s_.replicated()) r.replica_work = s_.start_replica_sum(r.recv);
}

bool ShardingStateMachine::advance_reduction() {
  if (!reduction_) return false;
  if (!s_.replicated()) {
    finish_reduction();  // one stage only: done
    return false;
  }
  at::NoGradGuard no_grad;
  finish_shard_stage(*reduction_);
  return true;
}

void ShardingStateMachine::finish_reduction() {
  if (!reduction_) return;
  Reduction r = std::move(*reduction_);
  reduction_.reset();
  schedule_->reduction_finished(this);
  at::NoGradGuard no_grad;
  finish_shard_stage(r);
  if (r.replica_work) {
    r.replica_work->wait();
    s_.finish_replica_average(r.recv);
  }
  if (!r.into_shard) {
    if (r.first) {
      s_.grad_shard.copy_(r.recv);
    } else {
      s_.grad_shard.add_(r.recv);
    }
  }
}

void ShardingStateMachine::end_backward() {
  // Parameters that got no gradient in this pass never completed the count: their full
  // gradients are zero, and the reduction goes out now, in the order the groups began.
  if (pass_ == Pass::kAccumulating) start_reduction();
  pass_ = Pass::kIdle;
  forwards_hooked_ = 0;
  forward_unhooked_ = false;
  settle_weights();
}

void ShardingStateMachine::abandon_backward() {
  forwards_hooked_ = 0;
  forward_unhooked_ = false;
  if (pass_ == Pass::kIdle) return;
  pass_ = Pass::kIdle;
  schedule_->abandon_backward();
}

// ---- the group's calls ----

std::vector<at::Tensor> ShardingStateMachine::before_forward(
    const std::vector<at::Tensor>& inputs) {
  order_->record(this);
  if (shards_weights()) ensure_weights();
  check_parameters_alias();
  if (s_.options.prefetch()) {
    // The next group's gather runs while this one computes (docs/DESIGN.md §2, Prefetch).
    if (ScheduledGroup* next = order_->after(this)) next->prefetch_weights();
  }
  // A recomputation inside the group's own backward is part of that backward, not a new call.
  if (!shards_grads() || !at::GradMode::is_enabled() || pass_ != Pass::kIdle) return inputs;
  schedule_->ran_forward(s_.options.name());
  bool hooked = false;
  std::vector<at::Tensor> wrapped = after_backward(participant_, inputs, &hooked);
  if (hooked) {
    ++forwards_hooked_;
  } else {
    forward_unhooked_ = true;  // nothing marks this call's backward done: the pass's end does
  }
  return wrapped;
}

std::vector<at::Tensor> ShardingStateMachine::after_forward(std::vector<at::Tensor> outputs) {
  if (shards_weights() && !user_unsharded_) {
    for (const at::Tensor& out : outputs) {
      // The weights are freed below: an output on their memory would read a null pointer.
      if (out.defined() && out.has_storage() && out.is_alias_of(s_.model_weights)) {
        settle_weights();
        FSDP_MUON_CHECK(false, s_.label(),
                        "forward(): fn returned a view of the group's weights, which are resharded "
                        "when fn returns (sharding strategy optim_grads_params); return a result "
                        "computed from them, or keep them with unshard() until you are done");
      }
    }
  }
  if (shards_grads() && at::GradMode::is_enabled()) {
    outputs = before_backward(participant_, outputs);
  }
  // Called again inside the group's own backward (a recomputation), the weights stay: that
  // backward still needs them.
  if (pass_ == Pass::kIdle) settle_weights();
  return outputs;
}

void ShardingStateMachine::unshard() {
  if (!shards_weights()) return;
  user_unsharded_ = true;
  ensure_weights();
}

void ShardingStateMachine::reshard() {
  if (!shards_weights()) return;
  user_unsharded_ = false;
  // Inside this group's backward, the weights stay until its gradients are complete.
  if (pass_ == Pass::kIdle) settle_weights();
}

void ShardingStateMachine::zero_grad() {
  // A reduction in flight would write the shard after it is zeroed: finish it first.
  finish_reduction();
  abandon_backward();
  free_grads();
  settle_weights();
  s_.grad_shard.zero_();
  shard_fresh_ = true;
  s_.install_shard_grads();
}

void ShardingStateMachine::collect_grads() {
  // The reduce-scatters were issued during backward (docs/DESIGN.md §2): wait for this
  // group's, and give back the weights of a prefetch no backward used.
  if (pass_ != Pass::kIdle) end_backward();
  finish_reduction();
  settle_weights();
  for (size_t i = 0; i < s_.params.size(); ++i) {
    FSDP_MUON_CHECK(!s_.params[i].grad().defined(), s_.label(), "parameter '",
                    s_.layout.slots[i].name,
                    "' has a .grad() that did not come from a backward through the group's "
                    "forward(); under sharding strategy ",
                    to_string(strategy_),
                    " gradients reach the gradient shard only that way. Call the module through "
                    "group->forward(fn, input), or use ShardingStrategy::kOptim");
  }
  s_.install_shard_grads();
}

void ShardingStateMachine::refresh() {
  // A gather in flight (an unused prefetch) carries the old values: drop it.
  wait_gather();
  if (compute_shard_.defined()) compute_shard_.copy_(s_.main_shard);
  if (weights_ == Weights::kLive && user_unsharded_) {
    s_.comm->all_gather(gather_source(), s_.model_weights);
  } else {
    // Only the cast shard is refreshed; the next forward() or unshard() gathers it.
    settle_weights();
  }
  for (const at::Tensor& p : s_.params) p.unsafeGetTensorImpl()->bump_version();
}

}  // namespace fsdp_muon::fsdp
