#pragma once
// How a parameter divides into the matrices Muon orthogonalizes (docs/DESIGN.md §4, "Layouts"):
// a MuonOptions field, so every parameter of a param group shares one layout.

#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/ArrayRef.h>

#include <fsdp_muon/config.h>

namespace fsdp_muon {

// One matrix of a parameter: the contiguous elements [offset, offset + rows * cols) of the
// flattened parameter, read as a rows x cols matrix.
struct FSDP_MUON_API MatrixBlock {
  int64_t offset = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t numel() const { return rows * cols; }
  friend bool operator==(const MatrixBlock& lhs, const MatrixBlock& rhs) {
    return lhs.offset == rhs.offset && lhs.rows == rhs.rows && lhs.cols == rhs.cols;
  }
};

// Which matrices a parameter holds. Each one is orthogonalized on its own: Newton–Schulz, the
// scale of ScaleMode by its own shape, NorMuon's rows; momentum and weight decay stay
// elementwise over the whole parameter.
//   whole()            a 2-D parameter is one matrix (the default).
//   row_blocks(rows)   a 2-D parameter whose consecutive row blocks are separate matrices:
//                      a fused QKV weight [q + 2·kv, d] is row_blocks({q, kv, kv}), per-head
//                      blocks are row_blocks({dh, dh, ...}). The entries must be > 0 and add up
//                      to the parameter's rows.
//   batched()          a 3-D parameter [E, m, n] is E matrices m x n (fused MoE experts).
// A 3-D parameter under whole() is not a matrix (an error unless skip_non_matrix); row_blocks
// on a parameter that is not 2-D, or batched() on one that is not 3-D, is always an error.
class FSDP_MUON_API MatrixLayout {
 public:
  enum class Kind { kWhole, kRowBlocks, kBatched };

  MatrixLayout() = default;  // whole()
  static MatrixLayout whole();
  static MatrixLayout row_blocks(std::vector<int64_t> rows);
  static MatrixLayout batched();

  Kind kind() const { return kind_; }
  // kRowBlocks: the rows of each block, in order; empty otherwise.
  const std::vector<int64_t>& block_rows() const { return rows_; }

  // Throws naming the fix for a row_blocks list that is empty or holds an entry <= 0;
  // shape-independent, so MuonOptions::validate() runs it. Errors name the calling API
  // ("fsdp_muon::MuonOptions: ...").
  void validate() const;
  // The matrices of a parameter of `shape`, in element order. Throws, naming `parameter`, when
  // the layout does not fit the shape (rows that do not add up, batched() on a non-3-D
  // parameter, a whole() parameter that is not 2-D, ...).
  std::vector<MatrixBlock> blocks(c10::IntArrayRef shape, const std::string& parameter) const;
  // "whole", "row_blocks{64, 16, 16}", "batched".
  std::string to_string() const;

  friend bool operator==(const MatrixLayout& lhs, const MatrixLayout& rhs) {
    return lhs.kind_ == rhs.kind_ && lhs.rows_ == rhs.rows_;
  }
  friend bool operator!=(const MatrixLayout& lhs, const MatrixLayout& rhs) { return !(lhs == rhs); }

 private:
  Kind kind_ = Kind::kWhole;
  std::vector<int64_t> rows_;
};

}  // namespace fsdp_muon
