// FsdpMuon::step(): the agreement, then the rounds of docs/DESIGN.md §3 in one of two
// schedules (run_sequential, run_pipelined), each round through the same phases.
#include <fsdp_muon/optimizer/fsdp_muon.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <sstream>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "common/check.h"
#include "muon/muon_math.h"
#include "muon/update_rule.h"
#include "newton_schulz/newton_schulz_internal.h"
#include "optimizer/fsdp_muon_impl.h"
#include "optimizer/replica_check.h"

namespace fsdp_muon {
namespace {

using detail::ExchangeLayout;
using detail::MatrixPlacement;
using detail::muon_options_of;
using detail::RoundInFlight;
using detail::StepRun;
using Stats = FsdpMuonStepStats;

// Runs `collective` and adds the bytes it sent (one CommStats counter) to `bytes`.
template <typename Collective>
void count_sent(Communicator& comm, int64_t CommStats::*counter, int64_t& bytes,
                Collective&& collective) {
  const int64_t before = comm.stats().*counter;
  collective();
  bytes += comm.stats().*counter - before;
}

}  // namespace

at::Tensor FsdpMuon::step(LossClosure closure) {
  FSDP_MUON_API_SCOPE("FsdpMuon");
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  Impl& d = *impl_;
  ++d.step_calls;
  d.timer->reset();
  try {
    StepRun s = d.agree_on_gradients(*this);
    d.advance_states(*this, s);
    d.live_full_bytes = 0;
    s.stats.rounds = static_cast<int64_t>(d.plan.rounds.size());
    if (d.config.planner().overlap_communication()) {
      d.run_pipelined(*this, s);
    } else {
      d.run_sequential(*this, s);
    }
    d.stats = s.stats;
  } catch (...) {
    // A failed step's phase times must not be added to the last completed step's stats.
    d.timer->reset();
    throw;
  }
  return loss;
}

// One round after the other; each group is refreshed after the round that completes it.
void FsdpMuon::Impl::run_sequential(FsdpMuon& self, StepRun& s) {
  for (size_t t = 0; t < plan.rounds.size(); ++t) {
    RoundInFlight f = momentum_inputs(self, t, s);
    start_gather(f, s);
    assemble_owned(f, s);
    orthogonalize_owned(f, s);
    start_scatter(f, s);
    apply_updates(f, s);
    for (size_t g = 0; g < groups.size(); ++g) {
      if (plan.refresh_after_round[g] == t) refresh(g, s);
    }
  }
}

// docs/DESIGN.md §3: round t+1 is gathered while round t is orthogonalized, and round t's
// scatter runs while round t+1 is orthogonalized. Every rank starts the collectives in the same
// order: gather 0, then per round gather t+1, scatter t. Where two consecutive rounds do not fit
// the budget together (OwnerPlan::overlap_with_next), round t is applied before round t+1 is
// gathered. The refreshes come last: a synchronous collective would wait for the ones in flight.
void FsdpMuon::Impl::run_pipelined(FsdpMuon& self, StepRun& s) {
  const size_t rounds = plan.rounds.size();
  std::vector<RoundInFlight> round(rounds);
  const auto gather = [&](size_t t) {
    round[t] = momentum_inputs(self, t, s);
    start_gather(round[t], s);
  };
  if (rounds > 0) gather(0);
  for (size_t t = 0; t < rounds; ++t) {
    const bool has_next = t + 1 < rounds;
    assemble_owned(round[t], s);
    if (has_next && plan.overlap_with_next[t]) gather(t + 1);
    orthogonalize_owned(round[t], s);
    start_scatter(round[t], s);
    if (t > 0 && plan.overlap_with_next[t - 1]) apply_updates(round[t - 1], s);
    if (has_next && !plan.overlap_with_next[t]) {
      apply_updates(round[t], s);
      gather(t + 1);
    }
  }
  if (rounds > 0) apply_updates(round[rounds - 1], s);
  for (size_t g = 0; g < groups.size(); ++g) refresh(g, s);
}

const ExchangeLayout& FsdpMuon::Impl::exchange(size_t round, const std::vector<bool>& active,
                                               const std::vector<bool>& with_rows) {
  ExchangeLayout& x = exchanges[round];
  if (x.active != active || x.with_rows != with_rows || x.gather.send_counts.empty()) {
    x = detail::layout_exchange(round_placement[round], active, rank(), world(), with_rows,
                                exchange_replicas(), relays());
    if (relays()) {
      x.relay = detail::layout_relay(round_placement[round], active, with_rows, shard_rank(),
                                     mesh.replica(), replicas());
    }
  }
  return x;
}

namespace {

// The options the step re-checks across ranks: those torch's schedulers change after
// construction (lr; momentum and weight decay in schedules such as one-cycle), one by one so the
// error can name them, and a hash of all the others (edits on one rank are rarer, but as wrong).
constexpr size_t kScheduled = 3;
constexpr const char* kScheduledNames[kScheduled] = {"lr", "momentum", "weight_decay"};
constexpr size_t kFingerprints = kScheduled + 1;  // + the other options

// The values compared, as 64-bit patterns: the exact bits of the scheduled doubles, then the hash
// of the other options' exact descriptions and of `mesh_mode` (the mesh and replica mode).
std::array<uint64_t, kFingerprints> option_values(const MuonOptions& o,
                                                  const std::string& mesh_mode) {
  const auto bits = [](double v) {
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof b);
    return b;
  };
  std::string others = mesh_mode + "\n";
  for (const auto& [name, value] : detail::option_entries(o)) {
    if (name == "lr" || name == "momentum" || name == "weight_decay") continue;
    others += name + " = " + value + "\n";
  }
  return {bits(o.lr()), bits(o.momentum()), bits(o.weight_decay()), detail::stable_hash(others)};
}

// Where each check sits in the vector the step's agreement sums over the ranks:
// [groups edited, per matrix: has a gradient, per FSDP group: unreduced gradients,
//  per optimizer group and fingerprint: mix40 of the value (every rank) and rank 0's value
//  (rank 0 only), (on replica-check steps:) per FSDP group: replica_entries], then, computed on
// the device and summed by the same all-reduce (checked: NonFiniteGradients), [per FSDP group:
// its gradient shard holds NaN/Inf, per matrix: its gradient does (matrices not checked by their
// group's shard)]. The ranks agree on a fingerprint when the sum of mix40 is W times mix40 of
// rank 0's value; every rank reads the same sums, so all reach the same verdict, and knowing
// rank 0's exact value each can say how its own differs.
struct CheckSlots {
  size_t matrices = 0;
  size_t fsdp_groups = 0;
  size_t param_groups = 0;
  size_t replica_groups = 0;  // FSDP groups on a replica-check step, else 0
  bool finite = false;

