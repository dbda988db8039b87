// FsdpMuon's construction: every parameter checked, the matrices planned, the ranks agreed on
// what they built (docs/DESIGN.md §3, §5). The step is in fsdp_muon_step.cpp.
#include <fsdp_muon/optimizer/fsdp_muon.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include "comm/agreement.h"
#include "common/check.h"
#include "common/enum_names.h"
#include "fsdp/group_agreement.h"
#include "muon/update_rule.h"
#include "newton_schulz/newton_schulz_internal.h"
#include "optimizer/fsdp_muon_impl.h"

namespace fsdp_muon {
namespace detail {

MuonOptions& muon_options_of(torch::optim::OptimizerParamGroup& group, size_t index) {
  auto* options = dynamic_cast<MuonOptions*>(&group.options());
  FSDP_MUON_CHECK(options != nullptr, "parameter group ", index,
                  " has options of another optimizer; give it fsdp_muon::MuonOptions");
  return *options;
}

std::vector<std::pair<std::string, std::string>> option_entries(const MuonOptions& o) {
  std::vector<std::pair<std::string, std::string>> entries;
  for (const MuonOptionField& field : muon_option_fields()) {
    entries.emplace_back(field.name, field.text(o));
  }
  return entries;
}

}  // namespace detail
namespace {

using detail::AcceptedMatrix;

// The mesh a group is sharded on.
const DeviceMesh& mesh_of(const FsdpParameterGroup& group) { return group.mesh(); }
using detail::ExchangeLayout;
using detail::MatrixPlacement;
using detail::muon_options_of;

std::string group_label(const FsdpParameterGroup& group, size_t ordinal) {
  return group.name().empty() ? "#" + std::to_string(ordinal) : "'" + group.name() + "'";
}

std::string abbreviate(const std::string& text) {
  constexpr size_t kMax = 2000;
  return text.size() <= kMax ? text : text.substr(0, kMax) + " ...";
}

std::string abbreviate_lines(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& line : lines) text += "\n  " + line;
  return abbreviate(text);
}

std::string join(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

// The world communicator of the first sharded parameter's mesh: the one every rank agrees
// through, whatever meshes the other parameters are on (that is checked inside the agreement).
std::shared_ptr<Communicator> world_of(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups) {
  for (const auto& group : param_groups) {
    for (const at::Tensor& p : group.params()) {
      if (auto info = find_sharded_parameter(p)) return mesh_of(*info->group).world;
    }
  }
  return nullptr;
}

constexpr detail::EnumName<NewtonSchulzBatching> kBatchingNames[] = {
    {NewtonSchulzBatching::kWhereBitwise, "where_bitwise"},
    {NewtonSchulzBatching::kAlways, "always"},
    {NewtonSchulzBatching::kNever, "never"},
    {NewtonSchulzBatching::kAuto, "auto"},
};
static_assert(detail::rows_in_enumerator_order(kBatchingNames));

}  // namespace

const char* to_string(NewtonSchulzBatching mode) { return detail::name_of(kBatchingNames, mode); }

bool detail::batches_newton_schulz(NewtonSchulzBatching mode, const c10::Device& device,
                                   c10::ScalarType compute_dtype, MatrixLayout::Kind layout) {
  switch (mode) {
    case NewtonSchulzBatching::kAlways:
      return true;
    case NewtonSchulzBatching::kNever:
      return false;
    case NewtonSchulzBatching::kWhereBitwise:
      return detail::batched_newton_schulz_is_bitwise(device, compute_dtype);
    case NewtonSchulzBatching::kAuto:
      return detail::batched_newton_schulz_is_bitwise(device, compute_dtype) ||
             (device.is_cuda() && layout == MatrixLayout::Kind::kBatched);
  }
  FSDP_MUON_CHECK(false, "batch_newton_schulz has an unknown value ", static_cast<int>(mode));
}

FsdpMuon::FsdpMuon(std::vector<at::Tensor> sharded_params, MuonOptions defaults,
                   FsdpMuonConfig config)
    : FsdpMuon(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                   std::move(sharded_params))},
               std::move(defaults), std::move(config)) {}

