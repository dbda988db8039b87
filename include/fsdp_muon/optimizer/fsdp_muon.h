#pragma once
// FsdpMuon (docs/DESIGN.md §3): Muon over sharded parameters. Momentum stays sharded; every 2-D
// matrix is orthogonalized by exactly one rank, its owner, which receives the matrix's pieces from
// the ranks that hold them and sends each its slice of the update back. The result equals
// single-device Muon on the averaged gradients, bitwise where the same kernels run.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/muon/muon_options.h>
#include <fsdp_muon/optimizer/owner_plan.h>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace fsdp_muon {

class FsdpParameterGroup;

// What FsdpMuon::step does when a gradient holds NaN or Inf on any rank. The check rides on the
// agreement all-reduce every step already runs (no extra collective); kIgnore skips it.
enum class NonFiniteGradients {
  kIgnore,  // no check: the matrix's update becomes NaN on every rank (as in torch.optim.Muon)
  // The default: every rank skips FsdpMuon's update (momentum untouched), counts the step, and
  // rank 0 warns once per skipped step, naming the step and the first parameter with NaN/Inf.
  kSkipStep,
  kThrow,  // a clear error on every rank naming the parameters and how many ranks saw them
};

const char* to_string(NonFiniteGradients mode);

// Whether FsdpMuon orthogonalizes the same-shape matrices a rank owns in a round with one
// batched Newton–Schulz call (docs/DESIGN.md §4, "Batching"). A batched call is faster (one
// strided-batched GEMM instead of one small GEMM per expert), but a backend's batched kernel
// need not round every matrix exactly as the 2-D call does, and which matrices a rank batches
// depends on the world size and the owner plan.
enum class NewtonSchulzBatching {
  // Batch only where the batched kernel is known to give every matrix the 2-D call's bits, so
  // the result stays equal to single-device Muon at any world size: on the CPU with fp32
  // Newton–Schulz (MuonOptions::ns_dtype) and one intra-op thread. Everywhere else, one by one.
  kWhereBitwise,
  // Always batch: faster, but a matrix's last bits may then differ from single-device Muon's
  // and between world sizes (bf16 on the CPU; CUDA until scripts/gpu-check shows otherwise).
  kAlways,
  // One Newton–Schulz call per matrix.
  kNever,
};

const char* to_string(NewtonSchulzBatching mode);

