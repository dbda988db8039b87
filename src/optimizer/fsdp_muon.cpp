#include <fsdp_muon/optimizer/fsdp_muon.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/fsdp/parameter_group.h>

#include "comm/agreement.h"
#include "muon/muon_math.h"
#include "newton_schulz/newton_schulz_internal.h"
#include "optimizer/exchange_layout.h"
#include "optimizer/phase_timer.h"

namespace fsdp_muon {
namespace {

using detail::ExchangeLayout;
using detail::MatrixPlacement;
using Stats = FsdpMuonStepStats;

// Runs `collective` and adds the bytes it sent (one CommStats counter) to `bytes`.
template <typename Collective>
void count_sent(Communicator& comm, int64_t CommStats::*counter, int64_t& bytes,
                Collective&& collective) {
  const int64_t before = comm.stats().*counter;
  collective();
  bytes += comm.stats().*counter - before;
}

MuonOptions& muon_options_of(torch::optim::OptimizerParamGroup& group, size_t index) {
  auto* options = dynamic_cast<MuonOptions*>(&group.options());
  TORCH_CHECK(options != nullptr, "fsdp_muon::FsdpMuon: parameter group ", index,
              " has options of another optimizer; give it fsdp_muon::MuonOptions");
  return *options;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

std::string group_label(const FsdpParameterGroup& group, size_t ordinal) {
  return group.name().empty() ? "#" + std::to_string(ordinal) : "'" + group.name() + "'";
}

std::string abbreviate(const std::string& text) {
  constexpr size_t kMax = 2000;
  return text.size() <= kMax ? text : text.substr(0, kMax) + " ...";
}

std::string join(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

// The communicator of the first sharded parameter given: the one every rank agrees through.
std::shared_ptr<Communicator> communicator_of(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups) {
  for (const auto& group : param_groups) {
    for (const at::Tensor& p : group.params()) {
      if (auto info = find_sharded_parameter(p)) return info->group->communicator();
    }
  }
  return nullptr;
}

// A 2-D parameter accepted by build(), before matrices are put in plan order.
struct AcceptedMatrix {
  size_t group_ordinal;
  size_t index;
  size_t param_group;
  at::Tensor param;
};

// One round (or window) as it moves through the step's phases: its matrices are
// round_matrices[round], position j in every vector below.
struct RoundInFlight {
  size_t round = 0;
  std::vector<bool> active;        // [j] has a gradient this step
  std::vector<at::Tensor> own;     // [j] this rank's momentum input, owned matrices
  std::vector<at::Tensor> full;    // [j] full matrix (input, then update) on owners
  at::Tensor send;                 // gather send = scatter receive
  at::Tensor recv;                 // gather receive = scatter send
  std::unique_ptr<CommWork> work;  // the gather or scatter in flight on send/recv
  int64_t full_bytes = 0;          // of `full`
};

}  // namespace

const char* to_string(NonFiniteGradients mode) {
  switch (mode) {
    case NonFiniteGradients::kIgnore:
      return "ignore";
    case NonFiniteGradients::kSkipStep:
      return "skip_step";
    case NonFiniteGradients::kThrow:
      return "throw";
  }
  return "?";
}

const char* to_string(NewtonSchulzBatching mode) {
  switch (mode) {
    case NewtonSchulzBatching::kWhereBitwise:
      return "where_bitwise";
    case NewtonSchulzBatching::kAlways:
      return "always";
    case NewtonSchulzBatching::kNever:
      return "never";
  }
  return "?";
}

OwnerPlanOptions FsdpMuonConfig::owner_plan_options() const {
  return OwnerPlanOptions()
      .policy(owner_policy())
      .schedule(owner_schedule())
      .max_bytes_ratio(max_bytes_ratio())
      .newton_schulz_flops_per_second(newton_schulz_flops_per_second())
      .bytes_per_second(bytes_per_second())
      .prefetch_budget_bytes(prefetch_budget_bytes())
      .overlap(overlap_communication());
}

struct FsdpMuon::Impl {
  FsdpMuonConfig config;
  std::shared_ptr<Communicator> comm;
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<FsdpMuonMatrix> matrices;
  std::vector<std::vector<size_t>> group_matrices;  // [group] -> indices into matrices
  // [round] -> indices into matrices, and their placements, in the plan's round order.
  std::vector<std::vector<size_t>> round_matrices;
  std::vector<std::vector<MatrixPlacement>> round_placement;
  std::unordered_map<const c10::TensorImpl*, size_t> matrix_of;
  OwnerPlan plan;
  // Parameter identities per optimizer group as constructed: step() compares against them.
  std::vector<std::vector<const c10::TensorImpl*>> frozen;
  std::vector<ExchangeLayout> exchanges;  // [round], laid out again when the active set changes
  FsdpMuonStepStats stats;
  // The last step's phase times, added to `stats` when they are first read (on CUDA that waits
  // for the step's work, so a step nobody profiles never waits).
  std::unique_ptr<detail::PhaseTimer> timer;
  int64_t skipped_steps = 0;

  int rank() const { return comm->rank(); }
  int world() const { return comm->size(); }

  const ExchangeLayout& exchange(size_t round, const std::vector<bool>& active) {
    ExchangeLayout& x = exchanges[round];
    if (x.active != active || x.send_counts.empty()) {
      x = detail::layout_exchange(round_placement[round], active, rank(), world());
    }
    return x;
  }

  // ---- construction ----
  std::vector<AcceptedMatrix> accept_parameters(FsdpMuon& self);
  void plan_matrices(FsdpMuon& self, std::vector<AcceptedMatrix> accepted);
  std::string describe_parameters(const FsdpMuon& self) const;

  // ---- step() phases, in order (docs/DESIGN.md §3) ----
  std::vector<bool> agree_on_gradients(FsdpMuon& self, FsdpMuonStepStats& stats);
  void reject_non_finite(const std::vector<int64_t>& sums, std::vector<bool>& active,
                         FsdpMuonStepStats& stats);
  RoundInFlight momentum_inputs(FsdpMuon& self, size_t round, const std::vector<bool>& active);
  void start_gather(RoundInFlight& f, FsdpMuonStepStats& stats);
  void assemble_owned(RoundInFlight& f, FsdpMuonStepStats& stats);
  void orthogonalize_owned(FsdpMuon& self, RoundInFlight& f, FsdpMuonStepStats& stats);
  void start_scatter(RoundInFlight& f, FsdpMuonStepStats& stats);
  void apply_updates(FsdpMuon& self, RoundInFlight& f);
  void refresh(size_t group, FsdpMuonStepStats& stats);
  // Full-matrix bytes alive now on this rank, for FsdpMuonStepStats::max_transient_bytes.
  int64_t live_full_bytes = 0;
};

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
  impl_->config = std::move(config);
  const auto construct = [&] {
    defaults.validate();
    TORCH_CHECK(impl_->config.prefetch_budget_bytes() >= 0,
                "fsdp_muon::FsdpMuon: prefetch_budget_bytes must be >= 0, got ",
                impl_->config.prefetch_budget_bytes(), " (kUnlimitedPrefetch for no limit)");
    TORCH_CHECK(impl_->config.check_gradient_agreement() ||
                    impl_->config.non_finite_gradients() == NonFiniteGradients::kIgnore,
                "fsdp_muon::FsdpMuon: non_finite_gradients(",
                to_string(impl_->config.non_finite_gradients()),
                ") needs check_gradient_agreement(true): the ranks learn of a NaN or Inf through "
                "its all-reduce");
    for (const auto& group : param_groups) add_group(group);
    build();
  };
  const std::shared_ptr<Communicator> comm = communicator_of(param_groups);
  if (!comm) {
    // Nobody to agree with: fail here with the most specific message there is.
    construct();
    TORCH_CHECK(false, "fsdp_muon::FsdpMuon: no parameters given");
  }
  // Every rank takes part in both exchanges, so a rank that fails makes all fail, none hang.
  detail::run_agreed(*comm, "fsdp_muon::FsdpMuon: construction", construct);
  const std::string description = impl_->describe_parameters(*this);
  const std::vector<int> differ = detail::ranks_that_differ(*comm, description);
  TORCH_CHECK(
      differ.empty(), "fsdp_muon::FsdpMuon: the parameter lists differ across ranks: ", "rank(s) ",
      join(differ),
      " disagree with rank 0 on the groups, order, names or shapes of the "
      "parameters (or on ns_steps, owner policy, schedule or prefetch budget). Every rank must "
      "construct FsdpMuon with the same sharded parameters in the same order. This "
      "rank (",
      comm->rank(), ") has:", abbreviate(description));
}

FsdpMuon::~FsdpMuon() = default;

void FsdpMuon::add_group(const torch::optim::OptimizerParamGroup& param_group) {
  const size_t index = param_groups_.size();
  for (size_t i = 0; i < param_group.params().size(); ++i) {
    TORCH_CHECK(param_group.params()[i].defined(), "fsdp_muon::FsdpMuon: parameter ", i,
                " of group ", index, " is an undefined tensor");
  }
  Optimizer::add_param_group(param_group);
  // LibTorch versions differ in what the base class does with options of optimizer types it
  // does not know; the group keeps its own.
  if (param_group.has_options()) param_groups_.back().set_options(param_group.options().clone());
  muon_options_of(param_groups_.back(), index).validate();
}

void FsdpMuon::add_param_group(const torch::optim::OptimizerParamGroup& /*param_group*/) {
  TORCH_CHECK(false,
              "fsdp_muon::FsdpMuon: add_param_group after construction is not supported: the "
              "owner plan covers the fixed set of parameters given to the constructor. Construct "
              "a new FsdpMuon with all parameter groups instead");
}

void FsdpMuon::build() { impl_->plan_matrices(*this, impl_->accept_parameters(*this)); }

// Checks every parameter given and collects the FSDP groups (in first-use order) and the 2-D
// parameters. Non-2-D ones are an error unless skip_non_matrix, then a warning on rank 0.
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
      TORCH_CHECK(info.has_value(), "fsdp_muon::FsdpMuon: parameter ", i, " of parameter group ",
                  gi, " (shape ", p.sizes(),
                  ") is not a sharded parameter of a live FsdpParameterGroup. Give FsdpMuon the "
                  "tensors from group->sharded_parameters() (see shard_module()), not the "
                  "module's own parameters, and keep the groups alive (held by std::shared_ptr)");
      const FsdpParameterGroup& group = *info->group;
      const ParameterSlot& slot = info->slot();
      auto [it, inserted] = seen.emplace(p.unsafeGetTensorImpl(), gi);
      TORCH_CHECK(inserted, "fsdp_muon::FsdpMuon: parameter '", slot.name,
                  "' is given twice (parameter groups ", it->second, " and ", gi,
                  "); give each parameter to one group only");
      auto found = ordinal_of.find(&group);
      if (found == ordinal_of.end()) {
        if (!groups.empty()) {
          const FsdpParameterGroup& first = *groups.front();
          TORCH_CHECK(group.communicator() == first.communicator(),
                      "fsdp_muon::FsdpMuon: FSDP groups ", group_label(first, 0), " and ",
                      group_label(group, groups.size()), " (parameter '", slot.name,
                      "') use different communicators; FsdpMuon works on one 1-D data-parallel "
                      "mesh, so shard every group with the same Communicator");
        }
        found = ordinal_of.emplace(&group, groups.size()).first;
        groups.push_back(info->group);
      }
      if (slot.shape.size() != 2) {
        std::ostringstream& list = options.skip_non_matrix() ? skipped : non_matrix;
        if (list.tellp() > 0) list << ", ";
        list << "'" << slot.name << "' " << shape_string(slot.shape);
        if (!options.skip_non_matrix()) ++non_matrix_count;
        continue;
      }
      accepted.push_back({found->second, info->index, gi, p});
    }
  }
  TORCH_CHECK(non_matrix_count == 0,
              "fsdp_muon::FsdpMuon: only 2-D parameters can be orthogonalized, but ",
              non_matrix_count, " are not: ", non_matrix.str(),
              ". Give biases, norms and embeddings to torch::optim::AdamW, or set "
              "MuonOptions().skip_non_matrix(true) to leave them untouched");
  TORCH_CHECK(!groups.empty(), "fsdp_muon::FsdpMuon: no parameters given");
  comm = groups.front()->communicator();
  if (skipped.tellp() > 0 && comm->rank() == 0) {
    TORCH_WARN("fsdp_muon::FsdpMuon: skip_non_matrix is set, so these non-2-D parameters are ",
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
  const int w = world();
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
    FsdpMuonMatrix m;
    m.group = groups[a.group_ordinal];
    m.group_ordinal = a.group_ordinal;
    m.index = a.index;
    m.param_group = a.param_group;
    m.sharded_parameter = a.param;
    m.name = slot.name;
    m.rows = slot.shape[0];
    m.cols = slot.shape[1];
    PlanMatrix pm;
    pm.name = slot.name;
    pm.rows = m.rows;
    pm.cols = m.cols;
    pm.ns_steps = muon_options_of(self.param_groups_[a.param_group], a.param_group).ns_steps();
    for (int r = 0; r < w; ++r) pm.held.push_back(group.held_range(a.index, r));
    placement[a.group_ordinal].push_back(MatrixPlacement{-1, pm.held});
    group_matrices[a.group_ordinal].push_back(matrices.size());
    matrix_of.emplace(a.param.unsafeGetTensorImpl(), matrices.size());
    matrices.push_back(std::move(m));
    plan_groups[a.group_ordinal].matrices.push_back(std::move(pm));
  }
  plan = plan_owners(plan_groups, w, config.owner_plan_options());
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
      TORCH_CHECK(groups[g]->main_dtype() == groups[first]->main_dtype(),
                  "fsdp_muon::FsdpMuon: FSDP groups ", group_label(*groups[first], first), " and ",
                  group_label(*groups[g], g), " have different main dtypes (",
                  groups[first]->main_dtype(), ", ", groups[g]->main_dtype(),
                  ") but their matrices are exchanged together; give every group the same "
                  "FsdpParameterGroupOptions::main_dtype, or use OwnerSchedule::kWindows with "
                  "prefetch_budget_bytes(0) (one group per exchange)");
      round_matrices[t].push_back(group_matrices[g][j]);
      round_placement[t].push_back(placement[g][j]);
    }
  }
  exchanges.assign(plan.rounds.size(), ExchangeLayout{});
  timer = std::make_unique<detail::PhaseTimer>(comm->device());
  for (const auto& group : self.param_groups_) {
    std::vector<const c10::TensorImpl*> impls;
    for (const at::Tensor& p : group.params()) impls.push_back(p.unsafeGetTensorImpl());
    frozen.push_back(std::move(impls));
  }
}