FsdpMuon::FsdpMuon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                   MuonOptions defaults, FsdpMuonConfig config)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                std::make_unique<MuonOptions>(defaults)),
      impl_(std::make_unique<Impl>()) {
  FSDP_MUON_API_SCOPE("FsdpMuon");
  impl_->config = std::move(config);
  const auto construct = [&] {
    defaults.validate();
    FSDP_MUON_CHECK(impl_->config.planner().prefetch_budget_bytes() >= 0,
                    "planner().prefetch_budget_bytes() must be >= 0, got ",
                    impl_->config.planner().prefetch_budget_bytes(),
                    " (kUnlimitedPrefetch for no limit)");
    FSDP_MUON_CHECK(
        impl_->config.check_gradient_agreement() ||
            impl_->config.non_finite_gradients() == NonFiniteGradients::kIgnore,
        "non_finite_gradients(", to_string(impl_->config.non_finite_gradients()),
        ") needs check_gradient_agreement(true): the ranks learn of a NaN or Inf through "
        "its all-reduce. With check_gradient_agreement(false) also set "
        "non_finite_gradients(NonFiniteGradients::kIgnore) (kSkipStep is the default)");
    FSDP_MUON_CHECK(impl_->config.check_replicas_every() >= 0,
                    "check_replicas_every must be >= 0 (0: never), got ",
                    impl_->config.check_replicas_every());
    FSDP_MUON_CHECK(
        impl_->config.check_replicas_every() == 0 || impl_->config.check_gradient_agreement(),
        "check_replicas_every(", impl_->config.check_replicas_every(),
        ") needs check_gradient_agreement(true): the replicas' hashes ride in its "
        "all-reduce");
    for (const auto& group : param_groups) add_group(group);
    build();
  };
  const std::shared_ptr<Communicator> comm = world_of(param_groups);
  if (!comm) {
    // Nobody to agree with: fail here with the most specific message there is.
    construct();
    FSDP_MUON_CHECK(false, "no parameters given");
  }
  // docs/DESIGN.md §7: the cost model's rates measured before anything is planned (collective
  // over the groups' mesh; every rank first agrees that it measures).
  impl_->measured = detail::calibrate(param_groups, defaults, impl_->config);
  // Every rank takes part in both exchanges, so a rank that fails makes all fail, none hang.
  detail::run_agreed(*comm, construct);
  // Then the ranks compare everything that changes who computes what or the result: one 8-byte
  // all-gather, and only when some rank differs the descriptions themselves, to name the first
  // difference (docs/DESIGN.md §3).
  const std::vector<std::string> description = impl_->describe_parameters(*this);
  const std::string text = detail::join_lines(description);
  const std::vector<int> differ = detail::ranks_that_differ(*comm, text);
  if (!differ.empty()) {
    const std::vector<std::string> texts = detail::gather_descriptions(*comm, text);
    const int r = differ.front();
    FSDP_MUON_CHECK(
        false, "the ranks constructed different optimizers (rank(s) ", join(differ),
        " differ from rank 0; this is rank ", comm->rank(), " of ", comm->size(),
        "); first difference, ",
        detail::first_different_entry(detail::split_lines(texts[0]), detail::split_lines(texts[r]),
                                      r),
        ". Every rank must construct FsdpMuon with the same sharded parameters in the same "
        "order, the same MuonOptions per parameter group (bit for bit: each rank would "
        "otherwise compute its own update) and the same FsdpMuonConfig. This rank has:",
        abbreviate_lines(description));
  }
}

FsdpMuon::~FsdpMuon() = default;

