#pragma once
// The MuonOptions that change the math, as the ranks of FsdpMuon compare them
// (docs/DESIGN.md §4, Agreement): at construction every param group's text is part of the
// description every rank must share, and each step folds a fingerprint of the texts into the
// step's agreement all-reduce, so an option changed on some ranks only (a learning-rate
// schedule stepped on one rank) is an error on every rank. A new option that changes an update
// belongs in describe_math_options, and nowhere else.

#include <cstdint>
#include <string>

#include <fsdp_muon/muon/muon_options.h>

namespace fsdp_muon::detail {

// "lr 0.02, momentum 0.95, nesterov 1, ...": every option that changes an update, doubles
// printed so that they read back exactly (%.17g).
std::string describe_math_options(const MuonOptions& options);

// A 64-bit FNV-1a hash of `text`, stable across processes and builds.
uint64_t fingerprint(const std::string& text);

}  // namespace fsdp_muon::detail
