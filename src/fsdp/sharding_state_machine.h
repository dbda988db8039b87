#pragma once
// The full-sharding (ZeRO-2/3) life of one FsdpParameterGroup (docs/DESIGN.md §2, Sharding
// strategies): when its full weights and full gradients exist, and the collectives that bring
// them and send them away. Two state variables, driven by the group's forward(), autograd's
// hooks (fsdp/backward_hooks.h) and the schedule its communicator shares
// (fsdp/sharding_schedule.h):
//
// Weights (kOptimGradsParams; always kLive under the other strategies)
//   kResharded --start_gather (forward, unshard, pre-backward, a neighbour's prefetch)-->
//   kGathering --wait_gather--> kLive
//   kLive --free_weights (forward returned; the gradients are complete and no parameter is
//   frozen; the end of backward; a prefetch nobody used; never while unshard() holds them)-->
//   kResharded
// Pass, one backward of this group (kOptimGrads, kOptimGradsParams; always kIdle under kOptim)
//   kIdle --pre_backward: full gradients allocated, one count per parameter that requires
//   grad--> kAccumulating (kReduced at once when none does)
//   kAccumulating --the post-backward hook of every forward() call of the pass (the same point
//   of the backward on every rank, whichever parameters got gradients), or the end of
//   backward: reduce-scatter issued, full gradients released to it--> kReduced
//   kReduced --end_backward--> kIdle
//   kAccumulating/kReduced --zero_grad() after a backward that threw--> kIdle
// Under kOptim the machine only watches the gradients: the post-accumulate-grad hooks note that a
// backward wrote full gradients that reduce_scatter_grads() has not yet averaged into the
// gradient shard (unreduced()), so that an optimizer step on stale shards is an error.
// Independent of Pass, at most one reduction in flight per group (`reduction_`): a reduce-scatter
// over the shard group and, on a mesh of several replicas, then an all-reduce of the shard over
// the replicas. advance_reduction() waits for the first stage, frees what it sent and starts the
// second; finish_reduction() completes both and writes or adds the result into the gradient
// shard. The schedule calls them to bound how many are in flight.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/fsdp/parameter_group.h>

#include "fsdp/backward_hooks.h"
#include "fsdp/group_storage.h"
#include "fsdp/sharding_schedule.h"

namespace fsdp_muon::fsdp {

class ShardingStateMachine final : public ScheduledGroup, public BackwardParticipant {
 public:
  enum class Weights { kLive, kGathering, kResharded };
  enum class Pass { kIdle, kAccumulating, kReduced };

  // `storage` outlives the machine; nothing happens until start().
  explicit ShardingStateMachine(GroupStorage& storage) : s_(storage) {}
  // Unhooks the group from autograd and the schedule; collectives in flight finish first.
  ~ShardingStateMachine() override;
  ShardingStateMachine(const ShardingStateMachine&) = delete;
  ShardingStateMachine& operator=(const ShardingStateMachine&) = delete;

  // The last construction step, once the buffers and views exist: joins the communicator's
  // schedule and, under full sharding, hooks the parameters and frees what the strategy frees.
  void start(ShardingStrategy strategy);

  ShardingStrategy strategy() const { return strategy_; }
  bool shards_grads() const { return strategy_ != ShardingStrategy::kOptim; }
  bool shards_weights() const { return strategy_ == ShardingStrategy::kOptimGradsParams; }
  Weights weights() const { return weights_; }
  Pass pass() const { return pass_; }
  // kOptim: a backward accumulated a gradient into the full gradients since the last
  // reduce_scatter_grads() or zero_grad() (which call mark_reduced()). Always false under full
  // sharding, which reduces during backward.
  bool unreduced() const { return unreduced_; }
  void mark_reduced() { unreduced_ = false; }