// What every rank must have built identically: world, policy, budget, and per optimizer group
// its ns_steps and parameters (FSDP group, position, name, shape).
std::string FsdpMuon::Impl::describe_parameters(const FsdpMuon& self) const {
  std::ostringstream desc;
  desc << "world " << world() << "; policy " << to_string(config.owner_policy()) << "; schedule "
       << to_string(config.owner_schedule()) << "; bytes ratio " << config.max_bytes_ratio()
       << "; cost-model rates " << config.newton_schulz_flops_per_second() << " FLOP/s "
       << config.bytes_per_second() << " B/s"
       << "; budget " << config.prefetch_budget_bytes() << "; overlap "
       << config.overlap_communication() << "; non-finite "
       << to_string(config.non_finite_gradients()) << "; agreement "
       << config.check_gradient_agreement() << ";";
  for (size_t gi = 0; gi < self.param_groups_.size(); ++gi) {
    const auto& options = static_cast<const MuonOptions&>(self.param_groups_[gi].options());
    desc << " group " << gi << " ns_steps " << options.ns_steps() << " {";
    for (const at::Tensor& p : self.param_groups_[gi].params()) {
      const auto info = find_sharded_parameter(p);
      const ParameterSlot& slot = info->slot();
      desc << " " << info->group->name() << "/" << info->group->padded_numel() << "/" << info->index
           << ":" << slot.name << shape_string(slot.shape);
    }
    desc << " }";
  }
  return desc.str();
}

