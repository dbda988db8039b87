#include "optimizer/phase_timer.h"

#include <chrono>
#include <optional>

#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace fsdp_muon::detail {
namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

struct PhaseTimer::Interval {
  Field field;
  Clock::time_point host_start;
  double host_seconds = 0;
  // CUDA: events on the current stream; timing needs BACKEND_DEFAULT (PyTorch's default flag
  // creates events that cannot time).
  std::optional<c10::Event> start;
  std::optional<c10::Event> stop;
  std::optional<c10::Stream> stream;  // the one `stop` was recorded on
};

PhaseTimer::PhaseTimer(c10::Device device) : device_(device) {}
PhaseTimer::~PhaseTimer() = default;

PhaseTimer::Scope::Scope(PhaseTimer& timer, Field field)
    : timer_(timer), field_(field), index_(timer.begin(field)) {
  auto record = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (record->isActive()) {
    record->before(phase_name(field));
    record_ = std::move(record);
  }
}

const char* PhaseTimer::phase_name(Field field) {
  using S = FsdpMuonStepStats;
  if (field == &S::check_seconds) return "fsdp_muon::check";
  if (field == &S::elementwise_seconds) return "fsdp_muon::elementwise";
  if (field == &S::gather_seconds) return "fsdp_muon::gather";
  if (field == &S::orthogonalize_seconds) return "fsdp_muon::orthogonalize";
  if (field == &S::scatter_seconds) return "fsdp_muon::scatter";
  if (field == &S::apply_seconds) return "fsdp_muon::apply";
  if (field == &S::refresh_seconds) return "fsdp_muon::refresh";
  return "fsdp_muon::phase";
}

PhaseTimer::Scope::~Scope() { timer_.end(index_); }

size_t PhaseTimer::begin(Field field) {
  auto interval = std::make_unique<Interval>();
  interval->field = field;
  if (device_.is_cuda()) {
    const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
    interval->start.emplace(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    interval->start->record(cuda.getStream(device_));
  } else {
    interval->host_start = Clock::now();
  }
  intervals_.push_back(std::move(interval));
  return intervals_.size() - 1;
}

void PhaseTimer::end(size_t index) {
  Interval& interval = *intervals_[index];
  if (device_.is_cuda()) {
    const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
    interval.stream = cuda.getStream(device_);
    interval.stop.emplace(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    interval.stop->record(*interval.stream);
  } else {
    interval.host_seconds =
        std::chrono::duration<double>(Clock::now() - interval.host_start).count();
  }
}

void PhaseTimer::reset() { intervals_.clear(); }

void PhaseTimer::add_to(FsdpMuonStepStats& stats, Communicator& comm) {
  std::optional<c10::Stream> waited;
  for (const auto& interval : intervals_) {
    double seconds = interval->host_seconds;
    if (interval->stop) {
      if (waited != interval->stream) {
        // The phases enqueued collectives: a peer that never arrives must make this wait an
        // error, not a hang (docs/DESIGN.md §5). An empty to_host waits for the whole stream.
        const c10::StreamGuard on_stream(*interval->stream);
        comm.to_host(at::empty({0}, at::TensorOptions().device(device_)));
        waited = interval->stream;
      }
      interval->stop->synchronize();
      seconds = interval->start->elapsedTime(*interval->stop) / 1000.0;  // milliseconds
    }
    stats.*(interval->field) += seconds;
  }
  intervals_.clear();
}

}  // namespace fsdp_muon::detail