void FsdpMuon::add_group(const torch::optim::OptimizerParamGroup& param_group) {
  const size_t index = param_groups_.size();
  for (size_t i = 0; i < param_group.params().size(); ++i) {
    FSDP_MUON_CHECK(param_group.params()[i].defined(), "parameter ", i, " of group ", index,
                    " is an undefined tensor");
  }
  Optimizer::add_param_group(param_group);
  // LibTorch versions differ in what the base class does with options of optimizer types it
  // does not know; the group keeps its own.
  if (param_group.has_options()) param_groups_.back().set_options(param_group.options().clone());
  muon_options_of(param_groups_.back(), index).validate();
}

void FsdpMuon::add_param_group(const torch::optim::OptimizerParamGroup& /*param_group*/) {
  FSDP_MUON_API_SCOPE("FsdpMuon");
  FSDP_MUON_CHECK(
      false,
      "add_param_group after construction is not supported: the "
      "owner plan covers the fixed set of parameters given to the constructor. Construct "
      "a new FsdpMuon with all parameter groups instead");
}

void FsdpMuon::build() { impl_->plan_matrices(*this, impl_->accept_parameters(*this)); }

// Checks every parameter given and collects the FSDP groups (in first-use order) and the
// parameters that are matrices under their layout. Under MatrixLayout::whole() non-2-D ones are
// an error unless skip_non_matrix, then a warning on rank 0; a layout that does not fit the
// parameter's shape is always an error.
std::vector<AcceptedMatrix> FsdpMuon::Impl::accept_parameters(FsdpMuon& self) {
  std::unordered_map<const FsdpParameterGroup*, size_t> ordinal_of;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  std::ostringstream non_matrix;
  int64_t non_matrix_count = 0;
  std::ostringstream skipped;
  std::vector<AcceptedMatrix> accepted;
  for (size_t gi = 0; gi < self.param_groups_.size(); ++gi) {
    const MuonOptions& options = muon_options_of(self.param_groups_[gi], gi);
    const auto& params = self.param_groups_[gi].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      auto info = find_sharded_parameter(p);
      FSDP_MUON_CHECK(
          info.has_value(), "parameter ", i, " of parameter group ", gi, " (shape ", p.sizes(),
          ") is not a sharded parameter of a live FsdpParameterGroup. Give FsdpMuon the "
          "tensors from group->sharded_parameters() (see shard_module()), not the "
          "module's own parameters, and keep the groups alive (held by std::shared_ptr)");
      const FsdpParameterGroup& group = *info->group;
      const ParameterSlot& slot = info->slot();
      auto [it, inserted] = seen.emplace(p.unsafeGetTensorImpl(), gi);
      FSDP_MUON_CHECK(inserted, "parameter '", slot.name, "' is given twice (parameter groups ",
                      it->second, " and ", gi, "); give each parameter to one group only");
      auto found = ordinal_of.find(&group);
      if (found == ordinal_of.end()) {
        if (!groups.empty()) {
          // The same on every rank (every rank gives the same parameters, on meshes of the same
          // shapes), so every rank fails here, and the agreement around construction makes
          // any rank that did not fail too.
          const FsdpParameterGroup& first = *groups.front();
          FSDP_MUON_CHECK(mesh_of(group).same_as(mesh_of(first)), "FSDP groups ",
                          group_label(first, 0), " (mesh ", mesh_of(first).shape(), ") and ",
                          group_label(group, groups.size()), " (parameter '", slot.name, "', mesh ",
                          mesh_of(group).shape(),
                          ") are on different meshes (their world or shard communicators are "
                          "different objects); FsdpMuon updates the groups of one mesh, so build "
                          "every group on the same DeviceMesh (or the same Communicator)");
        }
        found = ordinal_of.emplace(&group, groups.size()).first;
        groups.push_back(info->group);
      }
      const MatrixLayout& layout = options.matrix_layout();
      if (layout.kind() == MatrixLayout::Kind::kWhole && slot.shape.size() != 2) {
        std::ostringstream& list = options.skip_non_matrix() ? skipped : non_matrix;
        if (list.tellp() > 0) list << ", ";
        list << "'" << slot.name << "' " << c10::str(c10::IntArrayRef(slot.shape));
        if (slot.shape.size() == 3)
          list << " (3-D: MatrixLayout::batched() reads it as E matrices)";
        if (!options.skip_non_matrix()) ++non_matrix_count;
        continue;
      }
      // A layout that does not fit the shape is an error whatever skip_non_matrix says.
      (void)layout.blocks(slot.shape, "'" + slot.name + "'");
      accepted.push_back({found->second, info->index, gi, p});
    }
  }
  FSDP_MUON_CHECK(non_matrix_count == 0, "only 2-D parameters can be orthogonalized, but ",
                  non_matrix_count, " are not: ", non_matrix.str(),
                  ". Give biases, norms and embeddings to torch::optim::AdamW, or set "
                  "MuonOptions().skip_non_matrix(true) to leave them untouched");
  FSDP_MUON_CHECK(!groups.empty(), "no parameters given");
  mesh = mesh_of(*groups.front());
  world_comm = mesh.world;
  shard_comm = mesh.shard;
  shard_size = mesh.shard_size();
  exchange_comm = shard_comm;  // until the plan says whether owners span the replicas
  // Exchange ranks are read as replica * shard_size + shard rank (docs/DESIGN.md §3).
  FSDP_MUON_CHECK(world_comm->rank() == mesh.world_rank(mesh.replica(), shard_comm->rank()) &&
                      world_comm->size() == mesh.replicas() * shard_size,
                  "mesh ", mesh.shape(), " is not replica-major (world rank ", world_comm->rank(),
                  " is shard rank ", shard_comm->rank(), " of replica ", mesh.replica(),
                  "); build it with make_device_mesh()");
  if (skipped.tellp() > 0 && world_comm->rank() == 0) {
    FSDP_MUON_WARN("skip_non_matrix is set, so these non-2-D parameters are ",
                   "never updated by FsdpMuon (give them to torch::optim::AdamW): ", skipped.str());
  }
  return accepted;
}

