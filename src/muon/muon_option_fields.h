#pragma once
// MuonOptions' fields, declared once for the library's code (docs/DESIGN.md §4): one table row per
// field, {archive key, the field as MuonOptions spells it, its kind}, from which
// MuonOptions::serialize (both directions), operator==, the bounds an archive's enums are read
// within, and FsdpMuon's cross-rank agreement entries are all generated. A field added to
// MuonOptions (muon_options.h, where its TORCH_ARG carries the user docs) is added to the table in
// muon_options.cpp, and nowhere else. Internal header.

#include <functional>
#include <string>
#include <vector>

#include <fsdp_muon/muon/muon_options.h>

namespace fsdp_muon::detail {

struct MuonOptionField {
  // The key in a MuonOptions archive: part of the checkpoint format, never renamed (a checkpoint
  // written before NewtonSchulzOptions became one field stores its settings under "ns_steps",
  // "ns_dtype", "eps", ... and loads by these keys). MatrixLayout also writes `key` + "_rows".
  const char* key;
  // The field as MuonOptions spells it, dotted: "lr", "newton_schulz.steps". FsdpMuon's agreement
  // entries and the messages naming a difference use it.
  std::string name;
  std::function<void(const MuonOptions&, torch::serialize::OutputArchive&)> write;
  // Reads the key when the archive has it (a key an older version did not write keeps the
  // field's current value); an enum outside its bounds is an error naming the key.
  std::function<void(torch::serialize::InputArchive&, MuonOptions&)> read;
  std::function<bool(const MuonOptions&, const MuonOptions&)> equal;
  // The value, exact (doubles by exact_double), for the agreement.
  std::function<std::string(const MuonOptions&)> text;
  // Sets the field to a value other than its current one (a valid one from the defaults): what
  // the tests use to check that every row is written, read, compared and agreed on.
  std::function<void(MuonOptions&)> change;
};

// Every field, in the order of muon_options.h.
const std::vector<MuonOptionField>& muon_option_fields();

// "<hexfloat> (<decimal>)": exact, so a one-ulp difference between ranks shows, and readable.
std::string exact_double(double value);

}  // namespace fsdp_muon::detail
