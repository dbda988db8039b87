#pragma once
// FsdpMuon's state, shared by its construction (fsdp_muon.cpp) and its step (fsdp_muon_step.cpp).

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "muon/muon_option_fields.h"
#include "optimizer/exchange_layout.h"
#include "optimizer/phase_timer.h"
#include "optimizer/rate_calibration.h"
#include "optimizer/step_views.h"

namespace fsdp_muon {
namespace detail {

// The MuonOptions of parameter group `index`; a clear error for another optimizer's options.
MuonOptions& muon_options_of(torch::optim::OptimizerParamGroup& group, size_t index);

// Whether an owner batches same-shape matrices of a group with this layout (docs/DESIGN.md §4,
// "Batching"); Newton–Schulz computes in `compute_dtype` on `device`.
bool batches_newton_schulz(NewtonSchulzBatching mode, const c10::Device& device,
                           c10::ScalarType compute_dtype, MatrixLayout::Kind layout);

// Every field of `options` as (name, value), values exact (doubles by exact_double), generated
// from the table of muon/muon_option_fields.h in its order: what the construction agreement
// compares and what the step's fingerprint hashes.
std::vector<std::pair<std::string, std::string>> option_entries(const MuonOptions& options);

// A parameter accepted at construction (a matrix, or the matrices of its layout), before its
// matrices are put in plan order.
struct AcceptedMatrix {
  size_t group_ordinal;
  size_t index;
  size_t param_group;
  at::Tensor param;
};

// What one step() learned from its agreement, and the statistics it fills.
struct StepRun {
  std::vector<bool> active;                 // [matrix] has a gradient on every rank
  std::vector<const MuonOptions*> options;  // [optimizer group], validated once per step
  FsdpMuonStepStats stats;

  const MuonOptions& options_of(const FsdpMuonMatrix& m) const { return *options[m.param_group]; }
};

// Same-shape matrices an owner orthogonalizes in one Newton–Schulz call (docs/DESIGN.md §4,
// "Batching"), back to back in RoundInFlight::owned from `offset`.
struct OwnedBatch {
  std::vector<size_t> matrices;  // positions j in the round
  int64_t offset = 0;
  int64_t row_offset = 0;  // in RoundInFlight::owned_rows, where the rule keeps per-row state
  int64_t rows = 0;
  int64_t cols = 0;
  const MuonOptions* options = nullptr;
};

// One round as it moves through the step's phases: its matrices are round_matrices[round],
// position j in every vector below.
struct RoundInFlight {
  size_t round = 0;
  std::vector<bool> active;     // [j] has a gradient this step
  std::vector<bool> with_rows;  // [j] NorMuon: its per-row state travels with it
  std::vector<at::Tensor> own;  // [j] this rank's momentum input, owned matrices
  // Owners: every full matrix the rank owns in the round (input, then update), batch by batch in
  // one buffer; [j] a 1-D view of matrix j in it, and [j][h] of shard rank h's piece of that.
  at::Tensor owned;
  std::vector<at::Tensor> full;
  std::vector<std::vector<at::Tensor>> held_piece;
  // The same for per-row state (where the rule keeps it): one buffer, [j] 1-D views of it in
  // `variance`, and [j][h] shard rank h's rows.
  at::Tensor owned_rows;
  std::vector<std::vector<at::Tensor>> held_rows;
  std::vector<OwnedBatch> batches;
  // NorMuon (docs/DESIGN.md §3): [j] this rank's rows of the per-row state (its MuonParamState's
  // tensor, written back when the round is applied), and on owners the whole per-row state.
  std::vector<at::Tensor> row_state;
  std::vector<at::Tensor> variance;
  at::Tensor send;  // gather send
  at::Tensor recv;  // gather receive
  // One replica (ExchangeLayout::mirrored): recv and send, roles swapped; else their own.
  at::Tensor scatter_send;
  at::Tensor scatter_recv;
  // kOncePerWorldRelay: stage B's receive buffer (ExchangeLayout::relay), every replica's block.
  at::Tensor relay_recv;
  std::unique_ptr<CommWork> work;  // the gather or scatter in flight
  int64_t full_bytes = 0;          // of `full`
};

}  // namespace detail

struct FSDP_MUON_LOCAL FsdpMuon::Impl {
  FsdpMuonConfig config;
  // The groups' mesh: the ranks agree over world_comm (every rank of the mesh) and exchange
  // matrices over exchange_comm: shard_comm when each replica orthogonalizes on its own (and on
  // a 1-D mesh, where it is world_comm), world_comm when owners span the replicas
  // (ReplicaNewtonSchulz::kOncePerWorld and kOncePerWorldRelay, whose stage B runs over
  // mesh.replicate). Exchange rank q is shard rank q % shard_size of replica q / shard_size
  // (docs/DESIGN.md §3).
  DeviceMesh mesh;
  std::shared_ptr<Communicator> world_comm;  // mesh.world
  std::shared_ptr<Communicator> shard_comm;  // mesh.shard
  std::shared_ptr<Communicator> exchange_comm;
  int shard_size = 1;
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<FsdpMuonMatrix> matrices;
  // [matrix] this rank's piece of it: elements [first, first + second) of its parameter's shard
  // (second == 0 where the rank holds none of the matrix).
  std::vector<std::pair<int64_t, int64_t>> local_piece;
  // [optimizer group] the matrix layout the plan was made for: step() refuses another.
  std::vector<MatrixLayout> frozen_layouts;
  std::vector<std::vector<size_t>> group_matrices;  // [group] -> indices into matrices
  // [round] -> indices into matrices, and their placements, in the plan's round order.
  std::vector<std::vector<size_t>> round_matrices;
  std::vector<std::vector<detail::MatrixPlacement>> round_placement;
  std::unordered_map<const c10::TensorImpl*, size_t> matrix_of;
  OwnerPlan plan;
  // The rates measured at construction (FsdpMuonConfig::rates left std::nullopt), before
  // planning; measured == false when the config gave them.
  detail::MeasuredRates measured;
  // Parameter identities per optimizer group as constructed: step() compares against them.
  std::vector<std::vector<const c10::TensorImpl*>> frozen;
  // [round], laid out again when the active set changes
  std::vector<detail::ExchangeLayout> exchanges;
  FsdpMuonStepStats stats;
  // The last step's phase times, added to `stats` when they are first read (on CUDA that waits
  // for the step's work, so a step nobody profiles never waits).
  std::unique_ptr<detail::PhaseTimer> timer;
  int64_t skipped_steps = 0;
  int64_t step_calls = 0;  // step() calls since construction, the one running included
  // Full-matrix bytes alive now on this rank, for FsdpMuonStepStats::max_transient_bytes.
  int64_t live_full_bytes = 0;