  static constexpr size_t changed() { return 0; }
  size_t has_grad(size_t m) const { return 1 + m; }
  size_t unreduced(size_t g) const { return 1 + matrices + g; }
  size_t option_mix(size_t pg, size_t k) const {
    return 1 + matrices + fsdp_groups + 2 * (kFingerprints * pg + k);
  }
  size_t option_of_rank0(size_t pg, size_t k) const { return option_mix(pg, k) + 1; }
  size_t replica_all(size_t g) const {
    return 1 + matrices + fsdp_groups + 2 * kFingerprints * param_groups + 2 * g;
  }
  size_t replica_zero(size_t g) const { return replica_all(g) + 1; }
  size_t size() const { return replica_all(replica_groups); }  // the host part
  size_t device_size() const { return finite ? fsdp_groups + matrices : 0; }
  size_t shard_not_finite(size_t g) const { return size() + g; }
  size_t matrix_not_finite(size_t m) const { return size() + fsdp_groups + m; }
};

}  // namespace

// One all-reduce before anything changes: every rank learns whether any rank's parameter groups
// were edited, whether any failed its checks, whether a ZeRO-1 group holds gradients that were
// never reduce-scattered, and which matrices have gradients everywhere.
StepRun FsdpMuon::Impl::agree_on_gradients(FsdpMuon& self) {
  const auto phase = timer->measure(&Stats::check_seconds);
  const size_t n = matrices.size();
  StepRun s;
  s.options.assign(self.param_groups_.size(), nullptr);
  bool changed = self.param_groups_.size() != frozen.size();
  for (size_t gi = 0; !changed && gi < self.param_groups_.size(); ++gi) {
    const auto& params = self.param_groups_[gi].params();
    changed = params.size() != frozen[gi].size();
    for (size_t i = 0; !changed && i < params.size(); ++i) {
      changed = params[i].unsafeGetTensorImpl() != frozen[gi][i];
    }
  }
  const NonFiniteGradients non_finite = config.non_finite_gradients();
  // Checked at construction, and every step with the options (it costs no byte more): a rank
  // stepping on another mesh, or in the other replica mode, would exchange with the wrong peers.
  const std::string mesh_mode =
      "mesh " + mesh.shape() + ", " + to_string(plan.replica_newton_schulz);
  const bool check_finite = non_finite != NonFiniteGradients::kIgnore;
  // Sized by what was constructed, so that every rank sums vectors of one size even when some
  // rank's parameter groups were edited.
  // Every N-th call on a mesh of several replicas (step_calls is alike on every rank).
  const int64_t every = config.check_replicas_every();
  const bool check_replicas = every > 0 && replicas() > 1 && step_calls % every == 0;
  std::vector<std::vector<uint64_t>> replica_hashes;
  const CheckSlots slot{n, groups.size(), frozen.size(), check_replicas ? groups.size() : 0,
                        check_finite};
  // This rank's view, summed over the ranks unless the loop guarantees agreement.
  const auto local_checks = [&](std::vector<int64_t>& mine) -> at::Tensor {
    mine[slot.changed()] = changed ? 1 : 0;
    if (changed) return at::Tensor();  // the checks below assume the constructed groups
    for (size_t gi = 0; gi < self.param_groups_.size(); ++gi) {
      s.options[gi] = &muon_options_of(self.param_groups_[gi], gi);
      s.options[gi]->validate();  // may have been edited
      FSDP_MUON_CHECK(
          s.options[gi]->matrix_layout() == frozen_layouts[gi],
          "the matrix_layout of parameter group ", gi, " is now ",
          s.options[gi]->matrix_layout().to_string(), " but the owner plan was made for ",
          frozen_layouts[gi].to_string(),
          " at construction (edited options, or a checkpoint saved with another layout); "
          "construct a new FsdpMuon with the layout you want");
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      mine[slot.unreduced(g)] = groups[g]->has_unreduced_gradients() ? 1 : 0;
    }
    for (size_t gi = 0; gi < s.options.size(); ++gi) {
      const auto values = option_values(*s.options[gi], mesh_mode);
      for (size_t k = 0; k < kFingerprints; ++k) {
        mine[slot.option_mix(gi, k)] = detail::mix40(values[k]);
        if (world_rank() == 0) {
          mine[slot.option_of_rank0(gi, k)] = static_cast<int64_t>(values[k]);
        }
      }
    }
    if (check_replicas) {
      replica_hashes = detail::shard_hashes(groups, *world_comm);
      for (size_t g = 0; g < groups.size(); ++g) {
        const auto [all, zero] = detail::replica_entries(replica_hashes[g], mesh.replica());
        mine[slot.replica_all(g)] = all;
        mine[slot.replica_zero(g)] = zero;
      }
    }
    std::vector<size_t> with_gradient;
    for (size_t m = 0; m < n; ++m) {
      const at::Tensor& p = matrices[m].sharded_parameter;
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      FSDP_MUON_CHECK(!g.is_sparse() && g.sizes() == p.sizes() && g.dtype() == p.dtype(),
                      "the gradient of '", matrices[m].name, "' has shape ", g.sizes(),
                      " and dtype ", g.dtype(), " but its shard is ", p.sizes(), " ", p.dtype(),
                      "; FsdpMuon expects the group's gradient-shard slice "
                      "(FsdpParameterGroup::reduce_scatter_grads())");
      mine[slot.has_grad(m)] = 1;
      with_gradient.push_back(m);
    }
    if (!check_finite) return at::Tensor();
    return non_finite_on_device(with_gradient);
  };
  std::vector<int64_t> sums(slot.size() + slot.device_size(), 0);
  if (config.check_gradient_agreement()) {
    count_sent(*world_comm, &CommStats::all_reduce_bytes, s.stats.check_bytes, [&] {
      try {
        sums = detail::agree_on_sum(*world_comm, slot.size(), slot.device_size(), local_checks);
      } catch (...) {
        // A rank that skipped a ZeRO-1 group's reduce_scatter_grads() meets the others' reduce-
        // scatter with this all-reduce: both wait out the timeout. Only this rank can tell why.
        std::string unreduced;
        for (const auto& group : groups) {
          if (!group->has_unreduced_gradients()) continue;
          unreduced += (unreduced.empty() ? "'" : ", '") + group->name() + "'";
        }
        TORCH_CHECK(unreduced.empty(), detail::current_exception_message(),
                    " (this rank holds gradients of FSDP group(s) ", unreduced,
                    " that were never reduce-scattered, sharding strategy optim: if the other "
                    "ranks called reduce_scatter_grads() for them, this rank missed the call and "
                    "they are waiting in it; call group->reduce_scatter_grads() after backward, "
                    "on every rank, for every group, before step())");
        throw;
      }
    });
  } else {
    // Every rank is taken to see what this one sees. Wrapping (unsigned) products: the option
    // slots hold raw 64-bit patterns that are never read on this path (UBSan found the overflow).
    const at::Tensor on_device = local_checks(sums);
    if (on_device.defined()) {
      const at::Tensor host = world_comm->to_host(on_device).contiguous();
      std::copy(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel(),
                sums.begin() + static_cast<int64_t>(slot.size()));
    }
    const auto w = static_cast<uint64_t>(world_comm->size());
    for (int64_t& count : sums) count = static_cast<int64_t>(static_cast<uint64_t>(count) * w);
  }
  const int w = world_comm->size();
  FSDP_MUON_CHECK(sums[slot.changed()] == 0,
                  "the parameter groups were changed after construction on ", sums[slot.changed()],
                  " of ", w, " rank(s)", changed ? " (this one included)" : "",
                  " — by add_param_group or add_parameters through the Optimizer base class, or by "
                  "editing param_groups(). The owner plan covers the parameters given to the "
                  "constructor; construct a new FsdpMuon instead");
  // The options checked at construction may have been changed since, on some ranks only (a
  // scheduler stepped on one rank): each rank would then apply its own update. Without the
  // agreement there is nothing to compare against (a rank sees only its own values).
  if (config.check_gradient_agreement()) {
    std::ostringstream differing;
    for (size_t gi = 0; gi < s.options.size(); ++gi) {
      const auto mine = option_values(*s.options[gi], mesh_mode);
      for (size_t k = 0; k < kFingerprints; ++k) {
        const uint64_t zero = static_cast<uint64_t>(sums[slot.option_of_rank0(gi, k)]);
        if (static_cast<uint64_t>(sums[slot.option_mix(gi, k)]) ==
            static_cast<uint64_t>(w) * static_cast<uint64_t>(detail::mix40(zero))) {
          continue;
        }
        differing << (differing.tellp() > 0 ? "; " : "");
        if (k < kScheduled) {
          double zero_value = 0;
          double my_value = 0;
          std::memcpy(&zero_value, &zero, sizeof zero_value);
          std::memcpy(&my_value, &mine[k], sizeof my_value);
          differing << kScheduledNames[k] << " of parameter group " << gi << " (rank 0 has "
                    << detail::exact_double(zero_value) << ", this rank has "
                    << detail::exact_double(my_value) << ")";
        } else {
          differing << "another option of parameter group " << gi
                    << " (not lr, momentum or weight_decay; this rank's options "
                    << (mine[k] == zero ? "equal rank 0's" : "differ from rank 0's")
                    << "), or the mesh or replica mode (this rank: " << mesh_mode << ")";
        }
      }
    }
    FSDP_MUON_CHECK(
        differing.tellp() == 0, "the optimizer options differ across ranks at step() call ",
        step_calls, ": ", differing.str(),
        ". They were changed after construction on some ranks only, or to different values "
        "(a learning-rate scheduler stepped on some ranks, param_groups() edited on one), "
        "and each rank would apply its own update. Change them alike on every rank (step "
        "every scheduler on every rank). Nothing was changed");
  }
  // docs/DESIGN.md §3, "Replica check": the sums say whether some replica differs; only then do
  // the per-parameter hashes travel, to name it.
  for (size_t g = 0; check_replicas && g < groups.size(); ++g) {
    if (static_cast<uint64_t>(sums[slot.replica_all(g)]) !=
        static_cast<uint64_t>(replicas()) * static_cast<uint64_t>(sums[slot.replica_zero(g)])) {
      detail::throw_replica_divergence(groups, mesh, replica_hashes, step_calls);
    }
  }
  // ZeRO-1 keeps a backward's gradients in the full buffers until reduce_scatter_grads(): a step
  // now would read the gradient shards of an earlier step (or zeros) and train on nothing.
  std::ostringstream unreduced;
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t ranks = sums[slot.unreduced(g)];
    if (ranks == 0) continue;
    unreduced << (unreduced.tellp() > 0 ? ", " : "")
              << (groups[g]->name().empty() ? "#" + std::to_string(g)
                                            : "'" + groups[g]->name() + "'")
              << " on " << ranks << " of " << w << " rank(s)";
  }
  FSDP_MUON_CHECK(
      unreduced.tellp() == 0,
      "a backward wrote gradients that were never reduce-scattered "
      "into the gradient shards of FSDP group(s) ",
      unreduced.str(),
      " (sharding strategy optim, ZeRO-1, where the full gradients stay in the group until "
      "then); call group->reduce_scatter_grads() after backward, on every rank, for "
      "every group, before step(). Nothing was changed");
  std::ostringstream disagree;
  int64_t disagreements = 0;
  s.active.assign(n, false);
  for (size_t m = 0; m < n; ++m) {
    const int64_t holders = sums[slot.has_grad(m)];
    s.active[m] = holders == w;
    if (holders == 0 || holders == w || disagreements++ >= 8) continue;
    const bool here = matrices[m].sharded_parameter.grad().defined();
    disagree << (disagreements > 1 ? ", " : "") << "'" << matrices[m].name << "' on " << holders
             << " of " << w << " ranks (this rank: " << (here ? "yes" : "no") << ")";
  }
  FSDP_MUON_CHECK(
      disagreements == 0, "ranks disagree on which parameters have gradients (", disagreements,
      " parameter(s)): ", disagree.str(),
      ". Every rank must produce the same set of gradients (run backward on every rank, "
      "then FsdpParameterGroup::reduce_scatter_grads() on every rank)");
  s.stats.active_parameters = std::count(s.active.begin(), s.active.end(), true);
  if (check_finite) {
    std::vector<int64_t> non_finite_ranks(n);
    for (size_t m = 0; m < n; ++m) non_finite_ranks[m] = sums[slot.matrix_not_finite(m)];
    // A gradient shard with NaN or Inf on some rank: which of its group's matrices, on how many
    // ranks (the rest of a shard may be another optimizer's parameters). A second all-reduce and
    // wait, on such steps only; every rank read the same sums, so all take part.
    std::vector<size_t> again;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (sums[slot.shard_not_finite(g)] == 0) continue;
      again.insert(again.end(), group_matrices[g].begin(), group_matrices[g].end());
    }
    if (!again.empty()) {
      const auto each = [&](std::vector<int64_t>&) { return matrices_not_finite(again); };
      std::vector<int64_t> counts(again.size(), 0);
      if (config.check_gradient_agreement()) {
        count_sent(*world_comm, &CommStats::all_reduce_bytes, s.stats.check_bytes,
                   [&] { counts = detail::agree_on_sum(*world_comm, 0, again.size(), each); });
      } else {
        const at::Tensor host = world_comm->to_host(matrices_not_finite(again)).contiguous();
        for (size_t k = 0; k < again.size(); ++k) counts[k] = host.data_ptr<int64_t>()[k] * w;
      }
      for (size_t k = 0; k < again.size(); ++k) non_finite_ranks[again[k]] = counts[k];
    }
    reject_non_finite(non_finite_ranks, s);
  }
  return s;
}

