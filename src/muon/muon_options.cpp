#include <fsdp_muon/muon/muon_options.h>

#include <cmath>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include "common/enum_names.h"
#include "muon/update_rule.h"
#include "newton_schulz/newton_schulz_internal.h"

namespace fsdp_muon {
namespace {

// Enums and the dtype travel as plain integers so an archive never depends on how a compiler
// lays out an enum; the values are the enumerator order of the public headers, which is part of
// the checkpoint format and must only ever be appended to.
template <typename Enum>
void write_enum(torch::serialize::OutputArchive& archive, const char* key, Enum value) {
  archive.write(key, c10::IValue(static_cast<int64_t>(value)));
}

template <typename Enum>
void read_enum(torch::serialize::InputArchive& archive, const char* key, Enum& value,
               int64_t count) {
  c10::IValue ivalue;
  if (!archive.try_read(key, ivalue)) {
    return;  // written by an older version: keep the default
  }
  const int64_t raw = ivalue.toInt();
  TORCH_CHECK(raw >= 0 && raw < count, "fsdp_muon::MuonOptions: archive entry '", key, "' holds ",
              raw, ", which is not a valid value (0..", count - 1,
              "); the file is corrupt or from a newer fsdp_muon");
  value = static_cast<Enum>(raw);
}

template <typename T>
void read_scalar(torch::serialize::InputArchive& archive, const char* key, T& value) {
  c10::IValue ivalue;
  if (archive.try_read(key, ivalue)) {
    value = ivalue.to<T>();
  }
}

}  // namespace

MuonOptions::MuonOptions(double lr) : lr_(lr) {}

void MuonOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("momentum", c10::IValue(momentum()));
  archive.write("nesterov", c10::IValue(nesterov()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  write_enum(archive, "weight_decay_method", weight_decay_method());
  archive.write("ns_steps", c10::IValue(newton_schulz().steps()));
  write_enum(archive, "coefficients", newton_schulz().coefficients());
  // An n x 3 float64 tensor; n = 0 means "use the preset".
  const auto& custom = newton_schulz().custom_coefficients();
  std::vector<double> flat;
  flat.reserve(3 * custom.size());
  for (const auto& tuple : custom) {
    flat.insert(flat.end(), tuple.begin(), tuple.end());
  }
  const at::Tensor table =
      at::tensor(flat, at::kDouble).reshape({static_cast<int64_t>(custom.size()), 3});
  archive.write("custom_coefficients", c10::IValue(table));
  write_enum(archive, "scale_mode", scale_mode());
  archive.write("extra_scale_factor", c10::IValue(extra_scale_factor()));
  archive.write("eps", c10::IValue(newton_schulz().eps()));
  write_enum(archive, "ns_dtype", newton_schulz().compute_dtype());
  archive.write("skip_non_matrix", c10::IValue(skip_non_matrix()));
  write_enum(archive, "ns_method", newton_schulz().method());
  archive.write("gram_restarts",
                c10::IValue(at::tensor(newton_schulz().gram_restarts(), at::kLong)));
  write_enum(archive, "ns_preconditioning", newton_schulz().preconditioning());
  write_enum(archive, "normalization", normalization());
  archive.write("normuon_beta2", c10::IValue(normuon_beta2()));
  archive.write("normuon_eps", c10::IValue(normuon_eps()));
  write_enum(archive, "matrix_layout", matrix_layout().kind());
  archive.write("matrix_layout_rows",
                c10::IValue(at::tensor(matrix_layout().block_rows(), at::kLong)));
}

void MuonOptions::serialize(torch::serialize::InputArchive& archive) {
  read_scalar(archive, "lr", lr_);
  read_scalar(archive, "momentum", momentum_);
  read_scalar(archive, "nesterov", nesterov_);
  read_scalar(archive, "weight_decay", weight_decay_);
  read_enum(archive, "weight_decay_method", weight_decay_method_, 4);
  read_scalar(archive, "ns_steps", newton_schulz_.steps());
  read_enum(archive, "coefficients", newton_schulz_.coefficients(),
            detail::ns_coefficients_count());
  c10::IValue table_value;
  if (archive.try_read("custom_coefficients", table_value)) {
    const at::Tensor table = table_value.toTensor().to(at::kDouble).contiguous();
    TORCH_CHECK(table.dim() == 2 && table.size(1) == 3,
                "fsdp_muon::MuonOptions: archive entry 'custom_coefficients' must be an n x 3 "
                "tensor, got ",
                table.sizes());
    const double* data = table.data_ptr<double>();
    newton_schulz_.custom_coefficients().assign(static_cast<size_t>(table.size(0)), {});
    for (size_t i = 0; i < newton_schulz_.custom_coefficients().size(); ++i) {
      newton_schulz_.custom_coefficients()[i] = {data[3 * i], data[3 * i + 1], data[3 * i + 2]};
    }
  }
  read_enum(archive, "scale_mode", scale_mode_, 5);
  read_scalar(archive, "extra_scale_factor", extra_scale_factor_);
  read_scalar(archive, "eps", newton_schulz_.eps());
  read_enum(archive, "ns_dtype", newton_schulz_.compute_dtype(),
            static_cast<int64_t>(c10::ScalarType::NumOptions));
  read_scalar(archive, "skip_non_matrix", skip_non_matrix_);
  read_enum(archive, "ns_method", newton_schulz_.method(), 3);
  c10::IValue restarts_value;
  if (archive.try_read("gram_restarts", restarts_value)) {
    const at::Tensor restarts = restarts_value.toTensor().to(at::kLong).contiguous();
    TORCH_CHECK(restarts.dim() == 1,
                "fsdp_muon::MuonOptions: archive entry 'gram_restarts' must be a 1-D tensor, got ",
                restarts.sizes());
    newton_schulz_.gram_restarts().assign(restarts.data_ptr<int64_t>(),
                                          restarts.data_ptr<int64_t>() + restarts.numel());
  }
  read_enum(archive, "ns_preconditioning", newton_schulz_.preconditioning(), 2);
  {
    // Any value with an update rule: the library's, or a variant registered before the load.
    c10::IValue ivalue;
    if (archive.try_read("normalization", ivalue)) {
      const auto value = static_cast<Normalization>(ivalue.toInt());
      TORCH_CHECK(detail::has_update_rule(value),
                  "fsdp_muon::MuonOptions: archive entry 'normalization' holds ", ivalue.toInt(),
                  ", which has no update rule; the file is corrupt, from a newer fsdp_muon, or "
                  "saved with a variant registered (detail::register_update_rule) that this "
                  "process has not registered");
      normalization_ = value;
    }
  }
  read_scalar(archive, "normuon_beta2", normuon_beta2_);
  read_scalar(archive, "normuon_eps", normuon_eps_);
  MatrixLayout::Kind layout_kind = matrix_layout_.kind();
  read_enum(archive, "matrix_layout", layout_kind, 3);
  std::vector<int64_t> layout_rows;
  c10::IValue rows_value;
  if (archive.try_read("matrix_layout_rows", rows_value)) {
    const at::Tensor rows = rows_value.toTensor().to(at::kLong).contiguous();
    TORCH_CHECK(rows.dim() == 1,
                "fsdp_muon::MuonOptions: archive entry 'matrix_layout_rows' must be a 1-D tensor, "
                "got ",
                rows.sizes());
    layout_rows.assign(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + rows.numel());
  }
  switch (layout_kind) {
    case MatrixLayout::Kind::kWhole:
      matrix_layout_ = MatrixLayout::whole();
      break;
    case MatrixLayout::Kind::kRowBlocks:
      matrix_layout_ = MatrixLayout::row_blocks(std::move(layout_rows));
      break;
    case MatrixLayout::Kind::kBatched:
      matrix_layout_ = MatrixLayout::batched();
      break;
  }
}

double MuonOptions::get_lr() const { return lr(); }

void MuonOptions::set_lr(const double lr) { this->lr(lr); }

void MuonOptions::validate() const {
  TORCH_CHECK(std::isfinite(lr()) && lr() >= 0, "fsdp_muon::MuonOptions: invalid lr ", lr(),
              "; use a finite learning rate >= 0, e.g. MuonOptions(0.02)");
  TORCH_CHECK(std::isfinite(weight_decay()) && weight_decay() >= 0,
              "fsdp_muon::MuonOptions: invalid weight_decay ", weight_decay(),
              "; use a finite value >= 0 (0 disables weight decay)");
  TORCH_CHECK(momentum() >= 0 && momentum() < 1, "fsdp_muon::MuonOptions: invalid momentum ",
              momentum(), "; momentum must lie in [0, 1), e.g. .momentum(0.95)");
  const NewtonSchulzOptions& ns = newton_schulz();
  TORCH_CHECK(ns.steps() >= 1, "fsdp_muon::MuonOptions: invalid newton_schulz().steps() ",
              ns.steps(),
              "; Newton-Schulz needs at least 1 step, e.g. "
              ".newton_schulz(NewtonSchulzOptions().steps(5))");
  TORCH_CHECK(ns.eps() > 0 && ns.eps() <= detail::kLargestEps,
              "fsdp_muon::MuonOptions: invalid newton_schulz().eps() ", ns.eps(),
              "; eps must be a finite value > 0 and at most ", detail::kLargestEps,
              " (bf16's largest; it clamps the Frobenius norm), e.g. "
              ".newton_schulz(NewtonSchulzOptions().eps(1e-7))");
  TORCH_CHECK(ns.compute_dtype() == at::kBFloat16 || ns.compute_dtype() == at::kFloat,
              "fsdp_muon::MuonOptions: invalid newton_schulz().compute_dtype() ",
              c10::toString(ns.compute_dtype()),
              "; Newton-Schulz computes in bf16 or fp32: use "
              ".newton_schulz(NewtonSchulzOptions().compute_dtype(at::kBFloat16)) or "
              "compute_dtype(at::kFloat)");
  TORCH_CHECK(std::isfinite(extra_scale_factor()),
              "fsdp_muon::MuonOptions: invalid extra_scale_factor ", extra_scale_factor(),
              "; use a finite factor, e.g. .extra_scale_factor(1.0)");
  detail::update_rule(normalization());  // an unknown value is an error naming it
  TORCH_CHECK(normuon_beta2() >= 0 && normuon_beta2() < 1,
              "fsdp_muon::MuonOptions: invalid normuon_beta2 ", normuon_beta2(),
              "; NorMuon's second-moment decay must lie in [0, 1), e.g. .normuon_beta2(0.95)");
  TORCH_CHECK(normuon_eps() > 0 && normuon_eps() <= detail::kLargestEps,
              "fsdp_muon::MuonOptions: invalid normuon_eps ", normuon_eps(),
              "; it guards NorMuon's divisions and must be a finite value > 0 and at most ",
              detail::kLargestEps, " (bf16's largest), e.g. .normuon_eps(1e-8)");
  matrix_layout().validate("fsdp_muon::MuonOptions: ");
  // Coefficient problems (cubic5 with a step count other than 5, non-finite custom tuples) are
  // checked where the schedule is built, with messages naming the option.
  (void)detail::newton_schulz_schedule(ns, "fsdp_muon::MuonOptions", "newton_schulz().");
}

bool operator==(const MuonOptions& lhs, const MuonOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.momentum() == rhs.momentum() &&
         lhs.nesterov() == rhs.nesterov() && lhs.weight_decay() == rhs.weight_decay() &&
         lhs.weight_decay_method() == rhs.weight_decay_method() &&
         lhs.newton_schulz().steps() == rhs.newton_schulz().steps() &&
         lhs.newton_schulz().coefficients() == rhs.newton_schulz().coefficients() &&
         lhs.newton_schulz().custom_coefficients() == rhs.newton_schulz().custom_coefficients() &&
         lhs.scale_mode() == rhs.scale_mode() &&
         lhs.extra_scale_factor() == rhs.extra_scale_factor() &&
         lhs.newton_schulz().eps() == rhs.newton_schulz().eps() &&
         lhs.newton_schulz().compute_dtype() == rhs.newton_schulz().compute_dtype() &&
         lhs.skip_non_matrix() == rhs.skip_non_matrix() &&
         lhs.newton_schulz().method() == rhs.newton_schulz().method() &&
         lhs.newton_schulz().gram_restarts() == rhs.newton_schulz().gram_restarts() &&
         lhs.newton_schulz().preconditioning() == rhs.newton_schulz().preconditioning() &&
         lhs.normalization() == rhs.normalization() && lhs.normuon_beta2() == rhs.normuon_beta2() &&
         lhs.normuon_eps() == rhs.normuon_eps() && lhs.matrix_layout() == rhs.matrix_layout();
}

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

}  // namespace

const char* to_string(ScaleMode mode) { return detail::name_of(kScaleModeNames, mode); }

const char* to_string(WeightDecayMethod method) {
  return detail::name_of(kWeightDecayNames, method);
}

// The update rule's name (update_rule.h: the library's table, or a registered variant).
const char* to_string(Normalization normalization) {
  return detail::update_rule(normalization).name.c_str();
}

}  // namespace fsdp_muon
