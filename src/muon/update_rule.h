#pragma once
// A Muon variant, declared in one place (docs/DESIGN.md §10, "Add a Muon variant"): what it keeps
// per matrix besides momentum, and what the owner of a matrix does to it after Newton–Schulz.
// The planner's bytes, FsdpMuon's exchange and step, single-device Muon and the checkpoints read
// this declaration; none of them names a variant. Internal header.

#include <string>

#include <ATen/core/Tensor.h>

#include <fsdp_muon/muon/muon_options.h>

namespace fsdp_muon::detail {

struct UpdateRule {
  std::string name;  // what to_string(Normalization) writes
  // One value per matrix row kept across steps (NorMuon's second moment): created as zeros,
  // sharded by rows like the matrix, carried with each piece in FsdpMuon's gather and scatter,
  // saved and resharded by checkpoints (under MuonParamState's normuon_variance). False: none.
  bool per_row_state = false;
  // The owner's transform of one orthogonalized rows × cols matrix O, before the scale; updates
  // `row_state` ([rows], O's dtype) in place where the rule keeps one (else it is undefined).
  // Null: O as it is. It sees the whole matrix, so single-device Muon and every FsdpMuon owner
  // compute the same bits.
  at::Tensor (*transform)(const at::Tensor& o, const at::Tensor& row_state,
                          const MuonOptions& options) = nullptr;
  // The transform also takes a [batch, rows, cols] batch (row state [batch, rows]) in one call,
  // each matrix getting the bits the 2-D call gives it where batched Newton–Schulz is bitwise
  // (docs/DESIGN.md §4, "Batching"). False: a batch goes through it one matrix at a time.
  bool transforms_batches = false;
};

// The rule of a Normalization value: the built-in ones, or one registered below. An unknown value
// is an error naming it.
const UpdateRule& update_rule(Normalization normalization);
inline const UpdateRule& update_rule(const MuonOptions& options) {
  return update_rule(options.normalization());
}
bool has_update_rule(Normalization normalization);

// Declares a variant outside the library's table (a test's, an extension's) under `value`, a
// Normalization the library does not define; then MuonOptions().normalization(value) selects it
// everywhere. Call it before constructing optimizers that use it, not while they step.
void register_update_rule(Normalization value, UpdateRule rule);

}  // namespace fsdp_muon::detail
