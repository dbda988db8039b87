// The per-model forward order and the per-communicator ShardingSchedule on their own (no
// groups): the order prefetch follows, the bound on reduce-scatters in flight, the end-of-backward
// callback (inside a real autograd backward pass), a pass that threw, and the byte count.

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/local_communicator.h"
#include "fsdp/sharding_schedule.h"

namespace fsdp_muon {
namespace {

using fsdp::ForwardOrder;
using fsdp::ScheduledGroup;
using fsdp::ShardingSchedule;

// Records what the schedule asks of it, as "<name>.<call>" in a shared log.
class FakeGroup final : public ScheduledGroup {
 public:
  // `replicated`: its reduction has a second stage, over the replicas of a mesh.
  FakeGroup(std::string name, std::vector<std::string>& log, ShardingSchedule* schedule = nullptr,
            bool replicated = false)
      : name_(std::move(name)), log_(log), schedule_(schedule), replicated_(replicated) {}
  void prefetch_weights() override { log_.push_back(name_ + ".prefetch"); }
  // As a group does: one stage only finishes the reduction.
  bool advance_reduction() override {
    if (!replicated_) {
      finish_reduction();
      return false;
    }
    log_.push_back(name_ + ".advance");
    return true;
  }
  // As a group does: its reduction leaves the schedule when it is finished.
  void finish_reduction() override {
    log_.push_back(name_ + ".finish");
    if (schedule_ != nullptr) schedule_->reduction_finished(this);
  }
  void end_backward() override { log_.push_back(name_ + ".end"); }