at::Tensor FsdpMuon::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  Impl& d = *impl_;
  FsdpMuonStepStats stats;
  d.timer->reset();
  try {
    const std::vector<bool> active = d.agree_on_gradients(*this, stats);
    d.live_full_bytes = 0;
    const size_t rounds = d.plan.rounds.size();
    stats.windows = static_cast<int64_t>(rounds);
    if (!d.config.overlap_communication()) {
      for (size_t t = 0; t < rounds; ++t) {
        RoundInFlight f = d.momentum_inputs(*this, t, active);
        d.start_gather(f, stats);
        d.assemble_owned(f, stats);
        d.orthogonalize_owned(*this, f, stats);
        d.start_scatter(f, stats);
        d.apply_updates(*this, f);
        for (size_t g = 0; g < d.groups.size(); ++g) {
          if (d.plan.refresh_after_round[g] == t) d.refresh(g, stats);
        }
      }
    } else if (rounds > 0) {
      // docs/DESIGN.md §3: round t+1 is gathered while round t is orthogonalized, and round t's
      // scatter runs while round t+1 is orthogonalized. Every rank starts the collectives in
      // the same order: gather 0, then per round gather t+1, scatter t. The refreshes come last:
      // a synchronous collective would wait for the ones in flight.
      // Where two consecutive rounds do not fit the budget together
      // (OwnerPlan::overlap_with_next), round t is applied before round t+1 is gathered.
      RoundInFlight current = d.momentum_inputs(*this, 0, active);
      d.start_gather(current, stats);
      RoundInFlight previous;  // scattered while `current` is orthogonalized, not yet applied
      bool scattering = false;
      for (size_t t = 0; t < rounds; ++t) {
        const bool pipelined = t + 1 < rounds && d.plan.overlap_with_next[t];
        d.assemble_owned(current, stats);
        RoundInFlight next;
        if (pipelined) {
          next = d.momentum_inputs(*this, t + 1, active);
          d.start_gather(next, stats);
        }
        d.orthogonalize_owned(*this, current, stats);
        d.start_scatter(current, stats);
        if (scattering) d.apply_updates(*this, previous);
        previous = std::move(current);
        scattering = true;
        if (!pipelined && t + 1 < rounds) {
          d.apply_updates(*this, previous);
          scattering = false;
          next = d.momentum_inputs(*this, t + 1, active);
          d.start_gather(next, stats);
        }
        current = std::move(next);
      }
      if (scattering) d.apply_updates(*this, previous);
    }
    if (d.config.overlap_communication()) {
      for (size_t g = 0; g < d.groups.size(); ++g) d.refresh(g, stats);
    }
  } catch (...) {
    // A failed step's phase times must not be added to the last completed step's stats.
    d.timer->reset();
    throw;
  }
  d.stats = stats;
  return loss;
}

