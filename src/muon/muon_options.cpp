#include <fsdp_muon/muon/muon_options.h>

#include <cmath>
#include <iterator>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include "common/check.h"
#include "common/enum_names.h"
#include "muon/muon_option_fields.h"
#include "muon/update_rule.h"
#include "newton_schulz/newton_schulz_internal.h"

namespace fsdp_muon {
namespace {

constexpr detail::EnumName<ScaleMode> kScaleModeNames[] = {
    {ScaleMode::kSpectral, "spectral"},
    {ScaleMode::kShapeScaling, "shape_scaling"},
    {ScaleMode::kUnitRmsNorm, "unit_rms_norm"},
    {ScaleMode::kMatchRmsAdamW, "match_rms_adamw"},
    {ScaleMode::kNone, "none"},
};
static_assert(detail::rows_in_enumerator_order(kScaleModeNames));

constexpr detail::EnumName<WeightDecayMethod> kWeightDecayNames[] = {
    {WeightDecayMethod::kDecoupled, "decoupled"},
    {WeightDecayMethod::kIndependent, "independent"},
    {WeightDecayMethod::kL2, "l2"},
    {WeightDecayMethod::kPalm, "palm"},
};
static_assert(detail::rows_in_enumerator_order(kWeightDecayNames));

template <typename T, size_t N>
constexpr int64_t count_of(const T (&)[N]) {
  return static_cast<int64_t>(N);
}

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// ---- the kinds of field: how a value is written, read, shown and changed ----
// Enums and the dtype travel as plain integers so an archive never depends on how a compiler
// lays out an enum; the values are the enumerator order of the public headers, which is part of
// the checkpoint format and must only ever be appended to.

template <typename T>
bool try_read(InputArchive& archive, const char* key, T& value) {
  c10::IValue ivalue;
  if (!archive.try_read(key, ivalue)) return false;  // an older version's archive: keep it
  value = ivalue.to<T>();
  return true;
}

// A 1-D int64 tensor as a vector.
bool try_read_indices(InputArchive& archive, const char* key, std::vector<int64_t>& value) {
  c10::IValue ivalue;
  if (!archive.try_read(key, ivalue)) return false;
  const at::Tensor t = ivalue.toTensor().to(at::kLong).contiguous();
  FSDP_MUON_CHECK(t.dim() == 1, "archive entry '", key, "' must be a 1-D tensor, got ", t.sizes());
  value.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  return true;
}

struct Real {
  void write(OutputArchive& a, const char* key, double v) const { a.write(key, c10::IValue(v)); }
  void read(InputArchive& a, const char* key, double& v) const { try_read(a, key, v); }
  std::string text(double v) const { return detail::exact_double(v); }
  void change(double& v) const { v = std::nextafter(v, std::numeric_limits<double>::infinity()); }
};

struct Flag {
  void write(OutputArchive& a, const char* key, bool v) const { a.write(key, c10::IValue(v)); }
  void read(InputArchive& a, const char* key, bool& v) const { try_read(a, key, v); }
  std::string text(bool v) const { return v ? "true" : "false"; }
  void change(bool& v) const { v = !v; }
};

struct Count {
  void write(OutputArchive& a, const char* key, int64_t v) const { a.write(key, c10::IValue(v)); }
  void read(InputArchive& a, const char* key, int64_t& v) const { try_read(a, key, v); }
  std::string text(int64_t v) const { return std::to_string(v); }
  void change(int64_t& v) const { ++v; }
};

// An enum of `count` values 0 .. count - 1; to_string names them.
template <typename Enum>
struct Enumerated {
  int64_t count;
  void write(OutputArchive& a, const char* key, Enum v) const {
    a.write(key, c10::IValue(static_cast<int64_t>(v)));
  }
  void read(InputArchive& a, const char* key, Enum& v) const {
    int64_t raw = 0;
    if (!try_read(a, key, raw)) return;
    FSDP_MUON_CHECK(raw >= 0 && raw < count, "archive entry '", key, "' holds ", raw,
                    ", which is not a valid value (0..", count - 1,
                    "); the file is corrupt or from a newer fsdp_muon");
    v = static_cast<Enum>(raw);
  }
  std::string text(Enum v) const { return to_string(v); }
  void change(Enum& v) const { v = static_cast<Enum>((static_cast<int64_t>(v) + 1) % count); }
};

struct Dtype {
  Enumerated<c10::ScalarType> bounds{static_cast<int64_t>(c10::ScalarType::NumOptions)};
  void write(OutputArchive& a, const char* key, c10::ScalarType v) const {
    bounds.write(a, key, v);
  }
  void read(InputArchive& a, const char* key, c10::ScalarType& v) const { bounds.read(a, key, v); }
  std::string text(c10::ScalarType v) const { return c10::toString(v); }
  void change(c10::ScalarType& v) const { v = v == at::kBFloat16 ? at::kFloat : at::kBFloat16; }
};

// The update rule: any value with one, the library's or a variant registered before the load.
struct Rule {
  void write(OutputArchive& a, const char* key, Normalization v) const {
    a.write(key, c10::IValue(static_cast<int64_t>(v)));
  }
  void read(InputArchive& a, const char* key, Normalization& v) const {
    int64_t raw = 0;
    if (!try_read(a, key, raw)) return;
    FSDP_MUON_CHECK(detail::has_update_rule(static_cast<Normalization>(raw)), "archive entry '",
                    key, "' holds ", raw,
                    ", which has no update rule; the file is corrupt, from a newer fsdp_muon, or "
                    "saved with a variant registered (detail::register_update_rule) that this "
                    "process has not registered");
    v = static_cast<Normalization>(raw);
  }
  std::string text(Normalization v) const { return to_string(v); }
  void change(Normalization& v) const {
    v = v == Normalization::kNone ? Normalization::kNorMuon : Normalization::kNone;
  }
};

// (a, b, c) tuples: an n x 3 float64 tensor; n = 0 means "use the preset".
struct Tuples {
  void write(OutputArchive& a, const char* key, const NsCoefficientList& v) const {
    std::vector<double> flat;
    flat.reserve(3 * v.size());
    for (const auto& tuple : v) flat.insert(flat.end(), tuple.begin(), tuple.end());
    a.write(key, c10::IValue(
                     at::tensor(flat, at::kDouble).reshape({static_cast<int64_t>(v.size()), 3})));
  }
  void read(InputArchive& a, const char* key, NsCoefficientList& v) const {
    c10::IValue ivalue;
    if (!a.try_read(key, ivalue)) return;
    const at::Tensor table = ivalue.toTensor().to(at::kDouble).contiguous();
    FSDP_MUON_CHECK(table.dim() == 2 && table.size(1) == 3, "archive entry '", key,
                    "' must be an n x 3 tensor, got ", table.sizes());
    const double* data = table.data_ptr<double>();
    v.assign(static_cast<size_t>(table.size(0)), {});
    for (size_t i = 0; i < v.size(); ++i) v[i] = {data[3 * i], data[3 * i + 1], data[3 * i + 2]};
  }
  std::string text(const NsCoefficientList& v) const {
    std::ostringstream out;
    out << "{";
    for (size_t i = 0; i < v.size(); ++i) {
      out << (i ? ", " : "") << "(" << std::hexfloat << v[i][0] << ", " << v[i][1] << ", "
          << v[i][2] << ")";
    }
    out << "}";
    return out.str();
  }
  void change(NsCoefficientList& v) const { v.push_back({2.0, -1.5, 0.5}); }
};

// Iteration indices: a 1-D int64 tensor.
struct Indices {
  void write(OutputArchive& a, const char* key, const NsRestartList& v) const {
    a.write(key, c10::IValue(at::tensor(v, at::kLong)));
  }
  void read(InputArchive& a, const char* key, NsRestartList& v) const {
    try_read_indices(a, key, v);
  }
  std::string text(const NsRestartList& v) const {
    std::string out = "{";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + "}";
  }
  void change(NsRestartList& v) const { v.push_back(v.empty() ? 1 : v.back() + 1); }
};

// The layout's kind under `key`, its block rows under `key` + "_rows".
struct Layout {
  Enumerated<MatrixLayout::Kind> kinds{3};  // kWhole, kRowBlocks, kBatched
  void write(OutputArchive& a, const char* key, const MatrixLayout& v) const {
    kinds.write(a, key, v.kind());
    a.write(std::string(key) + "_rows", c10::IValue(at::tensor(v.block_rows(), at::kLong)));
  }
  void read(InputArchive& a, const char* key, MatrixLayout& v) const {
    MatrixLayout::Kind kind = v.kind();
    kinds.read(a, key, kind);
    std::vector<int64_t> rows;
    try_read_indices(a, (std::string(key) + "_rows").c_str(), rows);
    switch (kind) {
      case MatrixLayout::Kind::kWhole:
        v = MatrixLayout::whole();
        break;
      case MatrixLayout::Kind::kRowBlocks:
        v = MatrixLayout::row_blocks(std::move(rows));
        break;
      case MatrixLayout::Kind::kBatched:
        v = MatrixLayout::batched();
        break;
    }
  }
  std::string text(const MatrixLayout& v) const { return v.to_string(); }
  void change(MatrixLayout& v) const {
    switch (v.kind()) {
      case MatrixLayout::Kind::kWhole:
        v = MatrixLayout::row_blocks({2, 3});
        break;
      case MatrixLayout::Kind::kRowBlocks:
        v = MatrixLayout::batched();
        break;
      case MatrixLayout::Kind::kBatched:
        v = MatrixLayout::whole();
        break;
    }
  }
};

// "newton_schulz().steps()" -> "newton_schulz.steps".
std::string dotted(std::string spelled) {
  for (size_t at; (at = spelled.find("()")) != std::string::npos;) spelled.erase(at, 2);
  return spelled;
}

// One row: `get` returns the field of a MuonOptions, const or not.
template <typename Kind, typename Get>
detail::MuonOptionField row(const char* key, const char* spelled, Kind kind, Get get) {
  detail::MuonOptionField field;
  field.key = key;
  field.name = dotted(spelled);
  field.write = [=](const MuonOptions& o, OutputArchive& a) { kind.write(a, key, get(o)); };
  field.read = [=](InputArchive& a, MuonOptions& o) { kind.read(a, key, get(o)); };
  field.equal = [=](const MuonOptions& l, const MuonOptions& r) { return get(l) == get(r); };
  field.text = [=](const MuonOptions& o) { return kind.text(get(o)); };
  field.change = [=](MuonOptions& o) { kind.change(get(o)); };
  return field;
}

// {archive key, kind, the field as MuonOptions spells it}.
#define FSDP_MUON_FIELD(key, kind, path) \
  row(                                   \
      key, #path, kind, [](auto& o) -> auto& { return o.path; })

std::vector<detail::MuonOptionField> make_fields() {
  const auto methods = detail::newton_schulz_method_count();
  const auto preconditionings = detail::newton_schulz_preconditioning_count();
  return {
      FSDP_MUON_FIELD("lr", Real{}, lr()),
      FSDP_MUON_FIELD("momentum", Real{}, momentum()),
      FSDP_MUON_FIELD("nesterov", Flag{}, nesterov()),
      FSDP_MUON_FIELD("weight_decay", Real{}, weight_decay()),
      FSDP_MUON_FIELD("weight_decay_method",
                      Enumerated<WeightDecayMethod>{count_of(kWeightDecayNames)},
                      weight_decay_method()),
      // NewtonSchulzOptions, under the keys MuonOptions wrote before it was one field.
      FSDP_MUON_FIELD("ns_steps", Count{}, newton_schulz().steps()),
      FSDP_MUON_FIELD("coefficients", Enumerated<NsCoefficients>{detail::ns_coefficients_count()},
                      newton_schulz().coefficients()),
      FSDP_MUON_FIELD("custom_coefficients", Tuples{}, newton_schulz().custom_coefficients()),
      FSDP_MUON_FIELD("eps", Real{}, newton_schulz().eps()),
      FSDP_MUON_FIELD("ns_dtype", Dtype{}, newton_schulz().compute_dtype()),
      FSDP_MUON_FIELD("ns_method", Enumerated<NsMethod>{methods}, newton_schulz().method()),
      FSDP_MUON_FIELD("gram_restarts", Indices{}, newton_schulz().gram_restarts()),
      FSDP_MUON_FIELD("ns_preconditioning", Enumerated<NsPreconditioning>{preconditionings},
                      newton_schulz().preconditioning()),
      FSDP_MUON_FIELD("scale_mode", Enumerated<ScaleMode>{count_of(kScaleModeNames)}, scale_mode()),
      FSDP_MUON_FIELD("extra_scale_factor", Real{}, extra_scale_factor()),
      FSDP_MUON_FIELD("skip_non_matrix", Flag{}, skip_non_matrix()),
      FSDP_MUON_FIELD("normalization", Rule{}, normalization()),
      FSDP_MUON_FIELD("normuon_beta2", Real{}, normuon_beta2()),
      FSDP_MUON_FIELD("normuon_eps", Real{}, normuon_eps()),
      FSDP_MUON_FIELD("matrix_layout", Layout{}, matrix_layout()),
  };
}

#undef FSDP_MUON_FIELD

}  // namespace

const std::vector<detail::MuonOptionField>& detail::muon_option_fields() {
  static const std::vector<MuonOptionField> fields = make_fields();
  return fields;
}

std::string detail::exact_double(double value) {
  std::ostringstream out;
  out << std::hexfloat << value << std::defaultfloat << " (" << value << ")";
  return out.str();
}

MuonOptions::MuonOptions(double lr) : lr_(lr) {}

void MuonOptions::serialize(torch::serialize::OutputArchive& archive) const {
  for (const auto& field : detail::muon_option_fields()) field.write(*this, archive);
}

void MuonOptions::serialize(torch::serialize::InputArchive& archive) {
  FSDP_MUON_API_SCOPE("MuonOptions");
  for (const auto& field : detail::muon_option_fields()) field.read(archive, *this);
}

bool operator==(const MuonOptions& lhs, const MuonOptions& rhs) {
  for (const auto& field : detail::muon_option_fields()) {
    if (!field.equal(lhs, rhs)) return false;
  }
  return true;
}

double MuonOptions::get_lr() const { return lr(); }

void MuonOptions::set_lr(const double lr) { this->lr(lr); }

void MuonOptions::validate() const {
  FSDP_MUON_API_SCOPE("MuonOptions");
  FSDP_MUON_CHECK(std::isfinite(lr()) && lr() >= 0, "invalid lr ", lr(),
                  "; use a finite learning rate >= 0, e.g. MuonOptions(0.02)");
  FSDP_MUON_CHECK(std::isfinite(weight_decay()) && weight_decay() >= 0, "invalid weight_decay ",
                  weight_decay(), "; use a finite value >= 0 (0 disables weight decay)");
  FSDP_MUON_CHECK(momentum() >= 0 && momentum() < 1, "invalid momentum ", momentum(),
                  "; momentum must lie in [0, 1), e.g. .momentum(0.95)");
  const NewtonSchulzOptions& ns = newton_schulz();
  FSDP_MUON_CHECK(ns.steps() >= 1, "invalid newton_schulz().steps() ", ns.steps(),
                  "; Newton-Schulz needs at least 1 step, e.g. "
                  ".newton_schulz(NewtonSchulzOptions().steps(5))");
  FSDP_MUON_CHECK(ns.eps() > 0 && ns.eps() <= detail::kLargestEps, "invalid newton_schulz().eps() ",
                  ns.eps(), "; eps must be a finite value > 0 and at most ", detail::kLargestEps,
                  " (bf16's largest; it clamps the Frobenius norm), e.g. "
                  ".newton_schulz(NewtonSchulzOptions().eps(1e-7))");
  FSDP_MUON_CHECK(ns.compute_dtype() == at::kBFloat16 || ns.compute_dtype() == at::kFloat,
                  "invalid newton_schulz().compute_dtype() ", c10::toString(ns.compute_dtype()),
                  "; Newton-Schulz computes in bf16 or fp32: use "
                  ".newton_schulz(NewtonSchulzOptions().compute_dtype(at::kBFloat16)) or "
                  "compute_dtype(at::kFloat)");
  FSDP_MUON_CHECK(std::isfinite(extra_scale_factor()), "invalid extra_scale_factor ",
                  extra_scale_factor(), "; use a finite factor, e.g. .extra_scale_factor(1.0)");
  detail::update_rule(normalization());  // an unknown value is an error naming it
  FSDP_MUON_CHECK(normuon_beta2() >= 0 && normuon_beta2() < 1, "invalid normuon_beta2 ",
                  normuon_beta2(),
                  "; NorMuon's second-moment decay must lie in [0, 1), e.g. .normuon_beta2(0.95)");
  FSDP_MUON_CHECK(normuon_eps() > 0 && normuon_eps() <= detail::kLargestEps, "invalid normuon_eps ",
                  normuon_eps(),
                  "; it guards NorMuon's divisions and must be a finite value > 0 and at most ",
                  detail::kLargestEps, " (bf16's largest), e.g. .normuon_eps(1e-8)");
  matrix_layout().validate();
  // Coefficient problems (cubic5 with a step count other than 5, non-finite custom tuples) are
  // checked where the schedule is built, with messages naming the option.
  (void)detail::newton_schulz_schedule(ns, "newton_schulz().");
}

const char* to_string(ScaleMode mode) { return detail::name_of(kScaleModeNames, mode); }

const char* to_string(WeightDecayMethod method) {
  return detail::name_of(kWeightDecayNames, method);
}

// The update rule's name (update_rule.h: the library's table, or a registered variant).
const char* to_string(Normalization normalization) {
  return detail::update_rule(normalization).name.c_str();
}

}  // namespace fsdp_muon
