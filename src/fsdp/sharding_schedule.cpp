#include "fsdp/sharding_schedule.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include "comm/agreement.h"
#include "common/check.h"
#include "fsdp/group_agreement.h"

namespace fsdp_muon {
namespace fsdp {

std::shared_ptr<ShardingSchedule> ShardingSchedule::of(const Communicator& comm) {
  static std::mutex mutex;
  static std::unordered_map<const Communicator*, std::weak_ptr<ShardingSchedule>> schedules;
  std::lock_guard<std::mutex> lock(mutex);
  // Drop the entries of schedules no group holds any more (their communicator may be gone and
  // its address reused).
  for (auto it = schedules.begin(); it != schedules.end();) {
    it = it->second.expired() ? schedules.erase(it) : std::next(it);
  }
  std::weak_ptr<ShardingSchedule>& slot = schedules[&comm];
  std::shared_ptr<ShardingSchedule> schedule = slot.lock();
  if (!schedule) {
    schedule = std::make_shared<ShardingSchedule>();
    slot = schedule;
  }
  return schedule;
}

void ForwardOrder::record(ScheduledGroup* group) {
  if (std::find(groups_.begin(), groups_.end(), group) == groups_.end()) groups_.push_back(group);
}

ScheduledGroup* ForwardOrder::after(ScheduledGroup* group) const {
  auto it = std::find(groups_.begin(), groups_.end(), group);
  if (it == groups_.end() || std::next(it) == groups_.end()) return nullptr;
  return *std::next(it);
}

ScheduledGroup* ForwardOrder::before(ScheduledGroup* group) const {
  auto it = std::find(groups_.begin(), groups_.end(), group);
  if (it == groups_.end() || it == groups_.begin()) return nullptr;
  return *std::prev(it);
}

void ForwardOrder::remove(ScheduledGroup* group) {
  groups_.erase(std::remove(groups_.begin(), groups_.end(), group), groups_.end());
}

void ShardingSchedule::reduction_started(ScheduledGroup* group) {
  reductions_.push_back(group);
  while (reductions_.size() > kMaxReductionsInFlight) {
    ScheduledGroup* oldest = reductions_.front();
    reductions_.pop_front();
    // Its all-reduce over the replicas is about to start: the one in flight before it finishes
    // first. Nothing is ever in replica_stage_ on a 1-D mesh, where advancing finishes the
    // reduction.
    while (!replica_stage_.empty()) {
      ScheduledGroup* previous = replica_stage_.front();
      replica_stage_.pop_front();
      previous->finish_reduction();
    }
    if (oldest->advance_reduction()) replica_stage_.push_back(oldest);
  }
}

void ShardingSchedule::reduction_finished(ScheduledGroup* group) {
  for (std::deque<ScheduledGroup*>* queue : {&reductions_, &replica_stage_}) {
    auto it = std::find(queue->begin(), queue->end(), group);
    if (it != queue->end()) queue->erase(it);
  }
}

void ShardingSchedule::began_backward(ScheduledGroup* group) {
  if (std::find(in_backward_.begin(), in_backward_.end(), group) == in_backward_.end()) {
    in_backward_.push_back(group);
  }
  if (callback_queued_) return;
  // Runs once the whole backward pass has finished, on the thread that ran it.
  std::weak_ptr<ShardingSchedule> self = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    FSDP_MUON_API_SCOPE("FsdpParameterGroup");
    if (auto schedule = self.lock()) schedule->end_backward();
  });
  callback_queued_ = true;
}

void ShardingSchedule::abandon_backward() {
  in_backward_.clear();
  callback_queued_ = false;
}

void ShardingSchedule::ran_forward(const std::string& name) {
  // Forwards without a backward (evaluation with gradients enabled) must not grow this without
  // bound; every rank drops the same names.
  if (forward_names_.size() >= 4096)
    forward_names_.erase(forward_names_.begin(), forward_names_.begin() + 2048);
  forward_names_.push_back(name);
}

namespace {

// "[a, b, c]", at most 16 names.
std::string name_list(const std::vector<std::string>& names) {
  std::string s;
  for (size_t k = 0; k < std::min<size_t>(names.size(), 16); ++k) {
    s += (k ? ", " : "") + (names[k].empty() ? std::string("(unnamed)") : names[k]);
  }
  if (names.size() > 16) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return "[" + s + "]";
}

}  // namespace

void ShardingSchedule::check_forward_agreement(Communicator& comm) {
  if (callback_queued_) return;  // not the first group of this backward pass
  std::vector<std::string> names;
  names.swap(forward_names_);
  const std::string text = detail::join_lines(names);
  const std::vector<int> differ = detail::ranks_that_differ(comm, text);
  if (differ.empty()) return;
  const std::vector<std::string> texts = detail::gather_descriptions(comm, text);
  const int r = differ.front();
  FSDP_MUON_CHECK(false,
                  "the ranks ran different groups' forward() before "
                  "this backward: rank 0 ran ",
                  name_list(detail::split_lines(texts[0])), ", rank ", r, " ran ",
                  name_list(detail::split_lines(texts[r])), " (this is rank ", comm.rank(), " of ",
                  comm.size(),
                  "). Under sharding strategies optim_grads and optim_grads_params every rank must "
                  "run the same groups' forward(), in the same order, before each backward (a rank "
                  "without work for a group calls its forward() with an empty input); this "
                  "backward reduced nothing: call zero_grad() and run the step again");
}

void ShardingSchedule::end_backward() {
  callback_queued_ = false;
  std::vector<ScheduledGroup*> groups;
  groups.swap(in_backward_);
  for (ScheduledGroup* group : groups) group->end_backward();
}

void ShardingSchedule::remove(ScheduledGroup* group) {
  reductions_.erase(std::remove(reductions_.begin(), reductions_.end(), group), reductions_.end());
  replica_stage_.erase(std::remove(replica_stage_.begin(), replica_stage_.end(), group),
                       replica_stage_.end());
  in_backward_.erase(std::remove(in_backward_.begin(), in_backward_.end(), group),
                     in_backward_.end());
}

void ShardingSchedule::add_unsharded_bytes(int64_t delta) {
  unsharded_bytes_ += delta;
  peak_unsharded_bytes_ = std::max(peak_unsharded_bytes_, unsharded_bytes_);
}

}  // namespace fsdp
}  // namespace fsdp_muon