// One all-reduce before anything changes: every rank learns whether any rank's parameter groups
// were edited, whether any failed its checks, and which matrices have gradients everywhere.
std::vector<bool> FsdpMuon::Impl::agree_on_gradients(FsdpMuon& self, FsdpMuonStepStats& stats) {
  const auto phase = timer->measure(&Stats::check_seconds);
  const size_t n = matrices.size();
  bool changed = self.param_groups_.size() != frozen.size();
  for (size_t gi = 0; !changed && gi < self.param_groups_.size(); ++gi) {
    const auto& params = self.param_groups_[gi].params();
    changed = params.size() != frozen[gi].size();
    for (size_t i = 0; !changed && i < params.size(); ++i) {
      changed = params[i].unsafeGetTensorImpl() != frozen[gi][i];
    }
  }
  const NonFiniteGradients non_finite = config.non_finite_gradients();
  const bool check_finite = non_finite != NonFiniteGradients::kIgnore;
  // [changed, has a gradient per matrix, (checked:) non-finite gradient per matrix]: this
  // rank's view, summed over the ranks unless the loop guarantees agreement.
  const size_t size = check_finite ? 2 * n + 1 : n + 1;
  const auto local_checks = [&](std::vector<int64_t>& mine) {
    mine[0] = changed ? 1 : 0;
    if (changed) return;  // the checks below assume the constructed groups
    for (size_t gi = 0; gi < self.param_groups_.size(); ++gi) {
      muon_options_of(self.param_groups_[gi], gi).validate();  // may have been edited
    }
    std::vector<size_t> checked;
    std::vector<at::Tensor> not_finite;
    for (size_t m = 0; m < n; ++m) {
      const at::Tensor& p = matrices[m].sharded_parameter;
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse() && g.sizes() == p.sizes() && g.dtype() == p.dtype(),
                  "fsdp_muon::FsdpMuon: the gradient of '", matrices[m].name, "' has shape ",
                  g.sizes(), " and dtype ", g.dtype(), " but its shard is ", p.sizes(), " ",
                  p.dtype(),
                  "; FsdpMuon expects the group's gradient-shard slice "
                  "(FsdpParameterGroup::reduce_scatter_grads())");
      mine[m + 1] = 1;
      if (check_finite) {
        checked.push_back(m);
        not_finite.push_back(at::logical_not(at::isfinite(g)).any());
      }
    }
    if (checked.empty()) return;
    // One device-to-host copy for all matrices. The shards are the reduce-scatter's result, so
    // the wait is bounded by the communicator's timeout (docs/DESIGN.md §5).
    const at::Tensor flags = comm->to_host(at::stack(not_finite).to(at::kLong));
    for (size_t k = 0; k < checked.size(); ++k) {
      mine[n + 1 + checked[k]] = flags.data_ptr<int64_t>()[k];
    }
  };
  std::vector<int64_t> sums(size, 0);
  if (config.check_gradient_agreement()) {
    count_sent(*comm, &CommStats::all_reduce_bytes, stats.check_bytes, [&] {
      sums = detail::agree_on_sum(*comm, "fsdp_muon::FsdpMuon::step", size, local_checks);
    });
  } else {
    // Every rank is taken to see what this one sees.
    local_checks(sums);
    for (int64_t& count : sums) count *= world();
  }
  const int w = world();
  TORCH_CHECK(sums[0] == 0,
              "fsdp_muon::FsdpMuon: the parameter groups were changed after construction on ",
              sums[0], " of ", w, " rank(s)", changed ? " (this one included)" : "",
              " — by add_param_group or add_parameters through the Optimizer base class, or by "
              "editing param_groups(). The owner plan covers the parameters given to the "
              "constructor; construct a new FsdpMuon instead");
  std::ostringstream disagree;
  int64_t disagreements = 0;
  std::vector<bool> active(n, false);
  for (size_t m = 0; m < n; ++m) {
    const int64_t holders = sums[m + 1];
    active[m] = holders == w;
    if (holders == 0 || holders == w || disagreements++ >= 8) continue;
    const bool here = matrices[m].sharded_parameter.grad().defined();
    disagree << (disagreements > 1 ? ", " : "") << "'" << matrices[m].name << "' on " << holders
             << " of " << w << " ranks (this rank: " << (here ? "yes" : "no") << ")";
  }
  TORCH_CHECK(disagreements == 0,
              "fsdp_muon::FsdpMuon: ranks disagree on which parameters have gradients (",
              disagreements, " parameter(s)): ", disagree.str(),
              ". Every rank must produce the same set of gradients (run backward on every rank, "
              "then FsdpParameterGroup::reduce_scatter_grads() on every rank)");
  stats.active_parameters = std::count(active.begin(), active.end(), true);
  if (check_finite) reject_non_finite(sums, active, stats);
  return active;
}