// 1 where `flags[k]` (a boolean on the device) is set, at `slots[k]` of `size` int64 values on the
// device, 0 elsewhere: the flags stacked with one shared zero over the span of slots they cover,
// zeros around it; a handful of kernels whatever the size, no index moved to the device, nothing
// that waits.
at::Tensor FsdpMuon::Impl::flags_on_device(int64_t size, const std::vector<int64_t>& slots,
                                           const std::vector<at::Tensor>& flags) const {
  const auto on_device = at::TensorOptions().device(world_comm->device());
  if (flags.empty()) return at::zeros({size}, on_device.dtype(at::kLong));
  const int64_t first = *std::min_element(slots.begin(), slots.end());
  const int64_t last = *std::max_element(slots.begin(), slots.end());
  const at::Tensor zero = at::zeros({}, on_device.dtype(at::kBool));
  std::vector<at::Tensor> span(static_cast<size_t>(last - first + 1), zero);
  for (size_t k = 0; k < slots.size(); ++k) span[static_cast<size_t>(slots[k] - first)] = flags[k];
  return at::cat({at::zeros({first}, on_device.dtype(at::kBool)), at::stack(span),
                  at::zeros({size - last - 1}, on_device.dtype(at::kBool))})
      .to(at::kLong);
}

// This rank's part of the agreement's device slots (CheckSlots): a group whose matrices'
// gradients all lie in its gradient shard (reduce_scatter_grads() puts them there) is checked by
// one reduction over the shard; the matrices of any other group one by one (docs/DESIGN.md §4,
// "Kernels per step"). Nothing waits here: the agreement's one wait brings the flags.
at::Tensor FsdpMuon::Impl::non_finite_on_device(const std::vector<size_t>& with_gradient) {
  const size_t n = matrices.size();
  std::vector<bool> has(groups.size(), false);
  std::vector<bool> in_shard(groups.size(), true);
  for (size_t m : with_gradient) {
    const size_t g = matrices[m].group_ordinal;
    has[g] = true;
    in_shard[g] = in_shard[g] && matrices[m].sharded_parameter.grad().storage().is_alias_of(
                                     groups[g]->grad_shard().storage());
  }
  std::vector<int64_t> slots;
  std::vector<at::Tensor> flags;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!has[g] || !in_shard[g]) continue;
    slots.push_back(static_cast<int64_t>(g));
    flags.push_back(at::isfinite(groups[g]->grad_shard()).all().logical_not());
  }
  for (size_t m : with_gradient) {
    if (in_shard[matrices[m].group_ordinal]) continue;
    slots.push_back(static_cast<int64_t>(groups.size() + m));
    flags.push_back(not_finite(m));
  }
  return flags_on_device(static_cast<int64_t>(groups.size() + n), slots, flags);
}

