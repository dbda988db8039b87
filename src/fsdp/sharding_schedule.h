#pragma once
// What the groups of one communicator share under full sharding (docs/DESIGN.md §2, Sharding
// strategies): the forward order prefetch follows, the reduce-scatters in flight, the end of a
// backward pass, and the count of unsharded bytes this rank holds.

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon {
namespace fsdp {

// What the schedule asks of a group.
class ScheduledGroup {
 public:
  virtual ~ScheduledGroup() = default;
  // Starts gathering the model weights if they are resharded and no gather is in flight
  // (kOptimGradsParams); nothing otherwise.
  virtual void prefetch_weights() = 0;
  // Waits for the first stage of the group's reduction in flight (the reduce-scatter), frees the
  // full gradients it was sent from and starts the second (the all-reduce over the replicas).
  // Returns whether that second stage is now in flight; false when there is none (a 1-D mesh:
  // the reduction is then finished, as by finish_reduction()) or nothing was in flight.
  virtual bool advance_reduction() = 0;
  // Completes the group's reduction in flight, both stages, and adds it into the gradient shard.
  virtual void finish_reduction() = 0;
  // The backward pass that began the group's backward has ended: issue what was not issued.
  virtual void end_backward() = 0;
};

// The order in which the groups of one model first ran forward() (recorded on the first
// iteration, as FSDP2 does): forward prefetches the group after, backward the group before.
// Shared by the groups of one model (shard_module's, or share_forward_order()'s); a group
// alone has its own and prefetches nothing.
class ForwardOrder {
 public:
  void record(ScheduledGroup* group);
  ScheduledGroup* after(ScheduledGroup* group) const;   // next in forward order, or nullptr
  ScheduledGroup* before(ScheduledGroup* group) const;  // previous in forward order, or nullptr
  void remove(ScheduledGroup* group);

 private:
  std::vector<ScheduledGroup*> groups_;
};

// One per communicator, shared by every group built on it: the reduce-scatters in flight (their
// order is the communicator's), the end of a backward pass and the unsharded bytes this rank
// holds. Used from one thread at a time: the one running forward, backward and the loop.
class ShardingSchedule : public std::enable_shared_from_this<ShardingSchedule> {
 public:
  // At most this many reduce-scatters in flight once a new one is issued (the older one is
  // advanced first): backward then holds the full gradients of the group it runs and of the
  // one whose reduce-scatter overlaps it, whatever the model's depth (docs/DESIGN.md §2). On a
  // mesh of several replicas, the advanced one's all-reduce over the replicas then overlaps the
  // next group's backward, with at most one such all-reduce in flight (the one before it is
  // finished first); it holds only a gradient shard.
  static constexpr size_t kMaxReductionsInFlight = 1;

  // The schedule of `comm`, made on first use and kept while a group holds it.
  static std::shared_ptr<ShardingSchedule> of(const Communicator& comm);

  // A group started a reduce-scatter; finishes the oldest ones beyond the bound.
  void reduction_started(ScheduledGroup* group);
  // A group finished its reduce-scatter (called by the group's finish_reduction()).
  void reduction_finished(ScheduledGroup* group);

  // A group's backward began; the first group of a backward pass queues the end-of-backward
  // callback, which calls end_backward() on every group that began, in the order they began.
  void began_backward(ScheduledGroup* group);
  // Forget a backward pass that did not end (it threw): the next one queues its callback anew.
  void abandon_backward();

  // A group named `name` ran forward() with gradients enabled under full sharding.
  void ran_forward(const std::string& name);
  // Called by every group as its backward begins; the first of a backward pass (before any
  // collective of that pass) checks that every rank ran the same groups' forward() since the
  // last check, through one small all-gather, and throws on every rank naming the first
  // difference when they did not: a rank that skipped a group's forward() would otherwise issue
  // its reduce-scatters in another order than the others (docs/DESIGN.md §2).
  void check_forward_agreement(Communicator& comm);

  void remove(ScheduledGroup* group);

  void add_unsharded_bytes(int64_t delta);
  int64_t unsharded_bytes() const { return unsharded_bytes_; }
  int64_t peak_unsharded_bytes() const { return peak_unsharded_bytes_; }
  void reset_peak_unsharded_bytes() { peak_unsharded_bytes_ = unsharded_bytes_; }

 private:
  void end_backward();

  std::deque<ScheduledGroup*> reductions_;     // reduce-scatter in flight
  std::deque<ScheduledGroup*> replica_stage_;  // all-reduce over the replicas in flight
  std::vector<ScheduledGroup*> in_backward_;
  std::vector<std::string> forward_names_;  // since the last check
  bool callback_queued_ = false;
  int64_t unsharded_bytes_ = 0;
  int64_t peak_unsharded_bytes_ = 0;
};

}  // namespace fsdp
}  // namespace fsdp_muon