// Applies NonFiniteGradients to the agreed counts of ranks that saw NaN or Inf per matrix.
void FsdpMuon::Impl::reject_non_finite(const std::vector<int64_t>& sums, std::vector<bool>& active,
                                       FsdpMuonStepStats& stats) {
  const size_t n = matrices.size();
  std::ostringstream names;
  for (size_t m = 0; m < n; ++m) {
    const int64_t ranks = sums[n + 1 + m];
    if (ranks == 0) continue;
    if (stats.non_finite_parameters++ < 8) {
      names << (stats.non_finite_parameters > 1 ? ", " : "") << "'" << matrices[m].name << "' on "
            << ranks << " of " << world() << " rank(s)";
    }
  }
  if (stats.non_finite_parameters == 0) return;
  TORCH_CHECK(config.non_finite_gradients() != NonFiniteGradients::kThrow,
              "fsdp_muon::FsdpMuon: non-finite gradients (NaN or Inf) in ",
              stats.non_finite_parameters, " parameter(s): ", names.str(),
              ". FsdpMuonConfig().non_finite_gradients(NonFiniteGradients::kSkipStep) skips such "
              "steps instead");
  // kSkipStep: no matrix is active, so nothing moves or changes; the groups are still refreshed.
  active.assign(n, false);
  stats.skipped = true;
  ++skipped_steps;
}

