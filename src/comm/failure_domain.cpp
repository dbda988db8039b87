#include "comm/failure_domain.h"

#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace fsdp_muon::detail {

std::shared_ptr<FailureDomain> FailureDomain::of(const std::string& key) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<FailureDomain>> domains;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<FailureDomain> domain = domains[key].lock();
  if (!domain) {
    domain = std::make_shared<FailureDomain>();
    domains[key] = domain;
  }
  return domain;
}

int64_t FailureDomain::join(std::string name, Abort abort) {
  std::optional<std::string> failed;
  int64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    id = next_id_++;
    failed = first_failure_;
    members_.emplace(id, Member{std::move(name), abort});
  }
  // The device is already known bad: a new member must not start work on it.
  if (failed) abort(*failed);
  return id;
}

void FailureDomain::leave(int64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto it = members_.find(id);
  if (it == members_.end()) return;
  abort_done_.wait(lock, [&] { return it->second.aborts_running == 0; });
  members_.erase(it);
}

std::string FailureDomain::fail(int64_t id, const std::string& error,
                                const std::function<void()>& own_abort) {
  std::vector<std::pair<int64_t, Abort>> to_abort;
  std::string first;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (first_failure_) {
      first = *first_failure_;
    } else {
      const auto it = members_.find(id);
      first_failure_ =
          (it == members_.end() ? std::string("a communicator") : it->second.name) + ": " + error;
      first = *first_failure_;
      for (auto& [other, member] : members_) {
        if (other == id) continue;
        ++member.aborts_running;  // leave() waits for it: the member outlives its abort
        to_abort.emplace_back(other, member.abort);
      }
    }
  }
  // Outside the lock, side by side: each abort may take up to its watchdog's bound.
  const auto finished = [this](int64_t member) {
    std::lock_guard<std::mutex> lock(mutex_);
    --members_.at(member).aborts_running;
    abort_done_.notify_all();
  };
  std::vector<std::thread> threads;
  threads.reserve(to_abort.size());
  for (auto& [other, abort] : to_abort) {
    try {
      threads.emplace_back([other = other, abort, first, &finished] {
        abort(first);
        finished(other);
      });
    } catch (const std::system_error&) {
      // No thread to be had: abort it here, after the others started.
      abort(first);
      finished(other);
    }
  }
  if (own_abort) own_abort();
  for (std::thread& t : threads) t.join();
  return first;
}

std::optional<std::string> FailureDomain::first_failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return first_failure_;
}

}  // namespace fsdp_muon::detail