// Puts the matrices in the order every rank plans, packs and exchanges in (group order, then
// parameter order inside each group), plans their owners and freezes the parameter groups.
void FsdpMuon::Impl::plan_matrices(FsdpMuon& self, std::vector<AcceptedMatrix> accepted) {
  std::stable_sort(
      accepted.begin(), accepted.end(), [](const AcceptedMatrix& a, const AcceptedMatrix& b) {
        return std::make_pair(a.group_ordinal, a.index) < std::make_pair(b.group_ordinal, b.index);
      });
  std::vector<PlanGroup> plan_groups(groups.size());
  group_matrices.assign(groups.size(), {});
  std::vector<std::vector<MatrixPlacement>> placement(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    plan_groups[g].name = groups[g]->name();
    plan_groups[g].element_bytes = static_cast<int64_t>(c10::elementSize(groups[g]->main_dtype()));
  }
  for (const AcceptedMatrix& a : accepted) {
    const FsdpParameterGroup& group = *groups[a.group_ordinal];
    const ParameterSlot& slot = group.slot(a.index);
    if (slot.numel == 0) continue;  // nothing to orthogonalize
    const MuonOptions& options = muon_options_of(self.param_groups_[a.param_group], a.param_group);
    const std::vector<MatrixBlock> blocks =
        options.matrix_layout().blocks(slot.shape, "'" + slot.name + "'");
    const std::pair<int64_t, int64_t> mine = group.held_range(a.index, shard_rank());
    for (size_t b = 0; b < blocks.size(); ++b) {
      const MatrixBlock& block = blocks[b];
      if (block.numel() == 0) continue;  // a batched [E, 0, n] parameter
      FsdpMuonMatrix m;
      m.group = groups[a.group_ordinal];
      m.group_ordinal = a.group_ordinal;
      m.index = a.index;
      m.param_group = a.param_group;
      m.sharded_parameter = a.param;
      m.name = blocks.size() == 1 && options.matrix_layout().kind() == MatrixLayout::Kind::kWhole
                   ? slot.name
                   : slot.name + "[" + std::to_string(b) + "]";
      m.rows = block.rows;
      m.cols = block.cols;
      m.block = b;
      m.blocks = blocks.size();
      m.offset = block.offset;
      PlanMatrix pm;
      pm.name = m.name;
      pm.rows = m.rows;
      pm.cols = m.cols;
      pm.newton_schulz = options.newton_schulz();
      pm.per_row_state = detail::update_rule(options).per_row_state;
      // docs/DESIGN.md §3, "Layouts": a block is a contiguous element range of its parameter, so
      // what each rank holds of it is the parameter's held range clipped to the block; the
      // clipped ranges still tile the block in rank order.
      const int64_t end = block.offset + block.numel();
      const auto clip = [&](int64_t at) {
        return std::clamp(at, block.offset, end) - block.offset;
      };
      for (int r = 0; r < shard_size; ++r) {
        const auto [first, second] = group.held_range(a.index, r);
        pm.held.emplace_back(clip(first), clip(second));
      }
      const auto [first, second] = pm.held[shard_rank()];
      local_piece.emplace_back(second == first ? 0 : block.offset + first - mine.first,
                               second - first);
      placement[a.group_ordinal].push_back(MatrixPlacement{-1, pm.held, m.cols});
      group_matrices[a.group_ordinal].push_back(matrices.size());
      matrix_of.emplace(a.param.unsafeGetTensorImpl(), matrices.size());  // its first matrix
      matrices.push_back(std::move(m));
      plan_groups[a.group_ordinal].matrices.push_back(std::move(pm));
    }
  }
  plan =
      plan_owners(plan_groups, MeshShape{replicas(), shard_size}, config.planner(), plan_rates());
  // kOncePerWorld(Relay): owners are world ranks, and the exchange spans the replicas.
  if (replicas() > 1 && (plan.replica_newton_schulz == ReplicaNewtonSchulz::kOncePerWorld ||
                         plan.replica_newton_schulz == ReplicaNewtonSchulz::kOncePerWorldRelay)) {
    exchange_comm = world_comm;
  }
  FSDP_MUON_CHECK(plan.world_size == world(), "internal error: a plan over ", plan.world_size,
                  " ranks for an exchange over ", world(), " on mesh ", mesh.shape());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t j = 0; j < group_matrices[g].size(); ++j) {
      matrices[group_matrices[g][j]].owner = plan.owner[g][j];
      placement[g][j].owner = plan.owner[g][j];
    }
  }
  round_matrices.assign(plan.rounds.size(), {});
  round_placement.assign(plan.rounds.size(), {});
  for (size_t t = 0; t < plan.rounds.size(); ++t) {
    for (const auto& [g, j] : plan.rounds[t]) {
      // One exchange moves one buffer, so the groups it draws from share a main dtype.
      const size_t first = plan.rounds[t].front().first;
      FSDP_MUON_CHECK(groups[g]->main_dtype() == groups[first]->main_dtype(), "FSDP groups ",
                      group_label(*groups[first], first), " and ", group_label(*groups[g], g),
                      " have different main dtypes (", groups[first]->main_dtype(), ", ",
                      groups[g]->main_dtype(),
                      ") but their matrices are exchanged together; give every group the same "
                      "FsdpParameterGroupOptions::main_dtype, or use OwnerSchedule::kWindows with "
                      "prefetch_budget_bytes(0) (one group per exchange)");
      round_matrices[t].push_back(group_matrices[g][j]);
      round_placement[t].push_back(placement[g][j]);
    }
  }
  exchanges.assign(plan.rounds.size(), ExchangeLayout{});
  timer = std::make_unique<detail::PhaseTimer>(world_comm->device());
  for (size_t gi = 0; gi < self.param_groups_.size(); ++gi) {
    frozen_layouts.push_back(muon_options_of(self.param_groups_[gi], gi).matrix_layout());
  }
  for (const auto& group : self.param_groups_) {
    std::vector<const c10::TensorImpl*> impls;
    for (const at::Tensor& p : group.params()) impls.push_back(p.unsafeGetTensorImpl());
    frozen.push_back(std::move(impls));
  }
}