// Weight decay, momentum and the Nesterov input on each local shard of the round's matrices;
// owners keep theirs, the rest is packed into the gather's send buffer.
RoundInFlight FsdpMuon::Impl::momentum_inputs(FsdpMuon& self, size_t round,
                                              const std::vector<bool>& active) {
  const auto phase = timer->measure(&Stats::elementwise_seconds);
  const int me = rank();
  const auto& mine = round_matrices[round];
  RoundInFlight f;
  f.round = round;
  f.active.resize(mine.size());
  for (size_t j = 0; j < mine.size(); ++j) f.active[j] = active[mine[j]];
  const ExchangeLayout& x = exchange(round, f.active);
  f.own.resize(mine.size());
  f.full.resize(mine.size());
  const size_t group = mine.empty() ? 0 : matrices[mine.front()].group_ordinal;
  f.send = at::empty({x.send_numel}, groups[group]->main_weight_shard().options());
  for (size_t j = 0; j < mine.size(); ++j) {
    if (!f.active[j]) continue;
    const FsdpMuonMatrix& mat = matrices[mine[j]];
    const at::Tensor& p = mat.sharded_parameter;
    MuonParamState& state = detail::advance_muon_state(self.state_, p);
    if (p.numel() == 0) continue;  // this rank holds none of it
    const MuonOptions& options =
        muon_options_of(self.param_groups_[mat.param_group], mat.param_group);
    at::Tensor buffer = state.momentum_buffer();
    at::Tensor u = detail::muon_momentum_input(p, p.grad(), buffer, options);
    if (mat.owner == me) {
      f.own[j] = std::move(u);
    } else {
      f.send.narrow(0, x.send_offset[j], u.numel()).copy_(u);
    }
  }
  return f;
}

