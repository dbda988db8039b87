#pragma once
// FsdpMuon (docs/DESIGN.md §3): Muon over sharded parameters. Momentum stays sharded; every 2-D
// matrix is orthogonalized by exactly one rank, its owner, which receives the matrix's pieces from
// the ranks that hold them and sends each its slice of the update back. The result equals
// single-device Muon on the averaged gradients, bitwise where the same kernels run.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/non_finite_gradients.h>
#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/muon/muon_options.h>
#include <fsdp_muon/planning/plan_options.h>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace fsdp_muon {

class FsdpParameterGroup;

// Whether FsdpMuon orthogonalizes the same-shape matrices a rank owns in a round with one
// batched Newton–Schulz call (docs/DESIGN.md §4, "Batching"). A batched call is faster (one
// strided-batched GEMM instead of one small GEMM per expert), but a backend's batched kernel
// need not round every matrix exactly as the 2-D call does, and which matrices a rank batches
// depends on the world size and the owner plan.
enum class NewtonSchulzBatching {
  // Batch only where the batched kernel is known to give every matrix the 2-D call's bits, so
  // the result stays equal to single-device Muon at any world size: on the CPU with fp32
  // Newton–Schulz (MuonOptions::newton_schulz().compute_dtype()) and one intra-op thread.
  // Everywhere else, one by one.
  kWhereBitwise,
  // Always batch: faster, but a matrix's last bits may then differ from single-device Muon's
  // and between world sizes (bf16 on the CPU; CUDA until scripts/gpu-check shows otherwise).
  kAlways,
  // One Newton–Schulz call per matrix.
  kNever,
  // The default: kWhereBitwise, and on CUDA also the experts of a MatrixLayout::batched() group
  // (declared one batch by the user, often thousands of small matrices, where one call per expert
  // costs more in kernel launches than in math). Those may differ from single-device Muon in the
  // last bits on CUDA, as under kAlways; everything else keeps kWhereBitwise's exactness.
  kAuto,
};

FSDP_MUON_API const char* to_string(NewtonSchulzBatching mode);

// Distribution settings of FsdpMuon (the math is in MuonOptions).
struct FSDP_MUON_API FsdpMuonConfig {
  // The owner planner's settings (see OwnerPlanOptions): who may orthogonalize a matrix, when
  // ranks meet, the prefetch budget, overlap, who orthogonalizes on an HSDP mesh. FsdpMuon
  // plans plan_owners(its groups, its mesh, planner(), the rates below); owner_plan() is that
  // plan. e.g. .planner(OwnerPlanOptions().owner_schedule(OwnerSchedule::kWindows)), or
  // config.planner().prefetch_budget_bytes(0).
  TORCH_ARG(OwnerPlanOptions, planner) = {};
  // The cost model's rates (docs/DESIGN.md §7, see CostRates) the plan is priced at.
  // std::nullopt, the default: measured at construction, collectively: Newton–Schulz of the
  // median matrix (at most 2^18 elements on the CPU, 2^22 on CUDA), short all-to-alls on the
  // shard and replicate communicators, each the fastest of three runs, the slowest rank's times
  // on every rank: tens of ms. A rate nothing measures (the inter-node rate on one replica, the
  // link rates on one rank) takes CostRates()'s default. The plan (owners, rounds) then depends
  // on the machine and its load, the result bits never do.
  // A value: the plan is made at exactly these rates and nothing is measured (reproducible
  // plans, or rates measured once elsewhere), e.g. .rates(CostRates().bytes_per_second(1e9)).
  // last_step_stats() and describe() report the rates planned with and whether they were
  // measured.
  TORCH_ARG(std::optional<CostRates>, rates) = std::nullopt;
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
  TORCH_ARG(NewtonSchulzBatching, batch_newton_schulz) = NewtonSchulzBatching::kAuto;
};

struct FsdpMuonStepStats;  // optimizer/fsdp_muon_introspection.h (the engine tier)
struct FsdpMuonMatrix;
struct OwnerPlan;  // planning/owner_plan.h (the engine tier)

// Muon for the 2-D sharded parameters of FsdpParameterGroups on one mesh (the groups' shared
// DeviceMesh: a 1-D one for groups built on a Communicator; groups on different meshes are an
// error on every rank). On a mesh of several replicas each matrix is orthogonalized once in the
// world or once in every replica (OwnerPlanOptions::replica_newton_schulz), and every replica
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
class FSDP_MUON_API FsdpMuon : public torch::optim::Optimizer {
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
  // (OwnerPlan::world_size): world ranks under ReplicaNewtonSchulz::kOncePerWorld(Relay) on a mesh
  // of several replicas, shard ranks otherwise (the same in every replica).
  int owner_of(const at::Tensor& sharded_parameter) const;
  const FsdpMuonStepStats& last_step_stats() const;
  // Steps whose update NonFiniteGradients::kSkipStep skipped, since construction.
  int64_t skipped_steps() const;
  // One line for logs: the mesh shape, the replica mode asked for and the one chosen, the cost
  // model's rates the plan was made with (measured at construction, and which took CostRates'
  // defaults for want of anything to measure; or given by FsdpMuonConfig::rates) and its
  // predicted seconds per step (OwnerPlan::estimated_seconds).
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;

  void add_group(const torch::optim::OptimizerParamGroup& param_group);
  void build();
};

}  // namespace fsdp_muon