CostRates FsdpMuon::Impl::plan_rates() const { return detail::planned_rates(config, measured); }

// What every rank must have built identically, one "<key> = <value>" line each: the world and
// mesh shape, every FsdpMuonConfig setting, per optimizer group every MuonOptions field (exact)
// and its parameters (FSDP group, position, name, shape), and the replica mode the plan chose.
std::vector<std::string> FsdpMuon::Impl::describe_parameters(const FsdpMuon& self) const {
  const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  const OwnerPlanOptions& planner = config.planner();
  std::vector<std::string> lines{
      "world = " + std::to_string(world_comm->size()),
      "mesh = " + mesh.shape(),
      std::string("planner.owner_policy = ") + to_string(planner.owner_policy()),
      std::string("planner.owner_schedule = ") + to_string(planner.owner_schedule()),
      "planner.max_bytes_ratio = " + detail::exact_double(planner.max_bytes_ratio()),
      "planner.prefetch_budget_bytes = " + std::to_string(planner.prefetch_budget_bytes()),
      "planner.overlap_communication = " + flag(planner.overlap_communication()),
      std::string("planner.replica_newton_schulz = ") + to_string(planner.replica_newton_schulz()),
      "planner.element_bytes = " + std::to_string(planner.element_bytes()),
  };
  if (const std::optional<CostRates>& rates = config.rates()) {
    lines.push_back("rates.newton_schulz_flops_per_second = " +
                    detail::exact_double(rates->newton_schulz_flops_per_second()));
    lines.push_back("rates.bytes_per_second = " + detail::exact_double(rates->bytes_per_second()));
    lines.push_back("rates.inter_node_bytes_per_second = " +
                    detail::exact_double(rates->inter_node_bytes_per_second()));
    lines.push_back("rates.exchange_latency_seconds = " +
                    detail::exact_double(rates->exchange_latency_seconds()));
  } else {
    lines.push_back("rates = measured at construction");
  }
  lines.insert(
      lines.end(),
      {
          std::string("non_finite_gradients = ") + to_string(config.non_finite_gradients()),
          "check_gradient_agreement = " + flag(config.check_gradient_agreement()),
          "check_replicas_every = " + std::to_string(config.check_replicas_every()),
          std::string("batch_newton_schulz = ") + to_string(config.batch_newton_schulz()),
          "parameter groups = " + std::to_string(self.param_groups_.size()),
      });
  for (size_t gi = 0; gi < self.param_groups_.size(); ++gi) {
    const std::string group = "parameter group " + std::to_string(gi) + " ";
    const auto& options = static_cast<const MuonOptions&>(self.param_groups_[gi].options());
    for (const auto& [name, value] : detail::option_entries(options)) {
      lines.push_back(group + name + " = " + value);
    }
    const auto& params = self.param_groups_[gi].params();
    lines.push_back(group + "parameters = " + std::to_string(params.size()));
    for (size_t i = 0; i < params.size(); ++i) {
      const auto info = find_sharded_parameter(params[i]);
      const ParameterSlot& slot = info->slot();
      lines.push_back(group + "parameter " + std::to_string(i) + " = FSDP group '" +
                      info->group->name() + "' (" + std::to_string(info->group->padded_numel()) +
                      " elements) #" + std::to_string(info->index) + " '" + slot.name + "' " +
                      c10::str(c10::IntArrayRef(slot.shape)));
    }
  }
  // Last, so that a setting that differs is named rather than the choice it led to.
  lines.push_back(std::string("replica_newton_schulz chosen = ") +
                  to_string(plan.replica_newton_schulz));
  return lines;
}