// [k] 1 where this rank's piece of the gradient of matrix `which[k]` holds NaN or Inf.
at::Tensor FsdpMuon::Impl::matrices_not_finite(const std::vector<size_t>& which) {
  std::vector<int64_t> slots;
  std::vector<at::Tensor> flags;
  for (size_t k = 0; k < which.size(); ++k) {
    if (!matrices[which[k]].sharded_parameter.grad().defined()) continue;
    slots.push_back(static_cast<int64_t>(k));
    flags.push_back(not_finite(which[k]));
  }
  return flags_on_device(static_cast<int64_t>(which.size()), slots, flags);
}

at::Tensor FsdpMuon::Impl::not_finite(size_t m) {
  const at::Tensor& grad = matrices[m].sharded_parameter.grad();
  return at::isfinite(grad_pieces.get(m, grad, local_piece[m].first, local_piece[m].second))
      .all()
      .logical_not();
}

// Applies NonFiniteGradients to the agreed counts of ranks that saw NaN or Inf per matrix.
void FsdpMuon::Impl::reject_non_finite(const std::vector<int64_t>& ranks_per_matrix, StepRun& s) {
  const size_t n = matrices.size();
  std::ostringstream names;
  std::ostringstream first;  // the first such parameter, for kSkipStep's one-line warning
  for (size_t m = 0; m < n; ++m) {
    const int64_t ranks = ranks_per_matrix[m];
    if (ranks == 0) continue;
    if (s.stats.non_finite_parameters == 0) {
      first << "'" << matrices[m].name << "' on " << ranks << " of " << world_comm->size()
            << " rank(s)";
    }
    if (s.stats.non_finite_parameters++ < 8) {
      names << (s.stats.non_finite_parameters > 1 ? ", " : "") << "'" << matrices[m].name << "' on "
            << ranks << " of " << world_comm->size() << " rank(s)";
    }
  }
  if (s.stats.non_finite_parameters == 0) return;
  FSDP_MUON_CHECK(
      config.non_finite_gradients() != NonFiniteGradients::kThrow,
      "non-finite gradients (NaN or Inf) in ", s.stats.non_finite_parameters,
      " parameter(s): ", names.str(),
      ". FsdpMuonConfig().non_finite_gradients(NonFiniteGradients::kSkipStep) skips such "
      "steps instead");
  // kSkipStep: no matrix is active, so nothing moves or changes; the groups are still refreshed.
  s.active.assign(n, false);
  s.stats.skipped = true;
  ++skipped_steps;
  // Never silent, and one line per skipped step from one rank: every rank knows the same counts.
  if (world_rank() == 0) {
    FSDP_MUON_WARN("skipped step ", step_calls, " (step() calls since construction; ",
                   skipped_steps, " skipped so far): NaN or Inf in the gradient of ", first.str(),
                   s.stats.non_finite_parameters > 1
                       ? " and " + std::to_string(s.stats.non_finite_parameters - 1) + " more"
                       : std::string(),
                   "; FsdpMuon's weights and momentum are unchanged "
                   "(FsdpMuonConfig::non_finite_gradients)");
  }
}

