#pragma once
// Gradient clipping by the global norm over sharded gradients (docs/DESIGN.md §2, Clipping): the
// C++ counterpart of torch::nn::utils::clip_grad_norm_ for FsdpParameterGroup gradient shards.

#include <memory>
#include <vector>

#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/non_finite_gradients.h>

namespace fsdp_muon {

class FsdpParameterGroup;  // parameter_group.h (the engine tier)

// Scales every gradient shard of `groups` (the .grad() of their sharded parameters, matrices and
// the rest alike) so that the norm of the whole model's gradient is at most `max_norm`, and
// returns that norm before clipping, as torch::nn::utils::clip_grad_norm_ does on the unsharded
// gradients: norm_type p > 0 sums |g|^p over every rank's shard (in double) and takes the p-th
// root; norm_type = infinity takes the largest |g|. One all-reduce for all groups together, so
// every group must be on the same communicator (on a mesh: the same mesh, and the all-reduce runs
// over its shard group, since the replicas hold identical gradient shards) and every rank must
// call it with the same groups.
// Call it after reduce_scatter_grads() (whose reductions it reads) and before the optimizers'
// steps. A non-finite norm (a NaN or Inf gradient somewhere) is handled by `non_finite`, the same
// on every rank: kSkipStep leaves the gradients as they are (FsdpMuon's default then skips its
// step; stock AdamW does not look), kThrow throws naming the norm, kIgnore scales like torch
// (every gradient becomes NaN).
FSDP_MUON_API double clip_grad_norm(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                                    double max_norm, double norm_type = 2.0,
                                    NonFiniteGradients non_finite = NonFiniteGradients::kSkipStep);

}  // namespace fsdp_muon