  // This rank in the exchange (owners are exchange ranks), and in its shard group (held ranges
  // and placements are indexed by shard rank).
  int rank() const { return exchange_comm->rank(); }
  int shard_rank() const { return shard_comm->rank(); }
  int world_rank() const { return world_comm->rank(); }
  // This rank's piece of matrix m in a tensor laid out like its parameter's shard (the shard, its
  // gradient, its momentum).
  at::Tensor piece(const at::Tensor& shard_like, size_t m) const {
    return shard_like.narrow(0, local_piece[m].first, local_piece[m].second);
  }
  // [matrix] views of this rank's piece of it in its parameter's shard, gradient and momentum
  // buffer, kept across steps: the step finds them without an ATen call per matrix.
  detail::PieceViews param_pieces;
  detail::PieceViews grad_pieces;
  detail::PieceViews momentum_pieces;
  detail::PieceViews row_pieces;  // this rank's rows of each matrix's per-row state
  int world() const { return exchange_comm->size(); }  // exchange ranks
  int exchange_replicas() const { return world() / shard_size; }
  int replicas() const { return world_comm->size() / shard_size; }
  // kOncePerWorldRelay on several replicas: the scatter stays in the owner's replica (stage A)
  // and each rank's replicate group all-gathers the pieces (stage B, relay_updates).
  bool relays() const {
    return replicas() > 1 && plan.replica_newton_schulz == ReplicaNewtonSchulz::kOncePerWorldRelay;
  }

  const detail::ExchangeLayout& exchange(size_t round, const std::vector<bool>& active,
                                         const std::vector<bool>& with_rows);

  // ---- construction (fsdp_muon.cpp) ----
  std::vector<detail::AcceptedMatrix> accept_parameters(FsdpMuon& self);
  void plan_matrices(FsdpMuon& self, std::vector<detail::AcceptedMatrix> accepted);
  // The rates the owner plan is made at: the config's, or those measured (detail::planned_rates).
  CostRates plan_rates() const;
  // One "<key> = <value>" line per setting, option and parameter every rank must have alike.
  std::vector<std::string> describe_parameters(const FsdpMuon& self) const;

  // ---- the step (fsdp_muon_step.cpp): its two schedules (docs/DESIGN.md §3) ----
  void run_sequential(FsdpMuon& self, detail::StepRun& s);
  void run_pipelined(FsdpMuon& self, detail::StepRun& s);

  // ---- the step's phases, in order ----
  detail::StepRun agree_on_gradients(FsdpMuon& self);
  void advance_states(FsdpMuon& self, const detail::StepRun& s);
  at::Tensor non_finite_on_device(const std::vector<size_t>& with_gradient);
  at::Tensor matrices_not_finite(const std::vector<size_t>& which);
  at::Tensor not_finite(size_t m);
  at::Tensor flags_on_device(int64_t size, const std::vector<int64_t>& slots,
                             const std::vector<at::Tensor>& flags) const;
  void reject_non_finite(const std::vector<int64_t>& ranks_per_matrix, detail::StepRun& s);
  detail::RoundInFlight momentum_inputs(FsdpMuon& self, size_t round, const detail::StepRun& s);
  void start_gather(detail::RoundInFlight& f, detail::StepRun& s);
  void assemble_owned(detail::RoundInFlight& f, detail::StepRun& s);
  void orthogonalize_owned(detail::RoundInFlight& f, detail::StepRun& s);
  void start_scatter(detail::RoundInFlight& f, detail::StepRun& s);
  void relay_updates(detail::RoundInFlight& f, detail::StepRun& s);
  void apply_updates(detail::RoundInFlight& f, detail::StepRun& s);
  void refresh(size_t group, detail::StepRun& s);
};

}  // namespace fsdp_muon