// One all-to-all-v for the round (skipped when nothing moves), started without waiting.
void FsdpMuon::Impl::start_gather(RoundInFlight& f, FsdpMuonStepStats& stats) {
  const auto phase = timer->measure(&Stats::gather_seconds);
  const ExchangeLayout& x = exchange(f.round, f.active);
  f.recv = at::empty({x.recv_numel}, f.send.options());
  if (x.moves) {
    count_sent(*comm, &CommStats::all_to_all_v_bytes, stats.gather_bytes, [&] {
      f.work = comm->all_to_all_v_async(f.send, x.send_counts, f.recv, x.recv_counts);
    });
  }
}

// Waits for the round's gather, then each owner assembles its full matrices.
void FsdpMuon::Impl::assemble_owned(RoundInFlight& f, FsdpMuonStepStats& stats) {
  const auto phase = timer->measure(&Stats::gather_seconds);
  if (f.work) {
    f.work->wait();
    f.work.reset();
  }
  const int me = rank();
  const ExchangeLayout& x = exchange(f.round, f.active);
  const auto& where_all = round_placement[f.round];
  for (size_t j = 0; j < where_all.size(); ++j) {
    const MatrixPlacement& where = where_all[j];
    if (!f.active[j] || where.owner != me) continue;
    // One allocation per matrix: fresh, aligned storage, as single-device Muon's U has.
    at::Tensor full = at::empty({where.numel()}, f.send.options());
    f.full_bytes += full.nbytes();
    for (int s = 0; s < world(); ++s) {
      const int64_t len = where.held_numel(s);
      if (len == 0) continue;
      full.narrow(0, where.held[s].first, len)
          .copy_(s == me ? f.own[j] : f.recv.narrow(0, x.recv_offset[j][s], len));
    }
    f.own[j] = at::Tensor();
    f.full[j] = std::move(full);
  }
  live_full_bytes += f.full_bytes;
  stats.max_transient_bytes = std::max(stats.max_transient_bytes, live_full_bytes);
}

// Newton–Schulz and the scale on each full matrix this rank owns in the round, in place.
// Same-shape matrices of one optimizer group go through one batched call where
// FsdpMuonConfig::batch_newton_schulz allows it (docs/DESIGN.md §4, "Batching").
void FsdpMuon::Impl::orthogonalize_owned(FsdpMuon& self, RoundInFlight& f,
                                         FsdpMuonStepStats& stats) {
  const auto phase = timer->measure(&Stats::orthogonalize_seconds);
  // Bounds the batch's stacked copy and Newton–Schulz workspace (2^25 elements: 128 MiB fp32).
  constexpr int64_t kMaxBatchElements = int64_t{1} << 25;
  struct Owned {
    at::Tensor u;  // the full matrix as rows x cols, a view of its storage
    const MuonOptions* options;
  };
  // Batches in order of their first matrix; the key keeps apart what one call cannot share.
  using Key = std::tuple<int64_t, int64_t, c10::ScalarType, size_t>;  // rows, cols, dtype, group
  std::vector<std::vector<Owned>> batches;
  std::map<Key, size_t> open_batch;  // key -> index in batches of the batch still filling
  const auto& mine = round_matrices[f.round];
  for (size_t j = 0; j < mine.size(); ++j) {
    at::Tensor& full = f.full[j];
    if (!full.defined()) continue;
    const FsdpMuonMatrix& mat = matrices[mine[j]];
    const MuonOptions& options =
        muon_options_of(self.param_groups_[mat.param_group], mat.param_group);
    Owned owned{full.view({mat.rows, mat.cols}), &options};
    const NewtonSchulzBatching mode = config.batch_newton_schulz();
    const bool batch =
        mode == NewtonSchulzBatching::kAlways ||
        (mode == NewtonSchulzBatching::kWhereBitwise &&
         detail::batched_newton_schulz_is_bitwise(full.device(), options.ns_dtype()));
    const Key key{mat.rows, mat.cols, full.scalar_type(), mat.param_group};
    auto open = batch ? open_batch.find(key) : open_batch.end();
    if (open != open_batch.end() &&
        static_cast<int64_t>(batches[open->second].size() + 1) * mat.rows * mat.cols <=
            kMaxBatchElements) {
      batches[open->second].push_back(std::move(owned));
      continue;
    }
    if (batch) open_batch[key] = batches.size();
    batches.push_back({std::move(owned)});
  }
  for (const std::vector<Owned>& batch : batches) {
    const MuonOptions& options = *batch.front().options;
    stats.orthogonalized_matrices += static_cast<int64_t>(batch.size());
    ++stats.newton_schulz_calls;
    if (batch.size() == 1) {
      const at::Tensor& u = batch.front().u;
      u.copy_(detail::muon_orthogonalized_update(u, options));
      continue;
    }
    std::vector<at::Tensor> inputs;
    inputs.reserve(batch.size());
    for (const Owned& owned : batch) inputs.push_back(owned.u);
    const at::Tensor updates = detail::muon_orthogonalized_update(at::stack(inputs), options);
    for (size_t b = 0; b < batch.size(); ++b) batch[b].u.copy_(updates[static_cast<int64_t>(b)]);
  }
}