// Distribution settings of FsdpMuon (the math is in MuonOptions).
struct FsdpMuonConfig {
  // Who may orthogonalize a matrix (see OwnerPolicy). The default, kBalanced, was chosen from
  // the planned critical paths in bench/RESULTS.md: holders-only leaves ranks that hold
  // expensive matrices whole overloaded in every layer.
  TORCH_ARG(OwnerPolicy, owner_policy) = OwnerPolicy::kBalanced;
  // kBalanced: the bytes a rank may send per step (gather + scatter), as a multiple of the
  // busiest rank's under holders-only (OwnerPlan::holders_only_max_bytes); >= 1, infinity for
  // no limit, or kBytesRatioByCost, the default: the cost model below chooses it, with the
  // rates calibrate_rates measured (so trading bytes for balance is priced on this machine's
  // links, not guessed; OwnerPlan::max_bytes_ratio says which limit it took).
  TORCH_ARG(double, max_bytes_ratio) = kBytesRatioByCost;
  // The cost model (docs/DESIGN.md §7): a plan's step costs its orthogonalize critical path in
  // FLOPs at this Newton–Schulz rate plus its busiest rank's bytes at this per-rank send rate
  // (OwnerPlan::estimated_seconds). With max_bytes_ratio(kBytesRatioByCost) the planner keeps,
  // among a fixed list of limits from 1 to unlimited, the limit whose plan costs least. The
  // defaults are estimates for an H200 NVLink node (bf16 Newton–Schulz at ~40% of peak,
  // ~150 GB/s of all-to-all per rank), not measurements: calibrate_rates replaces them.
  TORCH_ARG(double, newton_schulz_flops_per_second) = 4e14;
  TORCH_ARG(double, bytes_per_second) = 1.5e11;
  // The cost model's per-rank send rate between replicas (across nodes) on a replicate x shard
  // mesh; bytes_per_second is the rate within a replica. The default is an estimate for 400 Gb/s
  // InfiniBand per GPU under all-to-all (~25 GB/s achieved), not a measurement.
  TORCH_ARG(double, inter_node_bytes_per_second) = 2.5e10;
  // The cost model's fixed cost of one collective exchange (a gather or a scatter), with which
  // overlap_communication decides how many rounds a step has (OwnerPlan::pipelined_seconds).
  // The default is an estimate for an NCCL all-to-all within a node.
  TORCH_ARG(double, exchange_latency_seconds) = 5e-5;
  // On a mesh with several replicas: who orthogonalizes each matrix (see ReplicaNewtonSchulz).
  // kByCost, the default, picks at construction whichever of kOncePerWorld and kOncePerReplica
  // the cost model above predicts faster. The result bits are the same under all three.
  TORCH_ARG(ReplicaNewtonSchulz, replica_newton_schulz) = ReplicaNewtonSchulz::kByCost;
  // Measure the cost model's rates at construction (docs/DESIGN.md §7): Newton–Schulz of the
  // median matrix (at most 2^18 elements on the CPU, 2^22 on CUDA), short all-to-alls on the
  // shard and replicate communicators, each the fastest of three runs, the slowest rank's times
  // on every rank: tens of ms. Each of the four rates above left at its default is replaced by
  // its measurement (a rate set to any other value is kept; one nothing measures, such as the
  // inter-node rate on one replica, keeps its default); with every rate set, nothing is
  // measured. The plan (owners, rounds) then depends on the machine and its load, the result
  // bits never do. last_step_stats() reports the rates planned with.
  TORCH_ARG(bool, calibrate_rates) = true;
  // When ranks meet (see OwnerSchedule): kRounds, the default, chosen from bench/RESULTS.md,
  // packs every rank's owned matrices into rounds of about equal cost over the whole model.
  TORCH_ARG(OwnerSchedule, owner_schedule) = OwnerSchedule::kRounds;
  // Bytes of full matrices one rank may hold at once. kRounds: each rank's owned matrices of a
  // round fit it; kWindows: consecutive FSDP groups are gathered together (a window) while
  // every rank's owned full matrices in them fit. With overlap_communication two exchanges are
  // in flight, each packed to half of it. 0 is one matrix (rounds) or one group (windows) at a
  // time, kUnlimitedPrefetch everything at once. A matrix or group larger than the budget
  // still runs, alone. The result bits never depend on it.
  // The default, 1 GiB, was chosen from the planned critical paths in bench/RESULTS.md.
  TORCH_ARG(int64_t, prefetch_budget_bytes) = int64_t{1} << 30;
  // Start the gather of the next round (or window) before orthogonalizing the current one, and
  // let the current one's scatter run while the next is orthogonalized (docs/DESIGN.md §3);
  // each round is then packed to half of prefetch_budget_bytes, so that what a rank holds at
  // once stays within it, and under kRounds the cost model splits the step into more rounds
  // where that hides more of the exchange (OwnerPlan::pipelined_seconds). The result bits are
  // the same either way.
  TORCH_ARG(bool, overlap_communication) = true;
  // See NonFiniteGradients. With kSkipStep (the default: one NaN must not silently turn the
  // whole model into NaN) the model weights are still refreshed (another optimizer may have
  // stepped the groups' other parameters), skipped_steps() counts it and rank 0 warns. The check
  // needs check_gradient_agreement; kIgnore turns it off.
  TORCH_ARG(NonFiniteGradients, non_finite_gradients) = NonFiniteGradients::kSkipStep;
  // Each step starts with one small all-reduce that makes a rank mismatch (different gradients
  // present, edited parameter groups, options changed on some ranks only, unreduced ZeRO-1
  // gradients, a local error) the same error on every rank instead of a hang or a silent
  // divergence, at the price of a host synchronization (a second one with the non-finite check,
  // whose flags are copied to the host first). false skips it for loops that guarantee
  // agreement: step() then never waits on the host (on CUDA), a mismatch hangs or fails on some
  // ranks only, and only what a rank sees alone is checked (valid options, unedited groups,
  // reduced ZeRO-1 gradients, gradient shapes): not which gradients the other ranks have, not
  // that options changed after construction (lr, momentum, weight decay, the rest) are alike on
  // every rank. The non-finite check needs it: with false, set
  // non_finite_gradients(NonFiniteGradients::kIgnore) too.
  TORCH_ARG(bool, check_gradient_agreement) = true;
  // On a mesh of several replicas (HSDP), every N-th step() call (0: never, the default) checks
  // that every replica still holds the same main-weight shards as replica 0: each rank hashes
  // its shards of the groups FsdpMuon steps (every parameter of them, AdamW's included), and the
  // hashes ride in the agreement's all-reduce (16 bytes per group). A replica whose weights
  // changed alone (an edit outside the optimizers, a load on some ranks, a faulty device) fails
  // the step on every rank, naming the replica and the first parameter that differs; nothing is
  // changed. The hash costs one pass over the shards and one host copy on the steps it runs.
  // Needs check_gradient_agreement.
  TORCH_ARG(int64_t, check_replicas_every) = 0;
  // See NewtonSchulzBatching. Matrices batch together when they have the same shape, dtype and
  // optimizer parameter group, up to 2^25 elements per call.
  TORCH_ARG(NewtonSchulzBatching, batch_newton_schulz) = NewtonSchulzBatching::kWhereBitwise;

 public:  // TORCH_ARG leaves the struct in a private section
  // This config's planner settings, with the rates as set: plan_owners(groups, W,
  // owner_plan_options()) is the plan a FsdpMuon with this config runs when nothing is
  // calibrated (calibrate_rates(false), or every rate set). Calibrated rates replace the ones
  // left at their defaults; FsdpMuon::owner_plan() is the plan it runs either way.
  OwnerPlanOptions owner_plan_options() const;
};