void FsdpMuon::save(torch::serialize::OutputArchive& archive) const {
  FSDP_MUON_API_SCOPE("FsdpMuon");
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

void FsdpMuon::load(torch::serialize::InputArchive& archive) {
  FSDP_MUON_API_SCOPE("FsdpMuon");
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

const FsdpMuonConfig& FsdpMuon::config() const { return impl_->config; }
const OwnerPlan& FsdpMuon::owner_plan() const { return impl_->plan; }
const std::vector<std::shared_ptr<FsdpParameterGroup>>& FsdpMuon::fsdp_groups() const {
  return impl_->groups;
}
const std::vector<FsdpMuonMatrix>& FsdpMuon::matrices() const { return impl_->matrices; }
int FsdpMuon::owner_of(const at::Tensor& sharded_parameter) const {
  if (!sharded_parameter.defined()) return -1;
  auto it = impl_->matrix_of.find(sharded_parameter.unsafeGetTensorImpl());
  return it == impl_->matrix_of.end() ? -1 : impl_->matrices[it->second].owner;
}

int64_t FsdpMuon::skipped_steps() const { return impl_->skipped_steps; }

std::string FsdpMuon::describe() const {
  const Impl& d = *impl_;
  const OwnerPlan& plan = d.plan;
  const bool world_owners = d.exchange_comm == d.world_comm && d.replicas() > 1;
  std::ostringstream out;
  out << "FsdpMuon on mesh " << d.mesh.shape() << " (" << d.replicas() << " replica(s) x "
      << d.shard_size << " shard rank(s)): replica_newton_schulz "
      << to_string(d.config.planner().replica_newton_schulz()) << " -> "
      << to_string(plan.replica_newton_schulz) << ", each matrix orthogonalized "
      << (world_owners
              ? "once in the world, by one of its " + std::to_string(d.world()) + " ranks" +
                    (d.relays() ? ", the update relayed to the other replicas by each holder "
                                  "in the owner's"
                                : "")
              : "in every replica, by one of its " + std::to_string(d.world()) + " shard ranks")
      << "; " << d.matrices.size() << " matrices in " << plan.rounds.size() << " round(s).";
  if (plan.policy == OwnerPolicy::kBalanced) {
    out << " Bytes per rank within " << plan.max_bytes_ratio << "x of holders-only ("
        << (d.config.planner().max_bytes_ratio() == kBytesRatioByCost
                ? "the limit the cost model chose"
                : "max_bytes_ratio")
        << ").";
  }
  const CostRates& rates = plan.rates;
  out << " Cost model, rates " << detail::rates_source(d.config, d.measured) << ": Newton-Schulz "
      << rates.newton_schulz_flops_per_second() << " FLOP/s, intra-node "
      << rates.bytes_per_second() << " B/s, inter-node " << rates.inter_node_bytes_per_second()
      << " B/s per rank, " << rates.exchange_latency_seconds() << " s per exchange; predicted "
      << plan.estimated_seconds() * 1e3 << " ms per step (Newton-Schulz critical path "
      << plan.critical_path_planned() << " FLOPs, busiest rank "
      << plan.max_intra_node_bytes_per_rank() << " B intra-node, "
      << plan.max_inter_node_bytes_per_rank() << " B inter-node)";
  return out.str();
}

const FsdpMuonStepStats& FsdpMuon::last_step_stats() const {
  impl_->timer->add_to(impl_->stats, *impl_->world_comm);
  const OwnerPlan& plan = impl_->plan;
  impl_->stats.predicted_seconds = plan.pipelined_seconds();
  impl_->stats.rates_measured = impl_->measured.measured;
  impl_->stats.rates = plan.rates;
  return impl_->stats;
}

}  // namespace fsdp_muon