  // ---- the group's calls ----
  // Around the user's function in forward(): before_forward() records the forward order,
  // gathers the weights and prefetches the next group's; after_forward() passes the outputs on
  // (through the pre-backward hook under full sharding) and reshards; forward_threw() reshards.
  // Returns `inputs`, those that require grad through the post-backward hook under full
  // sharding with gradients enabled (fsdp/backward_hooks.h): the point where this call's
  // backward has passed through the group.
  std::vector<at::Tensor> before_forward(const std::vector<at::Tensor>& inputs);
  std::vector<at::Tensor> after_forward(std::vector<at::Tensor> outputs);
  void forward_threw() { settle_weights(); }
  void unshard();
  void reshard();
  // zero_grad(), reduce_scatter_grads() and refresh_model_weights() under full sharding.
  void zero_grad();
  void collect_grads();
  void refresh();
  // The parameters' alias check, where they hold storage to compare.
  void check_parameters_alias() const;
  void set_forward_order(std::shared_ptr<ForwardOrder> order);

  int64_t held_bytes() const;
  int64_t peak_bytes() const { return peak_bytes_; }
  void reset_peak_bytes() { peak_bytes_ = held_bytes(); }

  // ---- the schedule's and autograd's calls ----
  void prefetch_weights() override;
  bool advance_reduction() override;
  void finish_reduction() override;
  void end_backward() override;
  void pre_backward() override;
  void gradient_accumulated(size_t index) override;
  void post_backward() override;

 private:
  struct Reduction {
    at::Tensor send;          // full_grad itself, or its cast to the reduce dtype
    at::Tensor recv;          // grad_shard itself, or a shard in the reduce dtype
    int64_t cast_bytes = 0;   // bytes of `send` when it is a cast copy
    bool into_shard = false;  // recv is grad_shard
    bool first = false;       // the first reduction since zero_grad(): copy, not add
    bool sent = false;        // the reduce-scatter was waited for, `send` released
    // Declared last: destroyed (and so waited for) first, the second stage before the first.
    std::unique_ptr<CommWork> work;          // the reduce-scatter over the shard group
    std::unique_ptr<CommWork> replica_work;  // then the all-reduce over the replicas
  };

  void account(int64_t delta);
  const at::Tensor& gather_source() const;
  // Weights transitions.
  void start_gather();
  void wait_gather();
  void ensure_weights();
  void free_weights();
  // Outside forward()/backward and unshard(): give the weights back (a prefetch nobody used).
  void settle_weights();
  // Full gradients.
  void allocate_grads();
  void detach_module_grads();
  void free_grads();
  // Pass transitions.
  void start_reduction();
  // The first stage's wait: frees what it sent and, with several replicas, starts the second.
  void finish_shard_stage(Reduction& r);
  // A backward pass that threw never ended: drop what it left.
  void abandon_backward();

  GroupStorage& s_;
  ShardingStrategy strategy_ = ShardingStrategy::kOptim;
  std::shared_ptr<ShardingSchedule> schedule_;
  std::shared_ptr<ForwardOrder> order_ = std::make_shared<ForwardOrder>();
  int64_t participant_ = -1;  // id autograd's hooks find this group by
  // kOptimGradsParams with main dtype != compute dtype: the main weights cast to the compute
  // dtype, what the next gather sends (refresh() casts into it).
  at::Tensor compute_shard_;
  Weights weights_ = Weights::kLive;
  bool user_unsharded_ = false;  // unshard() called, reshard() not yet
  Pass pass_ = Pass::kIdle;
  size_t grads_pending_ = 0;
  // forward() calls since the last backward whose post-backward hook will fire, and whether one
  // had no input that requires grad (its backward is only over at the end of the pass).
  int64_t forwards_hooked_ = 0;
  bool forward_unhooked_ = false;
  bool has_frozen_ = false;  // a parameter without requires_grad: its weights may be read by
                             // backward nodes after the others' gradients are complete
  bool shard_fresh_ = true;  // grad_shard zero since zero_grad(): the next reduction writes it
  bool unreduced_ = false;   // kOptim: see unreduced()
  std::optional<Reduction> reduction_;
  int64_t cast_bytes_held_ = 0;
  int64_t peak_bytes_ = 0;
  std::unique_ptr<CommWork> gather_;  // into model_weights
};

}  // namespace fsdp_muon::fsdp