// Each active parameter's state, created on its first step and its step counted once, before
// any round runs: a parameter's matrices may sit in different rounds (docs/DESIGN.md §3).
void FsdpMuon::Impl::advance_states(FsdpMuon& self, const StepRun& s) {
  for (size_t m = 0; m < matrices.size(); ++m) {
    if (s.active[m] && matrices[m].block == 0) {
      const FsdpMuonMatrix& mat = matrices[m];
      MuonParamState& state = detail::advance_muon_state(self.state_, mat.sharded_parameter);
      // NorMuon: the parameter's rows that start in this rank's elements, [0] where none do, so
      // that every rank saves the same state keys (docs/DESIGN.md §3).
      const auto [first, last] =
          detail::rows_starting_in(mat.group->held_range(mat.index, shard_rank()), mat.cols);
      detail::muon_row_state(state, mat.sharded_parameter, last - first, s.options_of(mat));
    }
  }
}

// Weight decay, momentum and the Nesterov input on each local shard of the round's matrices;
// owners keep theirs, the rest is packed into the gather's send buffer, each piece followed by
// this rank's rows of the NorMuon state where it travels (docs/DESIGN.md §3).
RoundInFlight FsdpMuon::Impl::momentum_inputs(FsdpMuon& self, size_t round, const StepRun& s) {
  const auto phase = timer->measure(&Stats::elementwise_seconds);
  const int me = rank();
  const int holder = shard_rank();
  const auto& mine = round_matrices[round];
  RoundInFlight f;
  f.round = round;
  f.active.resize(mine.size());
  f.with_rows.resize(mine.size());
  for (size_t j = 0; j < mine.size(); ++j) {
    f.active[j] = s.active[mine[j]];
    f.with_rows[j] =
        f.active[j] && detail::update_rule(s.options_of(matrices[mine[j]])).per_row_state;
  }
  const ExchangeLayout& x = exchange(round, f.active, f.with_rows);
  f.own.resize(mine.size());
  f.full.resize(mine.size());
  f.row_state.resize(mine.size());
  f.variance.resize(mine.size());
  const size_t group = mine.empty() ? 0 : matrices[mine.front()].group_ordinal;
  f.send = at::empty({x.gather.send_numel}, groups[group]->main_weight_shard().options());
  // The round's pieces by optimizer group, each group's pieces one list for the multi-tensor
  // math (docs/DESIGN.md §4, "Kernels per step").
  std::vector<const MuonOptions*> option_sets;
  std::vector<std::vector<size_t>> pieces_of;  // [option set] -> positions j
  for (size_t j = 0; j < mine.size(); ++j) {
    if (!f.active[j] || local_piece[mine[j]].second == 0) continue;  // none of it here
    const MuonOptions* options = &s.options_of(matrices[mine[j]]);
    const auto o = static_cast<size_t>(std::find(option_sets.begin(), option_sets.end(), options) -
                                       option_sets.begin());
    if (o == option_sets.size()) {
      option_sets.push_back(options);
      pieces_of.emplace_back();
    }
    pieces_of[o].push_back(j);
  }
  std::vector<std::pair<int64_t, int64_t>> send_ranges;
  std::vector<at::Tensor> sent;
  for (size_t o = 0; o < option_sets.size(); ++o) {
    std::vector<at::Tensor> params, grads, buffers;
    for (size_t j : pieces_of[o]) {
      const size_t m = mine[j];
      const at::Tensor& p = matrices[m].sharded_parameter;
      const auto [first, length] = local_piece[m];
      auto& state =
          static_cast<MuonParamState&>(*self.state_.at(p.unsafeGetTensorImpl()));  // advance_states
      params.push_back(param_pieces.get(m, p, first, length));
      grads.push_back(grad_pieces.get(m, p.grad(), first, length));
      buffers.push_back(momentum_pieces.get(m, state.momentum_buffer(), first, length));
    }
    // They round once per element, so pieces give the whole parameter's bits (muon_math.h). A
    // holder in another replica than the owner's advances its momentum alike and sends nothing:
    // the owner's replica holds the same bits (docs/DESIGN.md §3).
    std::vector<at::Tensor> u =
        detail::muon_momentum_inputs(params, grads, buffers, *option_sets[o]);
    for (size_t k = 0; k < pieces_of[o].size(); ++k) {
      const size_t j = pieces_of[o][k];
      if (matrices[mine[j]].owner == me) {
        f.own[j] = std::move(u[k]);
      } else if (x.gather_send_offset[j] >= 0) {
        send_ranges.emplace_back(x.gather_send_offset[j], u[k].numel());
        sent.push_back(std::move(u[k]));
      }
    }
  }
  // Per-row state (the rule's, docs/DESIGN.md §3): each sent piece is followed by this rank's
  // rows of it (the state holds the parameter's rows starting in this rank's elements, the
  // block's start at row offset / cols of the parameter), in the same copy.
  for (size_t j = 0; j < mine.size(); ++j) {
    if (!f.with_rows[j] || local_piece[mine[j]].second == 0) continue;
    const size_t m = mine[j];
    const FsdpMuonMatrix& mat = matrices[m];
    const auto& state =
        static_cast<MuonParamState&>(*self.state_.at(mat.sharded_parameter.unsafeGetTensorImpl()));
    const auto block_rows = round_placement[round][j].held_rows(holder);
    const int64_t first_row =
        detail::rows_starting_in(mat.group->held_range(mat.index, holder), mat.cols).first;
    f.row_state[j] = row_pieces.get(m, state.normuon_variance(),
                                    mat.offset / mat.cols + block_rows.first - first_row,
                                    block_rows.second - block_rows.first);
    if (mat.owner != me && x.gather_send_offset[j] >= 0 && f.row_state[j].numel() > 0) {
      send_ranges.emplace_back(x.gather_send_offset[j] + local_piece[m].second,
                               f.row_state[j].numel());
      sent.push_back(f.row_state[j]);
    }
  }
  if (!sent.empty()) at::_foreach_copy_(detail::slices_of(f.send, send_ranges), sent);
  return f;
}

