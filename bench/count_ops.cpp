// fsdp_muon_bench --count-ops: ATen operator calls per FsdpMuon step, counted by a RecordFunction
// callback, against the number of matrices and FSDP groups (docs/DESIGN.md §7). On a GPU every
// call is at least one kernel launch (~5 µs), so a step whose calls grow with the number of
// matrices pays launch overhead on MoE models with thousands of experts. One process, or one
// rank per process under a launcher (the exchange's packing only runs where matrices move).

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#include "bench.h"

namespace fsdp_muon_bench {
namespace {

// The step's phases as FsdpMuon names its user scopes (RecordFunction), and "other" for calls
// outside them (the agreement's setup, the state's bookkeeping).
constexpr const char* kPhases[] = {"check",   "elementwise", "gather", "orthogonalize",
                                   "scatter", "apply",       "refresh"};
constexpr size_t kOrthogonalize = 3;  // Newton–Schulz and its scale
constexpr size_t kOther = std::size(kPhases);
constexpr size_t kColumns = kOther + 1;

// Top-level operator calls (not the ones an operator makes inside), on every thread, by phase.
std::array<std::atomic<int64_t>, kColumns> g_calls{};
thread_local int t_depth = 0;
thread_local size_t t_phase = kOther;

// Remembers the phase a user scope interrupted.
struct PhaseContext : at::ObserverContext {
  explicit PhaseContext(size_t previous) : previous(previous) {}
  size_t previous;
};

size_t phase_of(const char* name) {
  const std::string_view prefix = "fsdp_muon::";
  const std::string_view n(name);
  if (n.substr(0, prefix.size()) != prefix) return kColumns;
  for (size_t i = 0; i < kOther; ++i) {
    if (n.substr(prefix.size()) == kPhases[i]) return i;
  }
  return kColumns;
}

struct OpCount {
  std::string model;
  int64_t groups = 0, matrices = 0, calls = 0, newton_schulz_calls = 0;
  std::array<int64_t, kColumns> by_phase{};
};

// The model with each layer's experts as one [E, m, n] tensor per projection ("...mlp.experts.
// gate_proj.weight"), in place of its E 2-D ones: what MatrixLayout::batched() orthogonalizes.
ModelShapes with_batched_experts(const ModelShapes& model) {
  ModelShapes out{model.name + ", experts as batched()", {}};
  for (const auto& [name, shapes] : model.groups) {
    NamedShapes kept;
    std::vector<std::pair<std::string, std::vector<int64_t>>> stacked;  // name, [E, m, n]
    for (const auto& [pname, shape] : shapes) {
      const size_t at = pname.find(".mlp.experts.");
      if (at == std::string::npos) {
        kept.emplace_back(pname, shape);
        continue;
      }
      const std::string rest = pname.substr(at + 13);  // "<e>.<proj>.weight"
      const std::string stacked_name = pname.substr(0, at + 13) + rest.substr(rest.find('.') + 1);
      auto found = std::find_if(stacked.begin(), stacked.end(),
                                [&](const auto& entry) { return entry.first == stacked_name; });
      if (found == stacked.end()) {
        stacked.emplace_back(stacked_name, std::vector<int64_t>{0, shape[0], shape[1]});
        found = stacked.end() - 1;
      }
      ++found->second[0];
    }
    kept.insert(kept.end(), stacked.begin(), stacked.end());
    out.groups.emplace_back(name, std::move(kept));
  }
  return out;
}

OpCount count_one_step(const std::string& label, const ModelShapes& model,
                       const std::shared_ptr<fsdp_muon::Communicator>& comm) {
  torch::manual_seed(1);
  std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>> groups;
  // 2-D matrices whole, 3-D expert tensors batched() (each its own optimizer group).
  std::vector<at::Tensor> matrices, expert_tensors;
  for (const auto& [name, shapes] : model.groups) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& [pname, shape] : shapes) {
      named.emplace_back(pname, (at::randn(shape) * 0.02).to(comm->device()).requires_grad_(true));
    }
    groups.push_back(std::make_shared<fsdp_muon::FsdpParameterGroup>(
        named, comm, fsdp_muon::FsdpParameterGroupOptions().name(name)));
    for (size_t i = 0; i < groups.back()->num_parameters(); ++i) {
      const size_t dims = groups.back()->slot(i).shape.size();
      if (dims == 2) matrices.push_back(groups.back()->sharded_parameter(i));
      if (dims == 3) expert_tensors.push_back(groups.back()->sharded_parameter(i));
    }
  }
  const auto options = fsdp_muon::MuonOptions(0.02).newton_schulz(
      fsdp_muon::NewtonSchulzOptions().compute_dtype(at::kFloat));
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  param_groups.emplace_back(matrices, std::make_unique<fsdp_muon::MuonOptions>(options));
  if (!expert_tensors.empty()) {
    param_groups.emplace_back(
        expert_tensors,
        std::make_unique<fsdp_muon::MuonOptions>(
            fsdp_muon::MuonOptions(options).matrix_layout(fsdp_muon::MatrixLayout::batched())));
  }
  fsdp_muon::FsdpMuon muon(param_groups, options,
                           fsdp_muon::FsdpMuonConfig().rates(fsdp_muon::CostRates()));
  const auto fill_gradients = [&] {
    for (const auto& g : groups) {
      g->zero_grad();
      g->full_grad_buffer().normal_();
      g->reduce_scatter_grads();
    }
  };
  fill_gradients();
  muon.step();  // the first step creates the momentum buffers
  fill_gradients();

