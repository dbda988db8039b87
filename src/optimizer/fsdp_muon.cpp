#include <fsdp_muon/optimizer/fsdp_muon.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/fsdp/parameter_group.h>

#include "muon/muon_math.h"

namespace fsdp_muon {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

MuonOptions& muon_options_of(torch::optim::OptimizerParamGroup& group, size_t index) {
  auto* options = dynamic_cast<MuonOptions*>(&group.options());
  TORCH_CHECK(options != nullptr, "FsdpMuon: parameter group ", index,
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

// FNV-1a: a stable hash (std::hash may differ between builds of the ranks' binaries).
int64_t fingerprint(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

std::string what(const c10::Error& e) { return e.what_without_backtrace(); }

std::string abbreviate(const std::string& text) {
  constexpr size_t kMax = 2000;
  return text.size() <= kMax ? text : text.substr(0, kMax) + " ...";
}

}  // namespace

struct FsdpMuon::Impl {
  FsdpMuonConfig config;
  std::shared_ptr<Communicator> comm;
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups;
  std::vector<FsdpMuonMatrix> matrices;
  std::vector<std::vector<size_t>> group_matrices;  // [group ordinal] -> indices into matrices
  std::vector<std::vector<std::pair<int64_t, int64_t>>> held;  // [matrix][rank]
  std::unordered_map<const c10::TensorImpl*, size_t> matrix_of;
  OwnerPlan plan;
  std::vector<std::pair<size_t, size_t>> windows;
  // Parameter identities per optimizer group as constructed: step() compares against them.
  std::vector<std::vector<const c10::TensorImpl*>> frozen;
  FsdpMuonStepStats stats;

  // Offsets of one group's gather (and, mirrored, scatter) for one set of active matrices.
  // Gather: this rank's block for owner d holds its pieces of d's matrices in group order; the
  // owner's receive block from holder s likewise. The scatter sends the same blocks back, so it
  // reuses both buffers with the roles swapped.
  struct Exchange {
    std::vector<bool> active;  // what it was built for
    bool moves = false;        // does any rank send anything at all (same on every rank)
    std::vector<int64_t> send_counts;
    std::vector<int64_t> recv_counts;
    std::vector<int64_t> send_offset;               // [local matrix] -1: not sent
    std::vector<std::vector<int64_t>> recv_offset;  // [local matrix][rank] -1: not received
    int64_t send_numel = 0;
    int64_t recv_numel = 0;
  };
  std::vector<Exchange> exchanges;  // [group ordinal], rebuilt when the active set changes

  int rank() const { return comm->rank(); }
  int world() const { return comm->size(); }
  int64_t held_numel(size_t m, int r) const { return held[m][r].second - held[m][r].first; }

  const Exchange& exchange(size_t g, const std::vector<bool>& active) {
    Exchange& x = exchanges[g];
    if (x.active == active && !x.send_counts.empty()) return x;
    const auto& local = group_matrices[g];
    const int w = world();
    const int me = rank();
    x = Exchange{};
    x.active = active;
    x.send_counts.assign(w, 0);
    x.recv_counts.assign(w, 0);
    x.send_offset.assign(local.size(), -1);
    x.recv_offset.assign(local.size(), std::vector<int64_t>(w, -1));
    for (int d = 0; d < w; ++d) {
      for (size_t j = 0; j < local.size(); ++j) {
        const size_t m = local[j];
        if (!active[j] || matrices[m].owner != d || d == me || held_numel(m, me) == 0) continue;
        x.send_offset[j] = x.send_numel;
        x.send_numel += held_numel(m, me);
        x.send_counts[d] += held_numel(m, me);
      }
    }
    for (int s = 0; s < w; ++s) {
      for (size_t j = 0; j < local.size(); ++j) {
        const size_t m = local[j];
        if (!active[j] || matrices[m].owner != me || s == me || held_numel(m, s) == 0) continue;
        x.recv_offset[j][s] = x.recv_numel;
        x.recv_numel += held_numel(m, s);
        x.recv_counts[s] += held_numel(m, s);
      }
    }
    for (size_t j = 0; j < local.size(); ++j) {
      const size_t m = local[j];
      const FsdpMuonMatrix& mat = matrices[m];
      if (active[j] && mat.rows * mat.cols > held_numel(m, mat.owner)) x.moves = true;
    }
    return x;
  }
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
  // Local problems are collected rather than thrown, so that every rank still takes part in the
  // fingerprint exchange below and all of them fail together instead of some hanging.
  std::string local_error;
  try {
    defaults.validate();
    TORCH_CHECK(impl_->config.prefetch_budget_bytes() >= 0,
                "FsdpMuon: prefetch_budget_bytes must be >= 0, got ",
                impl_->config.prefetch_budget_bytes(), " (kUnlimitedPrefetch for no limit)");
    for (const auto& group : param_groups) add_group(group);
  } catch (const c10::Error& e) {
    local_error = what(e);
  }
  // The communicator to agree on: that of the first sharded parameter given.
  for (const auto& group : param_groups) {
    for (const at::Tensor& p : group.params()) {
      if (impl_->comm) break;
      if (auto info = find_sharded_parameter(p)) impl_->comm = info->group->communicator();
    }
  }
  if (!impl_->comm) {
    // Nobody to agree with: fail here with the most specific message there is.
    TORCH_CHECK(local_error.empty(), local_error);
    build();
    TORCH_CHECK(false, "FsdpMuon: no parameters given");
  }
  if (local_error.empty()) {
    try {
      build();
    } catch (const c10::Error& e) {
      local_error = what(e);
    }
  }

  // Fingerprint exchange: [failed, hash] from every rank.
  std::ostringstream desc;
  desc << "world " << impl_->comm->size() << "; policy " << to_string(impl_->config.owner_policy())
       << "; budget " << impl_->config.prefetch_budget_bytes() << ";";
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto* options = dynamic_cast<const MuonOptions*>(&param_groups_[gi].options());
    desc << " group " << gi << " ns_steps " << (options ? options->ns_steps() : -1) << " {";
    for (const at::Tensor& p : param_groups_[gi].params()) {
      auto info = find_sharded_parameter(p);
      if (!info) {
        desc << " ?";
        continue;
      }
      const ParameterSlot& slot = info->slot();
      desc << " " << info->group->name() << "/" << info->group->padded_numel() << "/" << info->index
           << ":" << slot.name << shape_string(slot.shape);
    }
    desc << " }";
  }
  const int w = impl_->comm->size();
  if (w > 1) {
    const auto device = impl_->comm->device();
    at::Tensor mine =
        at::tensor({static_cast<int64_t>(!local_error.empty()), fingerprint(desc.str())},
                   at::TensorOptions().dtype(at::kLong))
            .to(device);
    at::Tensor all = at::empty({2 * w}, mine.options());
    impl_->comm->all_gather(mine, all);
    const at::Tensor everyone = all.cpu();
    const int64_t* v = everyone.data_ptr<int64_t>();
    std::string failed;
    std::string differ;
    for (int r = 0; r < w; ++r) {
      if (v[2 * r] != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
      if (v[2 * r + 1] != v[1]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    }
    TORCH_CHECK(local_error.empty(), local_error);
    TORCH_CHECK(failed.empty(), "FsdpMuon: construction failed on rank(s) ", failed,
                " (see the error there); every rank must pass the same sharded parameters");
    TORCH_CHECK(differ.empty(), "FsdpMuon: the parameter lists differ across ranks: rank(s) ",
                differ,
                " disagree with rank 0 on the groups, order, names or shapes of the "
                "parameters (or on ns_steps, owner policy or prefetch budget). Every rank must "
                "construct FsdpMuon with the same sharded parameters in the same order. This "
                "rank (",
                impl_->comm->rank(), ") has:", abbreviate(desc.str()));
  }
  TORCH_CHECK(local_error.empty(), local_error);
}

FsdpMuon::~FsdpMuon() = default;

void FsdpMuon::add_group(const torch::optim::OptimizerParamGroup& param_group) {
  const size_t index = param_groups_.size();
  for (size_t i = 0; i < param_group.params().size(); ++i) {
    TORCH_CHECK(param_group.params()[i].defined(), "FsdpMuon: parameter ", i, " of group ", index,
                " is an undefined tensor");
  }
  Optimizer::add_param_group(param_group);
  // LibTorch versions differ in what the base class does with options of optimizer types it
  // does not know; the group keeps its own.
  if (param_group.has_options()) param_groups_.back().set_options(param_group.options().clone());
  muon_options_of(param_groups_.back(), index).validate();
}

void FsdpMuon::add_param_group(const torch::optim::OptimizerParamGroup& /*param_group*/) {
  TORCH_CHECK(false,
              "FsdpMuon: add_param_group after construction is not supported: the owner "
              "plan covers the fixed set of parameters given to the constructor. Construct a new "
              "FsdpMuon with all parameter groups instead");
}

void FsdpMuon::build() {
  Impl& d = *impl_;
  std::unordered_map<const FsdpParameterGroup*, size_t> ordinal_of;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  std::ostringstream non_matrix;
  int64_t non_matrix_count = 0;
  std::ostringstream skipped;
  struct Pending {
    size_t group_ordinal;
    size_t index;
    size_t param_group;
    at::Tensor param;
  };
  std::vector<Pending> pending;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const MuonOptions& options = muon_options_of(param_groups_[gi], gi);
    const auto& params = param_groups_[gi].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      auto info = find_sharded_parameter(p);
      TORCH_CHECK(info.has_value(), "FsdpMuon: parameter ", i, " of parameter group ", gi,
                  " (shape ", p.sizes(),
                  ") is not a sharded parameter of a live "
                  "FsdpParameterGroup. Give FsdpMuon the tensors from "
                  "group->sharded_parameters() (see shard_module()), not the module's own "
                  "parameters, and keep the groups alive (held by std::shared_ptr)");
      const FsdpParameterGroup& group = *info->group;
      const ParameterSlot& slot = info->slot();
      auto [it, inserted] = seen.emplace(p.unsafeGetTensorImpl(), gi);
      TORCH_CHECK(inserted, "FsdpMuon: parameter '", slot.name, "' is given twice (parameter ",
                  "groups ", it->second, " and ", gi, "); give each parameter to one group only");
      auto found = ordinal_of.find(&group);
      if (found == ordinal_of.end()) {
        if (!d.groups.empty()) {
          const FsdpParameterGroup& first = *d.groups.front();
          TORCH_CHECK(group.communicator() == first.communicator(), "FsdpMuon: FSDP groups ",
                      group_label(first, 0), " and ", group_label(group, d.groups.size()),
                      " (parameter '", slot.name,
                      "') use different communicators; FsdpMuon "
                      "works on one 1-D data-parallel mesh, so shard every group with the same "
                      "Communicator");
        }
        found = ordinal_of.emplace(&group, d.groups.size()).first;
        d.groups.push_back(info->group);
      }
      if (slot.shape.size() != 2) {
        std::ostringstream& list = options.skip_non_matrix() ? skipped : non_matrix;
        if (list.tellp() > 0) list << ", ";
        list << "'" << slot.name << "' " << shape_string(slot.shape);
        if (!options.skip_non_matrix()) ++non_matrix_count;
        continue;
      }
      pending.push_back({found->second, info->index, gi, p});
    }
  }
  TORCH_CHECK(non_matrix_count == 0, "FsdpMuon: only 2-D parameters can be orthogonalized, but ",
              non_matrix_count, " are not: ", non_matrix.str(),
              ". Give biases, norms and embeddings to torch::optim::AdamW, or set "
              "MuonOptions().skip_non_matrix(true) to leave them untouched");
  TORCH_CHECK(!d.groups.empty(), "FsdpMuon: no parameters given");
  d.comm = d.groups.front()->communicator();
  if (skipped.tellp() > 0 && d.comm->rank() == 0) {
    TORCH_WARN("FsdpMuon: skip_non_matrix is set, so these non-2-D parameters are never updated ",
               "by FsdpMuon (give them to torch::optim::AdamW): ", skipped.str());
  }

  // Matrices in group order, then parameter order inside each group: the order every rank
  // plans, packs and exchanges in.
  std::stable_sort(pending.begin(), pending.end(), [](const Pending& a, const Pending& b) {
    return std::make_pair(a.group_ordinal, a.index) < std::make_pair(b.group_ordinal, b.index);
  });
  const int w = d.comm->size();
  std::vector<PlanGroup> plan_groups(d.groups.size());
  d.group_matrices.assign(d.groups.size(), {});
  for (size_t g = 0; g < d.groups.size(); ++g) {
    plan_groups[g].name = d.groups[g]->name();
    plan_groups[g].element_bytes =
        static_cast<int64_t>(c10::elementSize(d.groups[g]->main_dtype()));
  }
  for (const Pending& p : pending) {
    const FsdpParameterGroup& group = *d.groups[p.group_ordinal];
    const ParameterSlot& slot = group.slot(p.index);
    if (slot.numel == 0) continue;  // nothing to orthogonalize
    FsdpMuonMatrix m;
    m.group = d.groups[p.group_ordinal];
    m.group_ordinal = p.group_ordinal;
    m.index = p.index;
    m.param_group = p.param_group;
    m.sharded_parameter = p.param;
    m.name = slot.name;
    m.rows = slot.shape[0];
    m.cols = slot.shape[1];
    PlanMatrix pm;
    pm.name = slot.name;
    pm.rows = m.rows;
    pm.cols = m.cols;
    pm.ns_steps = muon_options_of(param_groups_[p.param_group], p.param_group).ns_steps();
    for (int r = 0; r < w; ++r) pm.held.push_back(group.held_range(p.index, r));
    d.held.push_back(pm.held);
    d.group_matrices[p.group_ordinal].push_back(d.matrices.size());
    d.matrix_of.emplace(p.param.unsafeGetTensorImpl(), d.matrices.size());
    d.matrices.push_back(std::move(m));
    plan_groups[p.group_ordinal].matrices.push_back(std::move(pm));
  }
  d.plan = plan_owners(plan_groups, w,
                       OwnerPlanOptions()
                           .policy(d.config.owner_policy())
                           .prefetch_budget_bytes(d.config.prefetch_budget_bytes()));
  for (size_t g = 0; g < d.groups.size(); ++g) {
    for (size_t j = 0; j < d.group_matrices[g].size(); ++j) {
      d.matrices[d.group_matrices[g][j]].owner = d.plan.owner[g][j];
    }
  }
  d.windows = d.plan.windows;
  d.exchanges.assign(d.groups.size(), Impl::Exchange{});
  for (const auto& group : param_groups_) {
    std::vector<const c10::TensorImpl*> impls;
    for (const at::Tensor& p : group.params()) impls.push_back(p.unsafeGetTensorImpl());
    d.frozen.push_back(std::move(impls));
  }
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
  const int w = d.world();
  const int me = d.rank();
  const size_t n = d.matrices.size();
  Communicator& comm = *d.comm;

  // ---- agreement: one small all-reduce before anything changes ----
  auto t0 = Clock::now();
  bool changed = param_groups_.size() != d.frozen.size();
  for (size_t gi = 0; !changed && gi < param_groups_.size(); ++gi) {
    const auto& params = param_groups_[gi].params();
    changed = params.size() != d.frozen[gi].size();
    for (size_t i = 0; !changed && i < params.size(); ++i) {
      changed = params[i].unsafeGetTensorImpl() != d.frozen[gi][i];
    }
  }
  std::string local_error;
  std::vector<int32_t> flags(n + 2, 0);
  flags[0] = changed ? 1 : 0;
  if (!changed) {
    try {
      for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
        muon_options_of(param_groups_[gi], gi).validate();  // options may have been edited
      }
      for (size_t m = 0; m < n; ++m) {
        const at::Tensor& p = d.matrices[m].sharded_parameter;
        const at::Tensor& g = p.grad();
        if (!g.defined()) continue;
        TORCH_CHECK(!g.is_sparse() && g.sizes() == p.sizes() && g.dtype() == p.dtype(),
                    "FsdpMuon: the gradient of '", d.matrices[m].name, "' has shape ", g.sizes(),
                    " and dtype ", g.dtype(), " but its shard is ", p.sizes(), " ", p.dtype(),
                    "; FsdpMuon expects the group's gradient-shard slice "
                    "(FsdpParameterGroup::reduce_scatter_grads())");
        flags[m + 2] = 1;
      }
    } catch (const c10::Error& e) {
      local_error = what(e);
      flags[1] = 1;
    }
  }
  std::vector<int32_t> sums = flags;
  if (w > 1) {
    at::Tensor t = at::tensor(at::ArrayRef<int32_t>(flags), at::TensorOptions().dtype(at::kInt))
                       .to(comm.device());
    const int64_t before = comm.stats().all_reduce_bytes;
    comm.all_reduce(t, ReduceOp::kSum);
    stats.check_bytes = comm.stats().all_reduce_bytes - before;
    const at::Tensor host = t.cpu();  // the one host sync of a step: its outcome steers control
    std::copy(host.data_ptr<int32_t>(), host.data_ptr<int32_t>() + n + 2, sums.begin());
  }
  TORCH_CHECK(sums[0] == 0, "FsdpMuon: the parameter groups were changed after construction on ",
              sums[0], " of ", w, " rank(s)", changed ? " (this one included)" : "",
              " — by add_param_group or add_parameters through the Optimizer base class, or by "
              "editing param_groups(). The owner plan covers the parameters given to the "
              "constructor; construct a new FsdpMuon instead");
  TORCH_CHECK(local_error.empty(), local_error);
  TORCH_CHECK(sums[1] == 0, "FsdpMuon: step() failed its checks on ", sums[1], " other rank(s) ",
              "(see the error there)");
  std::ostringstream disagree;
  int64_t disagreements = 0;
  std::vector<bool> active(n, false);
  for (size_t m = 0; m < n; ++m) {
    const int32_t s = sums[m + 2];
    active[m] = s == w;
    if (s != 0 && s != w) {
      if (disagreements++ < 8) {
        disagree << (disagreements > 1 ? ", " : "") << "'" << d.matrices[m].name << "' on " << s
                 << " of " << w << " ranks (this rank: " << (flags[m + 2] ? "yes" : "no") << ")";
      }
    }
  }
  TORCH_CHECK(disagreements == 0, "FsdpMuon: ranks disagree on which parameters have gradients (",
              disagreements, " parameter(s)): ", disagree.str(),
              ". Every rank must produce the same set of gradients (run backward on every rank, "
              "then FsdpParameterGroup::reduce_scatter_grads() on every rank)");
  stats.check_seconds = seconds_since(t0);
  stats.active_parameters = std::count(active.begin(), active.end(), true);

  // ---- the windows: elementwise, gather, orthogonalize, scatter, apply, refresh ----
  struct InFlight {
    std::vector<bool> active;      // [local matrix]
    std::vector<at::Tensor> own;   // [local matrix] this rank's momentum input, owned matrices
    std::vector<at::Tensor> full;  // [local matrix] full matrix (input, then update) on owners
    at::Tensor send;               // gather send = scatter receive
    at::Tensor recv;               // gather receive = scatter send
  };
  for (const auto& [first, last] : d.windows) {
    std::vector<InFlight> flight(last - first);
    ++stats.windows;

    t0 = Clock::now();
    for (size_t g = first; g < last; ++g) {
      InFlight& f = flight[g - first];
      const auto& local = d.group_matrices[g];
      f.active.resize(local.size());
      for (size_t j = 0; j < local.size(); ++j) f.active[j] = active[local[j]];
      const Impl::Exchange& x = d.exchange(g, f.active);
      f.own.resize(local.size());
      f.full.resize(local.size());
      at::Tensor group_param = d.groups[g]->main_weight_shard();
      f.send = at::empty({x.send_numel}, group_param.options());
      for (size_t j = 0; j < local.size(); ++j) {
        if (!f.active[j]) continue;
        const FsdpMuonMatrix& mat = d.matrices[local[j]];
        const at::Tensor& p = mat.sharded_parameter;
        MuonParamState& state = detail::advance_muon_state(state_, p);
        if (p.numel() == 0) continue;  // this rank holds none of it
        const MuonOptions& options =
            muon_options_of(param_groups_[mat.param_group], mat.param_group);
        at::Tensor buffer = state.momentum_buffer();
        at::Tensor u = detail::muon_momentum_input(p, p.grad(), buffer, options);
        if (mat.owner == me) {
          f.own[j] = std::move(u);
        } else {
          f.send.narrow(0, x.send_offset[j], u.numel()).copy_(u);
        }
      }
    }
    stats.elementwise_seconds += seconds_since(t0);

    t0 = Clock::now();
    int64_t transient = 0;
    for (size_t g = first; g < last; ++g) {
      InFlight& f = flight[g - first];
      const auto& local = d.group_matrices[g];
      const Impl::Exchange& x = d.exchange(g, f.active);
      f.recv = at::empty({x.recv_numel}, f.send.options());
      if (x.moves) {
        const int64_t before = comm.stats().all_to_all_v_bytes;
        comm.all_to_all_v(f.send, x.send_counts, f.recv, x.recv_counts);
        stats.gather_bytes += comm.stats().all_to_all_v_bytes - before;
      }
      for (size_t j = 0; j < local.size(); ++j) {
        const size_t m = local[j];
        const FsdpMuonMatrix& mat = d.matrices[m];
        if (!f.active[j] || mat.owner != me) continue;
        // One allocation per matrix: fresh, aligned storage, as single-device Muon's U has.
        at::Tensor full = at::empty({mat.rows * mat.cols}, f.send.options());
        transient += full.nbytes();
        for (int s = 0; s < w; ++s) {
          const int64_t len = d.held_numel(m, s);
          if (len == 0) continue;
          at::Tensor piece = full.narrow(0, d.held[m][s].first, len);
          piece.copy_(s == me ? f.own[j] : f.recv.narrow(0, x.recv_offset[j][s], len));
        }
        f.own[j] = at::Tensor();
        f.full[j] = std::move(full);
      }
    }
    stats.max_transient_bytes = std::max(stats.max_transient_bytes, transient);
    stats.gather_seconds += seconds_since(t0);

    t0 = Clock::now();
    for (size_t g = first; g < last; ++g) {
      InFlight& f = flight[g - first];
      const auto& local = d.group_matrices[g];
      for (size_t j = 0; j < local.size(); ++j) {
        if (!f.full[j].defined()) continue;
        const FsdpMuonMatrix& mat = d.matrices[local[j]];
        const MuonOptions& options =
            muon_options_of(param_groups_[mat.param_group], mat.param_group);
        at::Tensor u = f.full[j].view({mat.rows, mat.cols});
        const at::Tensor update = detail::muon_orthogonalized_update(u, options);
        u.copy_(update);
      }
    }
    stats.orthogonalize_seconds += seconds_since(t0);

    t0 = Clock::now();
    for (size_t g = first; g < last; ++g) {
      InFlight& f = flight[g - first];
      const auto& local = d.group_matrices[g];
      const Impl::Exchange& x = d.exchange(g, f.active);
      for (size_t j = 0; j < local.size(); ++j) {
        const size_t m = local[j];
        if (!f.full[j].defined()) continue;
        for (int h = 0; h < w; ++h) {
          const int64_t len = d.held_numel(m, h);
          if (h == me || len == 0) continue;
          f.recv.narrow(0, x.recv_offset[j][h], len)
              .copy_(f.full[j].narrow(0, d.held[m][h].first, len));
        }
      }
      if (x.moves) {
        const int64_t before = comm.stats().all_to_all_v_bytes;
        comm.all_to_all_v(f.recv, x.recv_counts, f.send, x.send_counts);
        stats.scatter_bytes += comm.stats().all_to_all_v_bytes - before;
      }
      f.recv = at::Tensor();
    }
    stats.scatter_seconds += seconds_since(t0);

    for (size_t g = first; g < last; ++g) {
      t0 = Clock::now();
      InFlight& f = flight[g - first];
      const auto& local = d.group_matrices[g];
      const Impl::Exchange& x = d.exchange(g, f.active);
      for (size_t j = 0; j < local.size(); ++j) {
        const size_t m = local[j];
        if (!f.active[j]) continue;
        const FsdpMuonMatrix& mat = d.matrices[m];
        const at::Tensor& p = mat.sharded_parameter;
        if (p.numel() == 0) continue;
        const MuonOptions& options =
            muon_options_of(param_groups_[mat.param_group], mat.param_group);
        const at::Tensor update = mat.owner == me
                                      ? f.full[j].narrow(0, d.held[m][me].first, p.numel())
                                      : f.send.narrow(0, x.send_offset[j], p.numel());
        detail::muon_apply_update(p, update, options);
      }
      f = InFlight{};
      stats.apply_seconds += seconds_since(t0);
      // Every step, whether or not its matrices had gradients: the group's other parameters
      // may have been stepped by another optimizer just before.
      t0 = Clock::now();
      const int64_t before = comm.stats().all_gather_bytes;
      d.groups[g]->refresh_model_weights();
      stats.refresh_bytes += comm.stats().all_gather_bytes - before;
      stats.refresh_seconds += seconds_since(t0);
    }
  }
  d.stats = stats;
  return loss;
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
const std::vector<std::pair<size_t, size_t>>& FsdpMuon::windows() const { return impl_->windows; }

int FsdpMuon::owner_of(const at::Tensor& sharded_parameter) const {
  if (!sharded_parameter.defined()) return -1;
  auto it = impl_->matrix_of.find(sharded_parameter.unsafeGetTensorImpl());
  return it == impl_->matrix_of.end() ? -1 : impl_->matrices[it->second].owner;
}

const FsdpMuonStepStats& FsdpMuon::last_step_stats() const { return impl_->stats; }

}  // namespace fsdp_muon
