#pragma once
// NonFiniteGradients: one policy for a NaN or Inf gradient, shared by clip_grad_norm and FsdpMuon.

#include <fsdp_muon/config.h>

namespace fsdp_muon {

// What FsdpMuon::step and clip_grad_norm do when a gradient holds NaN or Inf on any rank. In
// FsdpMuon the check rides on the agreement all-reduce every step already runs (no extra
// collective); kIgnore skips it.
enum class NonFiniteGradients {
  kIgnore,  // no check: the matrix's update becomes NaN on every rank (as in torch.optim.Muon)
  // The default: every rank skips FsdpMuon's update (momentum untouched), counts the step, and
  // rank 0 warns once per skipped step, naming the step and the first parameter with NaN/Inf.
  kSkipStep,
  kThrow,  // a clear error on every rank naming the parameters and how many ranks saw them
};

FSDP_MUON_API const char* to_string(NonFiniteGradients mode);

}  // namespace fsdp_muon
