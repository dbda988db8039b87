#include <fsdp_muon/muon/matrix_layout.h>

#include <sstream>
#include <utility>

#include <c10/util/Exception.h>

#include "common/check.h"

namespace fsdp_muon {
namespace {}  // namespace

MatrixLayout MatrixLayout::whole() { return MatrixLayout(); }

MatrixLayout MatrixLayout::row_blocks(std::vector<int64_t> rows) {
  MatrixLayout layout;
  layout.kind_ = Kind::kRowBlocks;
  layout.rows_ = std::move(rows);
  return layout;
}

MatrixLayout MatrixLayout::batched() {
  MatrixLayout layout;
  layout.kind_ = Kind::kBatched;
  return layout;
}

void MatrixLayout::validate() const {
  FSDP_MUON_CHECK(kind_ == Kind::kWhole || kind_ == Kind::kRowBlocks || kind_ == Kind::kBatched,
                  "matrix_layout has an unknown kind ", static_cast<int>(kind_),
                  "; use MatrixLayout::whole(), row_blocks(...) or batched()");
  if (kind_ != Kind::kRowBlocks) {
    FSDP_MUON_CHECK(rows_.empty(), "matrix_layout ", to_string(),
                    " carries row blocks; only MatrixLayout::row_blocks has them");
    return;
  }
  FSDP_MUON_CHECK(!rows_.empty(),
                  "matrix_layout row_blocks{} has no blocks; give the rows of each block, e.g. "
                  "MatrixLayout::row_blocks({q, kv, kv}) for a fused QKV weight, or use "
                  "MatrixLayout::whole()");
  for (size_t i = 0; i < rows_.size(); ++i) {
    FSDP_MUON_CHECK(rows_[i] > 0, "matrix_layout ", to_string(), " has block ", i, " of ", rows_[i],
                    " rows; every row block needs at least one row");
  }
}

std::vector<MatrixBlock> MatrixLayout::blocks(c10::IntArrayRef shape,
                                              const std::string& parameter) const {
  validate();
  std::vector<MatrixBlock> out;
  switch (kind_) {
    case Kind::kWhole:
      FSDP_MUON_CHECK(shape.size() == 2, "parameter ", parameter, " has shape ", c10::str(shape),
                      ", which is not one matrix",
                      shape.size() == 3
                          ? "; a 3-D [E, m, n] parameter of E matrices needs "
                            ".matrix_layout(MatrixLayout::batched()) in its param group"
                          : "; give it to an elementwise optimizer such as AdamW");
      out.push_back({0, shape[0], shape[1]});
      return out;
    case Kind::kRowBlocks: {
      FSDP_MUON_CHECK(shape.size() == 2, "parameter ", parameter, " has shape ", c10::str(shape),
                      " but its param group's matrix_layout is ", to_string(),
                      ", which splits the rows of a 2-D parameter; put it in a param group with "
                      "another layout");
      int64_t sum = 0;
      for (int64_t rows : rows_) sum += rows;
      FSDP_MUON_CHECK(
          sum == shape[0], "parameter ", parameter, " has ", shape[0], " rows (shape ",
          c10::str(shape), ") but its param group's matrix_layout ", to_string(), " adds up to ",
          sum,
          " rows; the row blocks must add up to the rows of every parameter of the group "
          "(put parameters with other splits in their own param group)");
      int64_t offset = 0;
      for (int64_t rows : rows_) {
        out.push_back({offset, rows, shape[1]});
        offset += rows * shape[1];
      }
      return out;
    }
    case Kind::kBatched: {
      FSDP_MUON_CHECK(shape.size() == 3, "parameter ", parameter, " has shape ", c10::str(shape),
                      " but its param group's matrix_layout is batched, which "
                      "reads a 3-D [E, m, n] parameter as E matrices; put it in a param group with "
                      "MatrixLayout::whole() or row_blocks(...)");
      const int64_t numel = shape[1] * shape[2];
      for (int64_t e = 0; e < shape[0]; ++e) out.push_back({e * numel, shape[1], shape[2]});
      return out;
    }
  }
  FSDP_MUON_CHECK(false, "matrix_layout has an unknown kind ", static_cast<int>(kind_));
}

std::string MatrixLayout::to_string() const {
  switch (kind_) {
    case Kind::kWhole:
      return "whole";
    case Kind::kBatched:
      return "batched";
    case Kind::kRowBlocks: {
      std::ostringstream out;
      out << "row_blocks{";
      for (size_t i = 0; i < rows_.size(); ++i) out << (i ? ", " : "") << rows_[i];
      out << "}";
      return out.str();
    }
  }
  return "unknown";
}

}  // namespace fsdp_muon