// One all-to-all-v for the round (skipped when nothing moves), started without waiting.
void FsdpMuon::Impl::start_gather(RoundInFlight& f, StepRun& s) {
  const auto phase = timer->measure(&Stats::gather_seconds);
  const ExchangeLayout& x = exchange(f.round, f.active, f.with_rows);
  f.recv = at::empty({x.gather.recv_numel}, f.send.options());
  if (x.gather_moves) {
    int64_t sent = 0;
    count_sent(*exchange_comm, &CommStats::all_to_all_v_bytes, sent, [&] {
      f.work = exchange_comm->all_to_all_v_async(f.send, x.gather.send_counts, f.recv,
                                                 x.gather.recv_counts);
    });
    // The gather stays inside the owner's replica: all of it is intra-node.
    s.stats.gather_bytes += sent;
    s.stats.gather_intra_node_bytes += sent;
  }
}

// Waits for the round's gather, then each owner assembles its full matrices: grouped into the
// batches Newton–Schulz will run (docs/DESIGN.md §4, "Batching"), back to back in one buffer per
// round, every piece put in place by one multi-tensor copy (§4, "Kernels per step").
void FsdpMuon::Impl::assemble_owned(RoundInFlight& f, StepRun& s) {
  const auto phase = timer->measure(&Stats::gather_seconds);
  if (f.work) {
    f.work->wait();
    f.work.reset();
  }
  const int me = rank();
  const ExchangeLayout& x = exchange(f.round, f.active, f.with_rows);
  const auto& where_all = round_placement[f.round];
  const auto& mine = round_matrices[f.round];
  // Bounds a batch's Newton–Schulz workspace (2^25 elements: 128 MiB fp32).
  constexpr int64_t kMaxBatchElements = int64_t{1} << 25;
  // Batches in order of their first matrix; the key keeps apart what one call cannot share.
  using Key = std::tuple<int64_t, int64_t, c10::ScalarType, size_t>;  // rows, cols, dtype, group
  std::map<Key, size_t> open_batch;  // key -> index in f.batches of the batch still filling
  const NewtonSchulzBatching mode = config.batch_newton_schulz();
  for (size_t j = 0; j < where_all.size(); ++j) {
    if (!f.active[j] || where_all[j].owner != me) continue;
    const FsdpMuonMatrix& mat = matrices[mine[j]];
    const MuonOptions& options = s.options_of(mat);
    const bool batch = detail::batches_newton_schulz(mode, f.send.device(),
                                                     options.newton_schulz().compute_dtype(),
                                                     frozen_layouts[mat.param_group].kind());
    const Key key{mat.rows, mat.cols, f.send.scalar_type(), mat.param_group};
    auto open = batch ? open_batch.find(key) : open_batch.end();
    if (open != open_batch.end() &&
        static_cast<int64_t>(f.batches[open->second].matrices.size() + 1) * mat.rows * mat.cols <=
            kMaxBatchElements) {
      f.batches[open->second].matrices.push_back(j);
      continue;
    }
    if (batch) open_batch[key] = f.batches.size();
    f.batches.push_back(detail::OwnedBatch{{j}, 0, 0, mat.rows, mat.cols, &options});
  }
  // Each batch starts where a fresh allocation would (512 bytes: the CUDA caching allocator's
  // granule, a multiple of the CPU allocator's 64), so Newton–Schulz reads its input at the
  // alignment single-device Muon's has (CUDA kernels may pick another reduction order on other
  // alignments).
  const int64_t align = std::max<int64_t>(1, 512 / static_cast<int64_t>(f.send.element_size()));
  int64_t total = 0;
  std::vector<std::pair<int64_t, int64_t>> matrix_ranges, held_ranges, recv_ranges;
  std::vector<std::pair<size_t, int>> held_of;  // (j, h) of each held range
  // Per-row state: one buffer too, batch by batch, so a batch's is one [batch, rows] view.
  int64_t rows_total = 0;
  std::vector<std::pair<int64_t, int64_t>> row_ranges, held_row_ranges;
  std::vector<std::pair<size_t, int>> held_rows_of;  // (j, h) of each held row range
  for (detail::OwnedBatch& batch : f.batches) {
    total = (total + align - 1) / align * align;
    batch.offset = total;
    batch.row_offset = rows_total;
    for (size_t j : batch.matrices) {
      if (f.with_rows[j]) {
        const MatrixPlacement& where = where_all[j];
        row_ranges.emplace_back(rows_total, where.numel() / where.cols);
        for (int h = 0; h < shard_size; ++h) {
          if (where.held_rows_numel(h) == 0) continue;
          held_rows_of.emplace_back(j, h);
          held_row_ranges.emplace_back(rows_total + where.held_rows(h).first,
                                       where.held_rows_numel(h));
        }
        rows_total += where.numel() / where.cols;
      }
      const MatrixPlacement& where = where_all[j];
      matrix_ranges.emplace_back(total, where.numel());
      for (int h = 0; h < shard_size; ++h) {
        if (where.held_numel(h) == 0) continue;
        held_of.emplace_back(j, h);
        held_ranges.emplace_back(total + where.held[h].first, where.held_numel(h));
      }
      total += where.numel();
      f.full_bytes += where.numel() * static_cast<int64_t>(f.send.element_size());
    }
  }
  if (f.batches.empty()) return;
  f.owned = at::empty({total}, f.send.options());
  const std::vector<at::Tensor> fulls = detail::slices_of(f.owned, matrix_ranges);
  const std::vector<at::Tensor> held = detail::slices_of(f.owned, held_ranges);
  f.held_piece.assign(where_all.size(), std::vector<at::Tensor>(shard_size));
  size_t next_full = 0;
  for (const detail::OwnedBatch& batch : f.batches) {
    for (size_t j : batch.matrices) f.full[j] = fulls[next_full++];
  }
  std::vector<at::Tensor> held_rows;
  if (rows_total > 0) {
    f.owned_rows = at::empty({rows_total}, f.send.options());
    const std::vector<at::Tensor> variances = detail::slices_of(f.owned_rows, row_ranges);
    size_t next_rows = 0;
    for (const detail::OwnedBatch& batch : f.batches) {
      for (size_t j : batch.matrices) {
        if (f.with_rows[j]) f.variance[j] = variances[next_rows++];
      }
    }
    held_rows = detail::slices_of(f.owned_rows, held_row_ranges);
    f.held_rows.assign(where_all.size(), std::vector<at::Tensor>(shard_size));
  }
  // From the shard ranks of the owner's replica: exchange ranks first..first + shard_size.
  const int first = me - shard_rank();
  std::vector<at::Tensor> destinations, sources;
  std::vector<at::Tensor> received_into;
  for (size_t i = 0; i < held_of.size(); ++i) {
    const auto [j, h] = held_of[i];
    f.held_piece[j][h] = held[i];
    const int q = first + h;
    if (q == me) {
      destinations.push_back(held[i]);
      sources.push_back(f.own[j]);
    } else {
      received_into.push_back(held[i]);
      recv_ranges.emplace_back(x.gather_recv_offset[j][q], held_ranges[i].second);
    }
  }
  // The whole per-row state of each owned matrix, from its holders' rows (after their pieces).
  for (size_t i = 0; i < held_rows_of.size(); ++i) {
    const auto [j, h] = held_rows_of[i];
    f.held_rows[j][h] = held_rows[i];
    const int q = first + h;
    if (q == me) {
      destinations.push_back(held_rows[i]);
      sources.push_back(f.row_state[j]);
    } else {
      received_into.push_back(held_rows[i]);
      recv_ranges.emplace_back(x.gather_recv_offset[j][q] + where_all[j].held_numel(h),
                               held_row_ranges[i].second);
    }
  }
  const std::vector<at::Tensor> received = detail::slices_of(f.recv, recv_ranges);
  destinations.insert(destinations.end(), received_into.begin(), received_into.end());
  sources.insert(sources.end(), received.begin(), received.end());
  if (!destinations.empty()) at::_foreach_copy_(destinations, sources);
  for (size_t j = 0; j < where_all.size(); ++j) f.own[j] = at::Tensor();
  live_full_bytes += f.full_bytes;
  s.stats.max_transient_bytes = std::max(s.stats.max_transient_bytes, live_full_bytes);
}

