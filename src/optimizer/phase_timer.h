#pragma once
// How long each phase of FsdpMuon::step took (docs/DESIGN.md §3). On the CPU a phase's work is
// done when its host code returns, so host wall time is its time. On CUDA the host only enqueues
// work on the current stream, so a phase is timed by CUDA events recorded on that stream around
// it, and the times are read (waiting for the last event) only when someone asks for them: a
// step that nobody profiles never waits. Internal header.

#include <memory>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/Device.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

namespace fsdp_muon::detail {

class PhaseTimer {
 public:
  using Field = double FsdpMuonStepStats::*;

  // Times phases of work on `device` (its current stream when it is a CUDA device).
  explicit PhaseTimer(c10::Device device);
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // Adds the time from its construction to its destruction to `field` of the stats. While a
  // RecordFunction callback listens (torch's profiler, fsdp_muon_bench --count-ops), the phase is
  // also a user scope named phase_name(field).
  class Scope {
   public:
    Scope(PhaseTimer& timer, Field field);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    PhaseTimer& timer_;
    Field field_;
    size_t index_;
    std::unique_ptr<at::RecordFunction> record_;
  };
  Scope measure(Field field) { return Scope(*this, field); }

  // "fsdp_muon::<phase>" for a field of FsdpMuonStepStats ("fsdp_muon::orthogonalize" for
  // orthogonalize_seconds).
  static const char* phase_name(Field field);

  // Forgets the phases of the previous step.
  void reset();
  // Adds every phase's time, in seconds, to its field of `stats`, then forgets them. On CUDA it
  // first waits for the work timed so far through comm.to_host, so that the wait is bounded by
  // the communicator's timeout: the timed work includes the step's collectives.
  void add_to(FsdpMuonStepStats& stats, Communicator& comm);

 private:
  struct Interval;
  size_t begin(Field field);
  void end(size_t index);

  c10::Device device_;
  std::vector<std::unique_ptr<Interval>> intervals_;
};

}  // namespace fsdp_muon::detail
