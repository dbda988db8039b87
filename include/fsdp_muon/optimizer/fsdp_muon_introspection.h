#pragma once
// What FsdpMuon planned and what its last step did (the engine tier: not in the umbrella header;
// for benchmarks, logs and tests). docs/DESIGN.md §3.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>
#include <fsdp_muon/planning/owner_plan.h>

namespace fsdp_muon {

class FsdpParameterGroup;

// What the last step() did on this rank.
struct FSDP_MUON_API FsdpMuonStepStats {
  int64_t active_parameters = 0;  // matrices with gradients (the same on every rank)
  // Matrices whose gradient held NaN or Inf on some rank (0 unless non_finite_gradients is
  // checked), and whether the update was skipped for them.
  int64_t non_finite_parameters = 0;
  bool skipped = false;
  int64_t rounds = 0;  // exchanges the step ran (OwnerPlan::rounds; one per window under kWindows)
  // Matrices this rank orthogonalized, and the Newton–Schulz calls it took (fewer when
  // FsdpMuonConfig::batch_newton_schulz batched same-shape matrices).
  int64_t orthogonalized_matrices = 0;
  int64_t newton_schulz_calls = 0;
  int64_t gather_bytes = 0;   // sent by this rank in the gathers (Communicator::stats)
  int64_t scatter_bytes = 0;  // sent by this rank in the scatters
  // The same bytes by where they went: to the ranks of this rank's shard group (intra-node) or
  // to other replicas (inter-node; only the scatters of ReplicaNewtonSchulz::kOncePerWorld and
  // kOncePerWorldRelay send any, the relay's in its stage B over the replicate group: a gather
  // never leaves the owner's replica). gather_bytes = gather_intra_node_bytes +
  // gather_inter_node_bytes, and likewise for the scatter.
  int64_t gather_intra_node_bytes = 0;
  int64_t gather_inter_node_bytes = 0;
  int64_t scatter_intra_node_bytes = 0;
  int64_t scatter_inter_node_bytes = 0;
  int64_t check_bytes = 0;    // sent by this rank in the gradient-agreement all-reduce
  int64_t refresh_bytes = 0;  // sent by this rank refreshing model weights
  // Largest sum of full-matrix bytes this rank held at once (its owned matrices in one round or
  // window, or in two consecutive ones with overlap_communication); 0 on a rank that owns
  // nothing.
  int64_t max_transient_bytes = 0;
  // Seconds per phase. On the CPU: wall time. On CUDA: execution time on the caller's stream,
  // measured by CUDA events around each phase; last_step_stats() waits for the step's work the
  // first time it is called after a step (step() itself never waits for them), bounded by the
  // communicator's timeout: a peer that never arrives makes it throw instead of hang.
  double check_seconds = 0;
  double elementwise_seconds = 0;
  double gather_seconds = 0;
  double orthogonalize_seconds = 0;
  double scatter_seconds = 0;
  double apply_seconds = 0;
  double refresh_seconds = 0;
  // The owner plan's prediction of a step's gather + Newton–Schulz + scatter
  // (OwnerPlan::pipelined_seconds), and the rates it was planned with (OwnerPlan::rates):
  // measured at construction where rates_measured (FsdpMuonConfig::rates left std::nullopt;
  // those nothing could measure are CostRates' defaults, as describe() says), the config's
  // exactly otherwise.
  double predicted_seconds = 0;
  bool rates_measured = false;
  CostRates rates;
};

// One matrix FsdpMuon updates, as planned at construction: a 2-D parameter, or one block of a
// parameter its param group's MuonOptions::matrix_layout divides (docs/DESIGN.md §3, "Layouts").
struct FSDP_MUON_API FsdpMuonMatrix {
  std::shared_ptr<FsdpParameterGroup> group;
  size_t group_ordinal = 0;      // position of `group` in FsdpMuon::fsdp_groups()
  size_t index = 0;              // parameter index inside `group`
  size_t param_group = 0;        // index into FsdpMuon::param_groups() (its MuonOptions)
  at::Tensor sharded_parameter;  // the whole parameter's shard, shared by its blocks
  // The parameter's name, with "[b]" for block b of a row_blocks or batched parameter
  // ("attn.qkv[1]", "experts.w1[7]").
  std::string name;
  int64_t rows = 0;
  int64_t cols = 0;
  int owner = -1;  // a rank of the plan (see FsdpMuon::owner_of)
  // Block `block` of the parameter's `blocks` (0 of 1 under MatrixLayout::whole()): elements
  // [offset, offset + rows * cols) of the flattened parameter.
  size_t block = 0;
  size_t blocks = 1;
  int64_t offset = 0;
};

}  // namespace fsdp_muon