// Each owner packs every holder's slice of the update and the reverse all-to-all-v starts: the
// gather's buffers, roles swapped.
void FsdpMuon::Impl::start_scatter(RoundInFlight& f, FsdpMuonStepStats& stats) {
  const auto phase = timer->measure(&Stats::scatter_seconds);
  const int me = rank();
  const ExchangeLayout& x = exchange(f.round, f.active);
  const auto& where_all = round_placement[f.round];
  for (size_t j = 0; j < where_all.size(); ++j) {
    if (!f.full[j].defined()) continue;
    const MatrixPlacement& where = where_all[j];
    for (int h = 0; h < world(); ++h) {
      const int64_t len = where.held_numel(h);
      if (h == me || len == 0) continue;
      f.recv.narrow(0, x.recv_offset[j][h], len)
          .copy_(f.full[j].narrow(0, where.held[h].first, len));
    }
  }
  if (x.moves) {
    count_sent(*comm, &CommStats::all_to_all_v_bytes, stats.scatter_bytes, [&] {
      f.work = comm->all_to_all_v_async(f.recv, x.recv_counts, f.send, x.send_counts);
    });
  }
}

// Waits for the round's scatter, then param <- param - lr * update on each local shard.
void FsdpMuon::Impl::apply_updates(FsdpMuon& self, RoundInFlight& f) {
  if (f.work) {
    const auto phase = timer->measure(&Stats::scatter_seconds);
    f.work->wait();
    f.work.reset();
  }
  const auto phase = timer->measure(&Stats::apply_seconds);
  const int me = rank();
  const ExchangeLayout& x = exchange(f.round, f.active);
  const auto& mine = round_matrices[f.round];
  for (size_t j = 0; j < mine.size(); ++j) {
    const FsdpMuonMatrix& mat = matrices[mine[j]];
    const at::Tensor& p = mat.sharded_parameter;
    if (!f.active[j] || p.numel() == 0) continue;
    const MuonOptions& options =
        muon_options_of(self.param_groups_[mat.param_group], mat.param_group);
    const at::Tensor update =
        mat.owner == me ? f.full[j].narrow(0, round_placement[f.round][j].held[me].first, p.numel())
                        : f.send.narrow(0, x.send_offset[j], p.numel());
    detail::muon_apply_update(p, update, options);
  }
  live_full_bytes -= f.full_bytes;
  f = RoundInFlight{};
}

// The group's model weights are refreshed every step, whether or not its matrices had
// gradients, since another optimizer may just have stepped the group's other parameters.
void FsdpMuon::Impl::refresh(size_t group, FsdpMuonStepStats& stats) {
  const auto phase = timer->measure(&Stats::refresh_seconds);
  count_sent(*comm, &CommStats::all_gather_bytes, stats.refresh_bytes,
             [&] { groups[group]->refresh_model_weights(); });
}

void FsdpMuon::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

void FsdpMuon::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

const FsdpMuonConfig& FsdpMuon::config() const { return impl_->config; }
const OwnerPlan& FsdpMuon::owner_plan() const { return impl_->plan; }
const std::vector<std::shared_ptr<FsdpParameterGroup>>& FsdpMuon::fsdp_groups() const {
  return impl_->groups;
}
const std::vector<FsdpMuonMatrix>& FsdpMuon::matrices() const { return impl_->matrices; }
const std::vector<std::pair<size_t, size_t>>& FsdpMuon::windows() const {
  return impl_->plan.windows;
}

int FsdpMuon::owner_of(const at::Tensor& sharded_parameter) const {
  if (!sharded_parameter.defined()) return -1;
  auto it = impl_->matrix_of.find(sharded_parameter.unsafeGetTensorImpl());
  return it == impl_->matrix_of.end() ? -1 : impl_->matrices[it->second].owner;
}

int64_t FsdpMuon::skipped_steps() const { return impl_->skipped_steps; }

const FsdpMuonStepStats& FsdpMuon::last_step_stats() const {
  impl_->timer->add_to(impl_->stats, *impl_->comm);
  return impl_->stats;
}

}  // namespace fsdp_muon