// What the last step() did on this rank.
struct FsdpMuonStepStats {
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
  // to other replicas (inter-node; only ReplicaNewtonSchulz::kOncePerWorld's scatter sends
  // any: a gather never leaves the owner's replica). gather_bytes = gather_intra_node_bytes +
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
  // (OwnerPlan::pipelined_seconds), and the rates it was planned with: measured at construction
  // where rates_measured (FsdpMuonConfig::calibrate_rates), the config's otherwise.
  double predicted_seconds = 0;
  bool rates_measured = false;
  double newton_schulz_flops_per_second = 0;
  double bytes_per_second = 0;
  double inter_node_bytes_per_second = 0;
  double exchange_latency_seconds = 0;
};

// One matrix FsdpMuon updates, as planned at construction: a 2-D parameter, or one block of a
// parameter its param group's MuonOptions::matrix_layout divides (docs/DESIGN.md §3, "Layouts").
struct FsdpMuonMatrix {
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

// Muon for the 2-D sharded parameters of FsdpParameterGroups on one mesh (the groups' shared
// DeviceMesh: a 1-D one for groups built on a Communicator; groups on different meshes are an
// error on every rank). On a mesh of several replicas each matrix is orthogonalized once in the
// world or once in every replica (FsdpMuonConfig::replica_newton_schulz), and every replica
// ends each step with the same bits. Give it `group->sharded_parameters()` (or the 2-D ones of
// several groups) and give the other parameters of the same groups to an elementwise optimizer
// such as torch::optim::AdamW. step() refreshes the model weights of every group it holds a
// parameter of, so call the other optimizer's step() first; refresh a group FsdpMuon holds no
// parameter of yourself (group->refresh_model_weights()).
//
// Every rank must construct it with the same parameters in the same order, the same
// MuonOptions per parameter group and the same config, keep the options alike on every rank
// afterwards (schedulers stepped on every rank), and agree on which parameters have gradients at
// each step; all are checked (a clear error on every rank naming what differs, not a hang). Under
// ShardingStrategy::kOptim a step after a backward whose gradients were not reduce-scattered
// (group->reduce_scatter_grads()) is such an error too. The parameter groups are frozen at
// construction: add_param_group(), or editing param_groups() afterwards, is an error.
//
// A param group's MuonOptions::matrix_layout divides its parameters into matrices (row blocks of
// a fused QKV weight, the experts of a 3-D [E, m, n] tensor); each is planned, owned, gathered,
// orthogonalized and scattered on its own, and the result equals single-device Muon with the
// same layout.
//
// Limitations: data parallelism only (a 1-D or replicate x shard mesh; no tensor or pipeline
// parallelism inside the groups); parameters that are not matrices under their layout are an error
// unless MuonOptions::skip_non_matrix(true).
class FsdpMuon : public torch::optim::Optimizer {
 public:
  explicit FsdpMuon(std::vector<at::Tensor> sharded_params, MuonOptions defaults = MuonOptions(),
                    FsdpMuonConfig config = {});
  explicit FsdpMuon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                    MuonOptions defaults = MuonOptions(), FsdpMuonConfig config = {});
  ~FsdpMuon() override;

  // Per active matrix: weight decay, momentum and Nesterov input on the local shard; gather to
  // the owner; Newton–Schulz and scale on the owner; scatter the update slices; apply on the
  // shards; then refresh the model weights of each group.
  at::Tensor step(LossClosure closure = nullptr) override;

  // Always throws: FsdpMuon's owner plan covers a fixed set of parameters. Build a new
  // optimizer instead. (Optimizer::add_param_group is not virtual; a call through an Optimizer
  // reference is caught at the next step().)
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // ---- introspection ----
  const FsdpMuonConfig& config() const;
  // The owner plan, computed once at construction; its groups are fsdp_groups() and the
  // matrices of group g are the entries of matrices() with group_ordinal == g, in order.
  const OwnerPlan& owner_plan() const;
  const std::vector<std::shared_ptr<FsdpParameterGroup>>& fsdp_groups() const;
  const std::vector<FsdpMuonMatrix>& matrices() const;
  // Owner of a sharded parameter this optimizer orthogonalizes (of its first matrix when its
  // layout makes several: matrices() lists each); -1 for one it does not (a skipped non-2-D
  // parameter, an empty matrix, or a tensor it does not know). Owners are ranks of the plan
  // (OwnerPlan::world_size): world ranks under ReplicaNewtonSchulz::kOncePerWorld on a mesh of
  // several replicas, shard ranks otherwise (the same in every replica).
  int owner_of(const at::Tensor& sharded_parameter) const;
  const FsdpMuonStepStats& last_step_stats() const;
  // Steps whose update NonFiniteGradients::kSkipStep skipped, since construction.
  int64_t skipped_steps() const;
  // One line for logs: the mesh shape, the replica mode asked for and the one chosen, the cost
  // model's rates the plan was made with and its predicted seconds per step
  // (OwnerPlan::estimated_seconds).
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;

  void add_group(const torch::optim::OptimizerParamGroup& param_group);
  void build();
};

}  // namespace fsdp_muon