// Newton–Schulz and the scale on each batch of full matrices this rank owns in the round, in
// place. Same-shape matrices of one optimizer group share a batch where
// FsdpMuonConfig::batch_newton_schulz allows it (docs/DESIGN.md §4, "Batching").
void FsdpMuon::Impl::orthogonalize_owned(RoundInFlight& f, StepRun& s) {
  const auto phase = timer->measure(&Stats::orthogonalize_seconds);
  for (const detail::OwnedBatch& batch : f.batches) {
    const MuonOptions& options = *batch.options;
    const auto count = static_cast<int64_t>(batch.matrices.size());
    s.stats.orthogonalized_matrices += count;
    ++s.stats.newton_schulz_calls;
    if (count == 1) {
      const size_t j = batch.matrices.front();
      const at::Tensor u = f.full[j].view({batch.rows, batch.cols});
      u.copy_(detail::muon_orthogonalized_update(u, options, f.variance[j]));
      continue;
    }
    const at::Tensor inputs = f.owned.narrow(0, batch.offset, count * batch.rows * batch.cols)
                                  .view({count, batch.rows, batch.cols});
    // One optimizer group per batch, so either every matrix has per-row state or none has;
    // the batch's is one [batch, rows] view, updated in place.
    const at::Tensor variance =
        f.with_rows[batch.matrices.front()]
            ? f.owned_rows.narrow(0, batch.row_offset, count * batch.rows).view({count, batch.rows})
            : at::Tensor();
    inputs.copy_(detail::muon_orthogonalized_update(inputs, options, variance));
  }
}

// Each owner packs every holder's slice of the update and the scatter's all-to-all-v starts. One
// replica, or the relay's stage A: the gather's buffers, roles swapped. Across replicas the
// owner also sends to the holders in the other replicas, so the scatter has buffers of its own
// (docs/DESIGN.md §3).
void FsdpMuon::Impl::start_scatter(RoundInFlight& f, StepRun& s) {
  const auto phase = timer->measure(&Stats::scatter_seconds);
  const int me = rank();
  const ExchangeLayout& x = exchange(f.round, f.active, f.with_rows);
  if (x.mirrored) {
    f.scatter_send = f.recv;
    f.scatter_recv = f.send;
  } else {
    f.scatter_send = at::empty({x.scatter.send_numel}, f.send.options());
    f.scatter_recv = at::empty({x.scatter.recv_numel}, f.send.options());
  }
  const auto& where_all = round_placement[f.round];
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<at::Tensor> sources;
  for (size_t j = 0; j < where_all.size(); ++j) {
    if (!f.full[j].defined()) continue;
    const MatrixPlacement& where = where_all[j];
    for (int q = 0; q < world(); ++q) {
      const int h = q % shard_size;  // the shard rank of exchange rank q
      const int64_t len = where.held_numel(h);
      // The relay's stage A sends to the owner's replica only (offset -1 elsewhere).
      if (q == me || len == 0 || x.scatter_send_offset[j][q] < 0) continue;
      ranges.emplace_back(x.scatter_send_offset[j][q], len);
      sources.push_back(f.held_piece[j][h]);
      const int64_t rows = f.with_rows[j] ? where.held_rows_numel(h) : 0;
      if (rows == 0) continue;
      ranges.emplace_back(x.scatter_send_offset[j][q] + len, rows);
      sources.push_back(f.held_rows[j][h]);
    }
  }
  if (!sources.empty()) at::_foreach_copy_(detail::slices_of(f.scatter_send, ranges), sources);
  if (x.scatter_moves) {
    int64_t sent = 0;
    count_sent(*exchange_comm, &CommStats::all_to_all_v_bytes, sent, [&] {
      f.work = exchange_comm->all_to_all_v_async(f.scatter_send, x.scatter.send_counts,
                                                 f.scatter_recv, x.scatter.recv_counts);
    });
    const int64_t inter = x.scatter_inter_replica_numel(me) * f.scatter_send.element_size();
    s.stats.scatter_bytes += sent;
    s.stats.scatter_inter_node_bytes += inter;
    s.stats.scatter_intra_node_bytes += sent - inter;
  }
}