 private:
  std::string name_;
  std::vector<std::string>& log_;
  ShardingSchedule* schedule_;
  bool replicated_;
};

// Runs one backward pass that calls `inside` from a hook, i.e. while the pass is running.
void backward_calling(const std::function<void()>& inside) {
  torch::Tensor x = torch::ones({2}, torch::requires_grad());
  torch::Tensor y = x * 3;
  y.register_hook([&](const torch::Tensor& grad) {
    inside();
    return grad;
  });
  y.sum().backward();
}

// A backward pass in which `group` began and then something threw.
void pass_that_throws(ShardingSchedule& schedule, ScheduledGroup& group) {
  EXPECT_THROW(backward_calling([&] {
                 schedule.began_backward(&group);
                 throw std::runtime_error("user error inside backward");
               }),
               std::exception);
}

TEST(ForwardOrder, RecordsFirstRunsAndAnswersNeighbours) {
  std::vector<std::string> log;
  FakeGroup a("a", log), b("b", log), c("c", log), stranger("x", log);
  ForwardOrder order;
  for (ScheduledGroup* g : {&a, &b, &a, &c, &b}) order.record(g);  // repeats keep first place
  EXPECT_EQ(order.after(&a), &b);
  EXPECT_EQ(order.after(&b), &c);
  EXPECT_EQ(order.after(&c), nullptr);   // the last group prefetches nothing
  EXPECT_EQ(order.before(&a), nullptr);  // nor the first, in backward
  EXPECT_EQ(order.before(&c), &b);
  EXPECT_EQ(order.after(&stranger), nullptr);  // a group never recorded has no neighbours
  EXPECT_EQ(order.before(&stranger), nullptr);
  order.remove(&b);
  EXPECT_EQ(order.after(&a), &c);
  EXPECT_EQ(order.before(&c), &a);
  EXPECT_TRUE(log.empty());
}

TEST(ShardingSchedule, OneSchedulePerCommunicatorWhileHeld) {
  auto comm_a = std::make_shared<testing::LocalCommunicator>();
  auto comm_b = std::make_shared<testing::LocalCommunicator>();
  std::shared_ptr<ShardingSchedule> a1 = ShardingSchedule::of(*comm_a);
  std::shared_ptr<ShardingSchedule> a2 = ShardingSchedule::of(*comm_a);
  std::shared_ptr<ShardingSchedule> b = ShardingSchedule::of(*comm_b);
  EXPECT_EQ(a1, a2);
  EXPECT_NE(a1, b);
  a1->add_unsharded_bytes(7);
  EXPECT_EQ(a2->unsharded_bytes(), 7);
  EXPECT_EQ(b->unsharded_bytes(), 0);
  // Once nobody holds it, the next caller gets a fresh schedule (counts from zero).
  a1.reset();
  a2.reset();
  EXPECT_EQ(ShardingSchedule::of(*comm_a)->unsharded_bytes(), 0);
}

TEST(ShardingSchedule, FinishesTheOldestReductionBeyondTheBound) {
  static_assert(ShardingSchedule::kMaxReductionsInFlight == 1, "the expected calls assume 1");
  auto comm = std::make_shared<testing::LocalCommunicator>();
  auto schedule = ShardingSchedule::of(*comm);
  std::vector<std::string> log;
  FakeGroup a("a", log, schedule.get()), b("b", log, schedule.get()), c("c", log, schedule.get());
  schedule->reduction_started(&a);
  EXPECT_TRUE(log.empty());  // one in flight is allowed
  schedule->reduction_started(&b);
  EXPECT_EQ(log, (std::vector<std::string>{"a.finish"}));
  // A group that finished its own (zero_grad, the optimizer step) leaves no slot taken.
  schedule->reduction_finished(&b);
  schedule->reduction_started(&c);
  EXPECT_EQ(log, (std::vector<std::string>{"a.finish"}));
  // A removed group is never asked again.
  schedule->remove(&c);
  schedule->reduction_started(&a);
  EXPECT_EQ(log, (std::vector<std::string>{"a.finish"}));
  schedule->reduction_finished(&a);
  schedule->reduction_finished(&a);  // finishing one not in flight is a no-op
}

TEST(ShardingSchedule, OnAMeshAdvancesTheOldestAndFinishesTheAllReduceBeforeIt) {
  auto comm = std::make_shared<testing::LocalCommunicator>();
  auto schedule = ShardingSchedule::of(*comm);
  std::vector<std::string> log;
  FakeGroup a("a", log, schedule.get(), true), b("b", log, schedule.get(), true),
      c("c", log, schedule.get(), true), d("d", log, schedule.get(), true);
  schedule->reduction_started(&a);
  EXPECT_TRUE(log.empty());
  // b's reduce-scatter goes out: a's is waited for and a's all-reduce starts.
  schedule->reduction_started(&b);
  EXPECT_EQ(log, (std::vector<std::string>{"a.advance"}));
  // c's: a's all-reduce finishes before b's starts (one all-reduce in flight).
  schedule->reduction_started(&c);
  EXPECT_EQ(log, (std::vector<std::string>{"a.advance", "a.finish", "b.advance"}));
  // b finished its own (collect, zero_grad): it leaves the all-reduce slot free.
  schedule->reduction_finished(&b);
  schedule->reduction_started(&d);
  EXPECT_EQ(log, (std::vector<std::string>{"a.advance", "a.finish", "b.advance", "c.advance"}));
  schedule->remove(&c);
  schedule->remove(&d);
}

TEST(ShardingSchedule, EndsTheGroupsOfABackwardPassOnceInTheOrderTheyBegan) {
  auto comm = std::make_shared<testing::LocalCommunicator>();
  auto schedule = ShardingSchedule::of(*comm);
  std::vector<std::string> log;
  FakeGroup a("a", log), b("b", log), c("c", log);
  backward_calling([&] {
    for (ScheduledGroup* g : {&b, &a, &b, &c}) schedule->began_backward(g);
    schedule->remove(&c);      // destroyed during the pass: not ended
    EXPECT_TRUE(log.empty());  // nothing ends before the whole pass has
  });
  EXPECT_EQ(log, (std::vector<std::string>{"b.end", "a.end"}));
  // The next pass queues its own callback.
  log.clear();
  backward_calling([&] { schedule->began_backward(&a); });
  EXPECT_EQ(log, (std::vector<std::string>{"a.end"}));
}

TEST(ShardingSchedule, APassThatThrewIsForgottenOnlyWhenAbandoned) {
  auto comm = std::make_shared<testing::LocalCommunicator>();
  auto schedule = ShardingSchedule::of(*comm);
  std::vector<std::string> log;
  FakeGroup a("a", log), b("b", log);
  pass_that_throws(*schedule, a);
  EXPECT_TRUE(log.empty());  // the engine dropped the callback with the pass
  schedule->abandon_backward();
  backward_calling([&] { schedule->began_backward(&b); });
  // Only the group of the pass that ended: a's pass was abandoned.
  EXPECT_EQ(log, (std::vector<std::string>{"b.end"}));
}

TEST(ShardingSchedule, WithoutAbandoningAThrownPassNoCallbackIsQueuedAgain) {
  // The reason zero_grad() abandons a pass that threw: the schedule still believes a callback
  // is queued, so the next pass's groups would never be ended.
  auto comm = std::make_shared<testing::LocalCommunicator>();
  auto schedule = ShardingSchedule::of(*comm);
  std::vector<std::string> log;
  FakeGroup a("a", log), b("b", log);
  pass_that_throws(*schedule, a);
  backward_calling([&] { schedule->began_backward(&b); });
  EXPECT_TRUE(log.empty());
  schedule->abandon_backward();
}

TEST(ShardingSchedule, CountsUnshardedBytesAndTheirPeak) {
  auto comm = std::make_shared<testing::LocalCommunicator>();
  auto schedule = ShardingSchedule::of(*comm);
  schedule->add_unsharded_bytes(10);
  schedule->add_unsharded_bytes(5);
  EXPECT_EQ(schedule->unsharded_bytes(), 15);
  EXPECT_EQ(schedule->peak_unsharded_bytes(), 15);
  schedule->add_unsharded_bytes(-12);
  EXPECT_EQ(schedule->unsharded_bytes(), 3);
  EXPECT_EQ(schedule->peak_unsharded_bytes(), 15);
  schedule->reset_peak_unsharded_bytes();
  EXPECT_EQ(schedule->peak_unsharded_bytes(), 3);
  schedule->add_unsharded_bytes(2);
  EXPECT_EQ(schedule->peak_unsharded_bytes(), 5);
  schedule->add_unsharded_bytes(-5);
  EXPECT_EQ(schedule->unsharded_bytes(), 0);
}

}  // namespace
}  // namespace fsdp_muon