  for (auto& calls : g_calls) calls = 0;
  at::CallbackHandle handle = at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            if (fn.scope() == at::RecordScope::USER_SCOPE) {
              const size_t phase = phase_of(fn.name());
              if (phase == kColumns) return nullptr;
              auto context = std::make_unique<PhaseContext>(t_phase);
              t_phase = phase;
              return context;
            }
            if (t_depth++ == 0) g_calls[t_phase].fetch_add(1, std::memory_order_relaxed);
            return nullptr;
          },
          [](const at::RecordFunction& fn, at::ObserverContext* context) {
            if (fn.scope() == at::RecordScope::USER_SCOPE) {
              if (context != nullptr) t_phase = static_cast<PhaseContext*>(context)->previous;
              return;
            }
            --t_depth;
          })
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
  muon.step();
  at::removeCallback(handle);

  OpCount c;
  c.model = label;
  c.groups = static_cast<int64_t>(groups.size());
  c.matrices = static_cast<int64_t>(muon.matrices().size());
  for (size_t i = 0; i < kColumns; ++i) {
    c.by_phase[i] = g_calls[i].load();
    c.calls += c.by_phase[i];
  }
  c.newton_schulz_calls = muon.last_step_stats().newton_schulz_calls;
  return c;
}

}  // namespace

int run_count_ops(Flags& flags) {
  const int64_t layers = flags.get_int("layers", 2);
  const int64_t scale = flags.get_int("scale", 16);
  const int64_t experts = flags.get_int("experts", 128);
  flags.finish();
  TORCH_CHECK(layers >= 1 && scale >= 1 && experts >= 1,
              "--layers, --scale and --experts must be >= 1");
  const auto comm = fsdp_muon::init_from_env();
  // Under a launcher every rank counts its own calls (those of the communicator's own threads as
  // "other"); rank 0 prints.
  const bool print = comm->rank() == 0;
  std::vector<OpCount> rows;
  rows.push_back(
      count_one_step(format("qwen3-30b-a3b: %lld layers, %lld experts, widths / %lld",
                            static_cast<long long>(layers), static_cast<long long>(experts),
                            static_cast<long long>(scale)),
                     qwen3_30b_a3b(layers, experts, scale), comm));
  rows.push_back(count_one_step("  the same, experts as batched() [E, m, n]",
                                with_batched_experts(qwen3_30b_a3b(layers, experts, scale)), comm));
  rows.push_back(count_one_step(format("gpt2-124m: %lld layers", static_cast<long long>(layers)),
                                gpt2_124m(layers), comm));
  if (!print) return 0;
  std::printf(
      "ATen operator calls per FsdpMuon step (top-level calls; each is >= 1 kernel on a "
      "GPU), rank 0 of a world of %d, fp32 Newton-Schulz\n",
      comm->size());
  std::printf("%-48s %7s %9s %11s %12s %12s %9s\n", "model", "groups", "matrices", "calls/step",
              "calls/matrix", "calls/group", "NS calls");
  for (const OpCount& r : rows) {
    std::printf("%-48s %7lld %9lld %11lld %12.1f %12.1f %9lld\n", r.model.c_str(),
                static_cast<long long>(r.groups), static_cast<long long>(r.matrices),
                static_cast<long long>(r.calls), static_cast<double>(r.calls) / r.matrices,
                static_cast<double>(r.calls) / r.groups,
                static_cast<long long>(r.newton_schulz_calls));
  }
  std::printf("\nby phase of the step (FsdpMuon's user scopes; \"other\": outside them)\n");
  std::printf("%-48s", "model");
  for (const char* phase : kPhases) std::printf(" %13s", phase);
  std::printf(" %13s\n", "other");
  for (const OpCount& r : rows) {
    std::printf("%-48s", r.model.c_str());
    for (int64_t calls : r.by_phase) std::printf(" %13lld", static_cast<long long>(calls));
    std::printf("\n");
  }
  const OpCount& moe = rows.front();
  std::printf(
      "headline: %.1f ATen calls per matrix per step on the MoE preset (%lld matrices, "
      "%lld calls; %.1f per group outside Newton-Schulz)\n",
      static_cast<double>(moe.calls) / moe.matrices, static_cast<long long>(moe.matrices),
      static_cast<long long>(moe.calls),
      static_cast<double>(moe.calls - moe.by_phase[kOrthogonalize]) / moe.groups);
  return 0;
}

}  // namespace fsdp_muon_bench