// kOncePerWorldRelay's stage B (docs/DESIGN.md §3), once the round's stage A has arrived: this
// rank's pieces of the round's matrices owned in its replica (received in stage A, or its own)
// go, in one all-gather-v over its replicate group, to its shard rank in every replica; it
// receives those of the matrices owned in the others. The per-row state rides after each piece.
void FsdpMuon::Impl::relay_updates(RoundInFlight& f, StepRun& s) {
  const auto phase = timer->measure(&Stats::scatter_seconds);
  const ExchangeLayout& x = exchange(f.round, f.active, f.with_rows);
  const detail::RelayLayout& r = x.relay;
  if (!r.moves) return;
  const int me = rank();
  const int holder = shard_rank();
  const auto& mine = round_matrices[f.round];
  const at::Tensor send = at::empty({r.send_numel}, f.send.options());
  std::vector<std::pair<int64_t, int64_t>> ranges, received_ranges;
  std::vector<at::Tensor> sources;
  std::vector<size_t> from_scatter;  // positions in `sources` cut from scatter_recv
  for (size_t j = 0; j < mine.size(); ++j) {
    if (r.send_offset[j] < 0) continue;
    const int64_t len = local_piece[mine[j]].second;
    const int64_t rows = f.with_rows[j] ? round_placement[f.round][j].held_rows_numel(holder) : 0;
    if (matrices[mine[j]].owner == me) {
      ranges.emplace_back(r.send_offset[j], len);
      sources.push_back(f.held_piece[j][holder]);
      if (rows == 0) continue;
      ranges.emplace_back(r.send_offset[j] + len, rows);
      sources.push_back(f.held_rows[j][holder]);
    } else {
      // Stage A's piece: the update slice and the rows, back to back.
      ranges.emplace_back(r.send_offset[j], len + rows);
      from_scatter.push_back(sources.size());
      received_ranges.emplace_back(x.scatter_recv_offset[j], len + rows);
      sources.emplace_back();
    }
  }
  const std::vector<at::Tensor> received = detail::slices_of(f.scatter_recv, received_ranges);
  for (size_t i = 0; i < from_scatter.size(); ++i) sources[from_scatter[i]] = received[i];
  if (!sources.empty()) at::_foreach_copy_(detail::slices_of(send, ranges), sources);
  f.relay_recv = at::empty({r.recv_numel}, f.send.options());
  int64_t sent = 0;
  count_sent(*mesh.replicate, &CommStats::all_gather_v_bytes, sent,
             [&] { mesh.replicate->all_gather_v(send, f.relay_recv, r.recv_counts); });
  // All of it goes to the other replicas.
  s.stats.scatter_bytes += sent;
  s.stats.scatter_inter_node_bytes += sent;
}

// Waits for the round's scatter (and, relayed, runs stage B), then param <- param - lr * update
// on each local shard, and each holder takes back its rows of the NorMuon state.
void FsdpMuon::Impl::apply_updates(RoundInFlight& f, StepRun& s) {
  if (f.work) {
    const auto phase = timer->measure(&Stats::scatter_seconds);
    f.work->wait();
    f.work.reset();
  }
  const bool relayed = relays();
  if (relayed) relay_updates(f, s);
  // Where a piece this rank does not own arrives: stage B's buffer when relayed (every
  // replica's block, this one's included), else the scatter's.
  const at::Tensor& arrived = relayed ? f.relay_recv : f.scatter_recv;
  const auto arrived_at = [&](const ExchangeLayout& x, size_t j) {
    return relayed ? x.relay.recv_offset[j] : x.scatter_recv_offset[j];
  };
  const auto phase = timer->measure(&Stats::apply_seconds);
  const int me = rank();
  const int holder = shard_rank();
  const ExchangeLayout& x = exchange(f.round, f.active, f.with_rows);
  const auto& mine = round_matrices[f.round];
  // Each optimizer group's pieces in one list (docs/DESIGN.md §4, "Kernels per step").
  std::vector<const MuonOptions*> option_sets;
  std::vector<std::vector<at::Tensor>> params, updates;
  std::vector<std::pair<size_t, size_t>> received;  // (option set, position in its lists)
  std::vector<std::pair<int64_t, int64_t>> recv_ranges;
  for (size_t j = 0; j < mine.size(); ++j) {
    const size_t m = mine[j];
    const auto [first, len] = local_piece[m];
    if (!f.active[j] || len == 0) continue;
    const FsdpMuonMatrix& mat = matrices[m];
    const MuonOptions* options = &s.options_of(mat);
    const auto o = static_cast<size_t>(std::find(option_sets.begin(), option_sets.end(), options) -
                                       option_sets.begin());
    if (o == option_sets.size()) {
      option_sets.push_back(options);
      params.emplace_back();
      updates.emplace_back();
    }
    params[o].push_back(param_pieces.get(m, mat.sharded_parameter, first, len));
    if (mat.owner == me) {
      updates[o].push_back(f.held_piece[j][holder]);
    } else {
      received.emplace_back(o, updates[o].size());
      recv_ranges.emplace_back(arrived_at(x, j), len);
      updates[o].emplace_back();
    }
  }
  const std::vector<at::Tensor> pieces = detail::slices_of(arrived, recv_ranges);
  for (size_t i = 0; i < received.size(); ++i) {
    updates[received[i].first][received[i].second] = pieces[i];
  }
  for (size_t o = 0; o < option_sets.size(); ++o) {
    detail::muon_apply_updates(params[o], updates[o], *option_sets[o]);
  }
  // Each holder takes back its rows of the per-row state, in one copy.
  std::vector<at::Tensor> row_states, row_sources;
  std::vector<std::pair<int64_t, int64_t>> row_ranges;
  std::vector<size_t> row_from_recv;  // positions in row_sources filled from scatter_recv
  for (size_t j = 0; j < mine.size(); ++j) {
    const int64_t len = local_piece[mine[j]].second;
    const int64_t rows = f.active[j] && f.with_rows[j] && len > 0 ? f.row_state[j].numel() : 0;
    if (rows == 0) continue;
    row_states.push_back(f.row_state[j]);
    if (matrices[mine[j]].owner == me) {
      row_sources.push_back(f.held_rows[j][holder]);
    } else {
      row_from_recv.push_back(row_sources.size());
      row_ranges.emplace_back(arrived_at(x, j) + len, rows);
      row_sources.emplace_back();
    }
  }
  const std::vector<at::Tensor> received_rows = detail::slices_of(arrived, row_ranges);
  for (size_t i = 0; i < row_from_recv.size(); ++i)
    row_sources[row_from_recv[i]] = received_rows[i];
  if (!row_states.empty()) at::_foreach_copy_(row_states, row_sources);
  live_full_bytes -= f.full_bytes;
  f = RoundInFlight{};
}

// The group's model weights are refreshed every step, whether or not its matrices had
// gradients, since another optimizer may just have stepped the group's other parameters.
void FsdpMuon::Impl::refresh(size_t group, StepRun& s) {
  const auto phase = timer->measure(&Stats::refresh_seconds);
  count_sent(*groups[group]->communicator(), &CommStats::all_gather_bytes, s.stats.refresh_bytes,
             [&] { groups[group]->refresh_model_weights(); });
}

}  // namespace fsdp_muon
