#pragma once
// The elementwise part of a Muon step (docs/DESIGN.md §4), shared by single-device Muon (full
// tensors) and FsdpMuon (1-D local shards of the same parameters).
//
// Bitwise contract: for any split of a parameter into contiguous pieces, applying these functions
// to the pieces gives exactly the bits of applying them to the whole tensor. This holds only if
// every output element is rounded the same way wherever it sits in memory. ATen's CPU kernels run
// a vectorized loop over the aligned body of a tensor and a scalar loop over the tail, and for
// fused operations (lerp, addcmul, addcdiv, add/sub with alpha != 1) the vectorized loop uses an
// FMA (one rounding) while the scalar loop multiplies and adds separately (two roundings). Where
// a shard starts decides which loop an element lands in, so fused ops would make the result
// depend on the shard layout. The implementation therefore uses only mul, add (alpha = 1), sub
// (alpha = 1) and div with tensor or scalar operands, each of which rounds exactly once per
// element in every code path. Keep it that way when editing muon_math.cpp.

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/muon/muon_options.h>

namespace fsdp_muon::detail {

// Weight decay (in place on `param`, or on a copy of the gradient for kL2 — the user's .grad is
// never modified), then the momentum EMA B <- mu*B + (1-mu)*G (in place on `momentum_buffer`),
// and returns the Newton-Schulz input: U = (1-mu)*G + mu*B with Nesterov, else a copy of B (a new
// tensor, never aliasing the buffer).
//
// `momentum_buffer` must already exist: the caller creates it lazily as zeros with the
// parameter's shape and dtype (param dtype, like torch.optim.Muon: an fp32 main-weight shard
// gets fp32 momentum, a bf16 parameter bf16 momentum). `param`, `grad` and `momentum_buffer`
// must have the same shape, dtype and device.
at::Tensor muon_momentum_input(const at::Tensor& param, const at::Tensor& grad,
                               at::Tensor& momentum_buffer, const MuonOptions& options);

// The same for many pieces that share `options`, each at its position in the three lists, as a
// few multi-tensor (_foreach_) operations: on CUDA a kernel serves many pieces, and the bits are
// those of muon_momentum_input on each piece (the same operations, rounding once per element;
// NaN payloads aside).
// Without Nesterov the inputs are copies of the buffers.
std::vector<at::Tensor> muon_momentum_inputs(at::TensorList params, at::TensorList grads,
                                             at::TensorList momentum_buffers,
                                             const MuonOptions& options);

// The scale factor of the orthogonalized update of a rows x cols (out x in) matrix:
// spectral sqrt(max(rows, cols)); shape_scaling sqrt(max(1, rows/cols)); unit_rms_norm
// sqrt(rows/cols); match_rms_adamw 0.2*sqrt(max(rows, cols)); none 1.
double muon_scale(int64_t rows, int64_t cols, ScaleMode mode);

// newton_schulz(U), then the transform of the options' update rule (update_rule.h: NorMuon's
// normalization, or none), then * (muon_scale(rows, cols) * extra_scale_factor), for a full 2-D
// matrix U or for a 3-D batch of same-shape matrices (rows, cols its last two sizes), in U's
// dtype. A rule with per-row state updates `row_state` in place — [rows] for a matrix,
// [batch, rows] for a batch; for any other rule `row_state` must be undefined.
at::Tensor muon_orthogonalized_update(const at::Tensor& full_u, const MuonOptions& options,
                                      const at::Tensor& row_state = at::Tensor());

// NorMuon's normalization of one orthogonalized rows × cols matrix O (docs/DESIGN.md §4), its
// update rule's transform: v ← β2·v + (1 − β2)·mean_j(O_ij²) in place on `variance` ([rows], O's
// dtype), then O_ij / (√v_i + ε) rescaled by ‖O‖_F / max(‖that‖_F, ε). Always whole matrices:
// the reductions see the same shape, hence the same bits, in Muon and in an FsdpMuon owner. Also
// a [batch, rows, cols] batch with variance [batch, rows], each matrix on its own.
at::Tensor muon_normuon_normalize(const at::Tensor& o, const at::Tensor& variance,
                                  const MuonOptions& options);

// The per-row state of `param` (created as zeros [rows] in the parameter's dtype on first use)
// where the options' update rule keeps one; undefined otherwise.
at::Tensor muon_row_state(MuonParamState& state, const at::Tensor& param,
                          const MuonOptions& options);
// The same for a holder of a sharded matrix that keeps `rows` of its rows (detail::
// rows_starting_in, docs/DESIGN.md §4): zeros [rows] in `like`'s dtype and device on first use.
// A state of another length (which no save or load makes) is an error naming both.
at::Tensor muon_row_state(MuonParamState& state, const at::Tensor& like, int64_t rows,
                          const MuonOptions& options);

// param <- param - lr * update, computed as one mul (lr * update) and one sub, in place.
// `update` may be a slice of the full update matching a local shard of the parameter.
void muon_apply_update(const at::Tensor& param, const at::Tensor& update,
                       const MuonOptions& options);

// muon_apply_update on each (param, update) pair of the lists, as two multi-tensor operations.
void muon_apply_updates(at::TensorList params, at::TensorList updates, const MuonOptions& options);

// The MuonParamState of `param` in an optimizer's state map, created lazily on its first step
// (momentum: zeros with the parameter's shape and dtype), with its step counter advanced. Muon
// and FsdpMuon share it so their state is created, and saved, the same way.
using OptimizerStateMap =
    ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;
MuonParamState& advance_muon_state(OptimizerStateMap& state, const at::Tensor& param);

}  // namespace fsdp_muon::detail
