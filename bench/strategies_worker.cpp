// fsdp_strategies_bench --worker: on the ranks of one launch (torchrun, mpirun, or a single
// process), trains the GPT-2-shaped model a few steps under each sharding strategy, prefetch on
// and off, and prints one "strategy:" line per configuration (rank 0) plus a table and a
// headline for this world size.
//
// The step is the loop: zero_grad, forward with every group through
// FsdpParameterGroup::forward, backward, reduce_scatter_grads, AdamW (embeddings, norms,
// biases, head) and FsdpMuon (the blocks' matrices), then refresh of the groups AdamW alone
// stepped. Every configuration starts from the same weights and sees the same batches, so their
// final losses agree bitwise (one micro-batch): the run exits 1, after its table, when they
// do not, so the GPU stage fails on a strategy that changes the numbers.
//
// --shard-size N puts the groups on an HSDP mesh (W / N replicas of N shard ranks; FsdpMuon
// finds the mesh in the groups). Every configuration also counts the bytes its step sent by
// communicator (gradient reduce-scatter in the shard group, all-reduce across replicas, weight
// all-gathers, FsdpMuon's gather + scatter within and across replicas); the run exits 1 as well
// when those are not what the mesh and FsdpMuon's plan make them.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>

#if FSDP_MUON_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "strategies.h"
#include "strategies_model.h"

namespace fsdp_muon_bench {
namespace {

using Clock = std::chrono::steady_clock;
using GroupList = std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>>;
constexpr double kMiB = 1024.0 * 1024.0;

void sync(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

struct Setup {
  Gpt2Config config;
  int64_t batch = 4;
  int64_t steps = 3;
  int64_t warmup = 1;
  double lr = 0.02;
  double adamw_lr = 3e-3;
};

struct Measured {
  fsdp_muon::ShardingStrategy strategy;
  bool prefetch = true;
  // Median seconds over the timed steps of this rank, per step and per phase (the load of a
  // shared machine comes in bursts: the median ignores a step that met one).
  double step = 0, forward = 0, backward = 0, reduce_scatter = 0, adamw = 0, muon = 0;
  // The library's own count over the timed steps: the most unsharded model-weight and
  // full-gradient bytes this rank held at once for this configuration
  // (peak_total_unsharded_bytes, kept where the buffers are allocated and freed), and the most
  // one group held.
  int64_t peak_total = 0;
  int64_t peak_group_max = 0;
  // CUDA caching allocator's peak of active bytes over the timed steps: everything live plus
  // freed blocks still waiting for another stream (which allocated_bytes would not show).
  int64_t cuda_peak = 0;
  // What stays sharded on this rank after a step: main-weight and gradient shards and the
  // optimizers' state (AdamW's moments, FsdpMuon's momentum), bytes as allocated.
  int64_t sharded_state = 0;
  double final_loss = 0;
  // Bytes this rank sent in the last timed step, by communicator: gradient reduction in the
  // shard group (reduce-scatter) and across replicas (all-reduce of the shard), weight
  // all-gathers in the shard group (forward, backward, refresh), and FsdpMuon's owner exchange
  // (gather + scatter) within the replica and to other replicas (FsdpMuonStepStats).
  int64_t grad_shard_bytes = 0, grad_replica_bytes = 0, weight_gather_bytes = 0;
  int64_t optim_intra_bytes = 0, optim_inter_bytes = 0;
  // What the mesh and FsdpMuon's plan say those bytes must be (checked after the run): the
  // groups' shard sizes through CommStats' formulas, the plan's per-rank gather + scatter and
  // inter-node bytes.
  int64_t expected_grad_shard_bytes = 0, expected_grad_replica_bytes = 0;
  int64_t planned_optim_bytes = 0, planned_optim_inter_bytes = 0;
  fsdp_muon::ReplicaNewtonSchulz replica_ns = fsdp_muon::ReplicaNewtonSchulz::kOncePerReplica;
};

// One configuration: the model, its groups and optimizers, and what its steps measured.
class Trainer {
 public:
  Trainer(const Setup& setup, fsdp_muon::ShardingStrategy strategy, bool prefetch,
          const fsdp_muon::DeviceMesh& mesh)
      : setup_(setup), mesh_(mesh), comm_(mesh.world), device_(mesh.world->device()) {
    measured_.strategy = strategy;
    measured_.prefetch = prefetch;
    torch::manual_seed(1);  // every configuration starts from the same weights
    model_ = Gpt2(setup.config);
    model_->to(device_);
    // Sharded over the mesh's shard group, replicated over its replicas (a 1-D mesh: the
    // communicator's groups, bit for bit and byte for byte: docs/DESIGN.md §2, Meshes).
    groups_ = fsdp_muon::shard_module(
        *model_, mesh,
        fsdp_muon::ShardModuleOptions()
            .policy(gpt2_group_of)
            .group_options(
                fsdp_muon::FsdpParameterGroupOptions().sharding_strategy(strategy).prefetch(
                    prefetch)));
    TORCH_CHECK(static_cast<int64_t>(groups_.size()) == setup.config.layers + 2,
                "fsdp_strategies_bench: expected embeddings, ", setup.config.layers,
                " blocks and head as groups, got ", groups_.size());
    // Blocks' matrices to FsdpMuon (torch.optim.Muon's coefficients and lr scaling, as the
    // peer uses), the rest to AdamW; the groups AdamW alone steps are refreshed after it.
    std::vector<at::Tensor> muon_params, adamw_params;
    for (const auto& group : groups_) {
      const bool block = group->name().rfind("h.", 0) == 0;
      const int64_t element = c10::elementSize(group->compute_dtype());
      model_bytes_ += group->padded_numel() * element;
      largest_group_bytes_ = std::max(largest_group_bytes_, 2 * group->padded_numel() * element);
      for (size_t i = 0; i < group->num_parameters(); ++i) {
        num_params_ += group->slot(i).numel;
        if (block && group->slot(i).shape.size() == 2) {
          muon_params.push_back(group->sharded_parameter(i));
        } else {
          adamw_params.push_back(group->sharded_parameter(i));
        }
      }
      if (!block) refresh_after_step_.push_back(group);
      // CommStats' counts (src/comm/communicator.cpp) of the two reduction stages.
      const int64_t shard_bytes =
          group->shard_numel() * static_cast<int64_t>(c10::elementSize(group->main_dtype()));
      const int64_t s = mesh.shard_size(), r = mesh.replicas();
      measured_.expected_grad_shard_bytes += (s - 1) * shard_bytes;
      measured_.expected_grad_replica_bytes += 2 * (r - 1) * shard_bytes / r;
    }
    muon_ = std::make_unique<fsdp_muon::FsdpMuon>(
        muon_params,
        fsdp_muon::MuonOptions(setup.lr).newton_schulz(
            fsdp_muon::NewtonSchulzOptions().coefficients(fsdp_muon::NsCoefficients::kSimple)));
    adamw_ = std::make_unique<torch::optim::AdamW>(adamw_params,
                                                   torch::optim::AdamWOptions(setup.adamw_lr)
                                                       .betas(std::make_tuple(0.9, 0.95))
                                                       .weight_decay(0.0));
    // FsdpMuon found the mesh in the groups; its plan's per-rank figures are indexed by world
    // ranks when owners span the replicas, else by shard ranks (as fsdp_muon_bench reads them).
    const fsdp_muon::OwnerPlan& plan = muon_->owner_plan();
    const int plan_rank =
        plan.world_size == mesh.world->size() ? mesh.world->rank() : mesh.shard->rank();
    measured_.replica_ns = plan.replica_newton_schulz;
    measured_.planned_optim_bytes =
        plan.gather_bytes_per_rank[plan_rank] + plan.scatter_bytes_per_rank[plan_rank];
    measured_.planned_optim_inter_bytes =
        plan.inter_node_bytes_per_rank.empty() ? 0 : plan.inter_node_bytes_per_rank[plan_rank];
  }

  std::string describe_optimizer() const { return muon_->describe(); }

  const GroupList& groups() const { return groups_; }
  int64_t model_bytes() const { return model_bytes_; }                  // weights, padded
  int64_t largest_group_bytes() const { return largest_group_bytes_; }  // weights + grads
  int64_t num_params() const { return num_params_; }

  // One training step. `others` are the bytes the other live configurations hold unsharded;
  // they hold still while this one steps, so the communicator-wide peak less them is this
  // configuration's.
  void step(const at::Tensor& inputs, const at::Tensor& targets, bool first_timed, bool timed,
            int64_t others) {
    if (first_timed) {
      for (const auto& g : groups_) g->reset_peak_unsharded_bytes();
#if FSDP_MUON_WITH_CUDA
      if (device_.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
#endif
    }
    fsdp_muon::reset_peak_total_unsharded_bytes(groups_);
    const int64_t vocab = setup_.config.vocab;
    sync(device_);
    comm_->barrier();
    // Counted from here (the barrier sends nothing); on a 1-D mesh world and shard are one.
    for (const auto* c : {&mesh_.world, &mesh_.shard, &mesh_.replicate}) (*c)->reset_stats();
    const auto t0 = Clock::now();
    for (const auto& g : groups_) g->zero_grad();
    at::Tensor x = groups_.front()->forward(
        [&](const at::Tensor& t) { return model_->embeddings->forward(t); }, inputs);
    for (int64_t k = 0; k < setup_.config.layers; ++k) {
      auto block = model_->h[k]->as<Gpt2Block>();
      x = groups_[1 + k]->forward([block](const at::Tensor& t) { return block->forward(t); }, x);
    }
    const at::Tensor logits =
        groups_.back()->forward([&](const at::Tensor& t) { return model_->head->forward(t); }, x);
    const at::Tensor loss =
        at::cross_entropy_loss(logits.reshape({-1, vocab}).to(at::kFloat), targets.reshape(-1));
    sync(device_);
    const auto t1 = Clock::now();
    loss.backward();
    sync(device_);
    const auto t2 = Clock::now();
    for (const auto& g : groups_) g->reduce_scatter_grads();
    sync(device_);
    const auto t3 = Clock::now();
    // Gradients are reduced in backward (ZeRO-2/3) or here (ZeRO-1): counted over both.
    const int64_t grad_shard = mesh_.shard->stats().reduce_scatter_bytes;
    const int64_t grad_replica = mesh_.replicate->stats().all_reduce_bytes;
    adamw_->step();
    sync(device_);
    const auto t4 = Clock::now();
    muon_->step();
    for (const auto& g : refresh_after_step_) g->refresh_model_weights();
    sync(device_);
    const auto t5 = Clock::now();
    if (!timed) return;
    const auto& st = muon_->last_step_stats();
    measured_.grad_shard_bytes = grad_shard;
    measured_.grad_replica_bytes = grad_replica;
    measured_.weight_gather_bytes = mesh_.shard->stats().all_gather_bytes;
    measured_.optim_intra_bytes = st.gather_intra_node_bytes + st.scatter_intra_node_bytes;
    measured_.optim_inter_bytes = st.gather_inter_node_bytes + st.scatter_inter_node_bytes;
    auto secs = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    forwards_.push_back(secs(t0, t1));
    backwards_.push_back(secs(t1, t2));
    reduce_scatters_.push_back(secs(t2, t3));
    adamws_.push_back(secs(t3, t4));
    muons_.push_back(secs(t4, t5));
    steps_.push_back(secs(t0, t5));
    measured_.final_loss = loss.item<double>();
    measured_.peak_total =
        std::max(measured_.peak_total, fsdp_muon::peak_total_unsharded_bytes(groups_) - others);
  }

  Measured result() {
    Measured m = measured_;
    m.step = median(steps_);
    m.forward = median(forwards_);
    m.backward = median(backwards_);
    m.reduce_scatter = median(reduce_scatters_);
    m.adamw = median(adamws_);
    m.muon = median(muons_);
    m.sharded_state = sharded_state_bytes();
    for (const auto& g : groups_) {
      m.peak_group_max = std::max(m.peak_group_max, g->peak_unsharded_bytes());
    }
#if FSDP_MUON_WITH_CUDA
    if (device_.is_cuda()) {
      m.cuda_peak =
          c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index())
              .active_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
              .peak;
    }
#endif
    return m;
  }

 private:
  Setup setup_;
  fsdp_muon::DeviceMesh mesh_;
  std::shared_ptr<fsdp_muon::Communicator> comm_;
  c10::Device device_;
  Gpt2 model_{nullptr};
  GroupList groups_, refresh_after_step_;
  std::unique_ptr<fsdp_muon::FsdpMuon> muon_;
  std::unique_ptr<torch::optim::AdamW> adamw_;

  int64_t sharded_state_bytes() const {
    auto bytes = [](const at::Tensor& t) {
      return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
    };
    int64_t total = 0;
    for (const auto& g : groups_) total += bytes(g->main_weight_shard()) + bytes(g->grad_shard());
    for (const auto& [key, state] : adamw_->state()) {
      const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get());
      TORCH_CHECK(s != nullptr, "fsdp_strategies_bench: unexpected AdamW state");
      total += bytes(s->exp_avg()) + bytes(s->exp_avg_sq()) + bytes(s->max_exp_avg_sq());
    }
    for (const auto& [key, state] : muon_->state()) {
      const auto* s = dynamic_cast<const fsdp_muon::MuonParamState*>(state.get());
      TORCH_CHECK(s != nullptr, "fsdp_strategies_bench: unexpected FsdpMuon state");
      total += bytes(s->momentum_buffer());
    }
    return total;
  }
  int64_t model_bytes_ = 0, largest_group_bytes_ = 0, num_params_ = 0;
  std::vector<double> steps_, forwards_, backwards_, reduce_scatters_, adamws_, muons_;
  Measured measured_;
};

// Warm-up and timed steps of `trainers`, round by round: in each round every trainer takes one
// step on the same batch, starting one further along the list each round, so that a burst of
// load from elsewhere falls on all of them alike.
void run_rounds(const std::vector<Trainer*>& trainers, const Setup& setup,
                const fsdp_muon::Communicator& comm) {
  at::Generator gen = at::detail::createCPUGenerator(1000 + comm.rank());
  const size_t n = trainers.size();
  for (int64_t s = 0; s < setup.warmup + setup.steps; ++s) {
    const at::Tensor tokens =
        at::randint(setup.config.vocab, {setup.batch, setup.config.seq_len + 1}, gen, at::kLong)
            .to(comm.device());
    const at::Tensor inputs = tokens.narrow(1, 0, setup.config.seq_len);
    const at::Tensor targets = tokens.narrow(1, 1, setup.config.seq_len);
    for (size_t j = 0; j < n; ++j) {
      Trainer* t = trainers[(j + static_cast<size_t>(s)) % n];
      auto others = [&] {
        int64_t bytes = 0;
        for (Trainer* o : trainers) {
          if (o != t) bytes += fsdp_muon::total_unsharded_bytes(o->groups());
        }
        return bytes;
      };
      const int64_t before = others();
      t->step(inputs, targets, s == setup.warmup, s >= setup.warmup, before);
      TORCH_CHECK(others() == before,
                  "fsdp_strategies_bench: another configuration's unsharded "
                  "bytes changed while one stepped; the peaks would be wrong");
    }
  }
}

const char* zero_name(fsdp_muon::ShardingStrategy s) {
  switch (s) {
    case fsdp_muon::ShardingStrategy::kOptim:
      return "ZeRO-1";
    case fsdp_muon::ShardingStrategy::kOptimGrads:
      return "ZeRO-2";
    case fsdp_muon::ShardingStrategy::kOptimGradsParams:
      return "ZeRO-3";
  }
  return "?";
}

}  // namespace

int run_strategies_worker(Flags& flags) {
  Setup setup;
  const std::string strategies_flag =
      flags.get("strategies", "optim,optim_grads,optim_grads_params");
  const std::string prefetch_flag = flags.get("prefetch", "on,off");
  const int64_t threads = flags.get_int("threads", 0);
  const bool sequential_flag = flags.has("sequential");
  // HSDP: each group sharded over this many ranks, replicated over world / shard-size (0: every
  // rank, a 1-D mesh).
  const int64_t shard_size = flags.get_int("shard-size", 0);
  const auto comm = fsdp_muon::init_from_env();
  const c10::Device device = comm->device();
  const int rank = comm->rank(), world = comm->size();
  // On a GPU GPT-2 124M itself; on a CPU a shape that runs in seconds (see the usage).
  const bool full = device.is_cuda();
  setup.config.layers = flags.get_int("layers", full ? 12 : 4);
  setup.config.width = flags.get_int("width", full ? 768 : 256);
  setup.config.heads = flags.get_int("heads", full ? 12 : 4);
  setup.config.vocab = flags.get_int("vocab", full ? 50257 : 8192);
  setup.config.seq_len = flags.get_int("seq-len", full ? 1024 : 128);
  setup.batch = flags.get_int("batch", full ? 8 : 4);
  setup.steps = flags.get_int("steps", 5);
  setup.warmup = flags.get_int("warmup", 1);
  flags.finish();
  TORCH_CHECK(setup.steps >= 1 && setup.warmup >= 0 && setup.batch >= 1,
              "fsdp_strategies_bench: --steps and --batch must be >= 1, --warmup >= 0");
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  TORCH_CHECK(shard_size >= 0,
              "fsdp_strategies_bench: --shard-size must be >= 1 (or 0: every rank), got ",
              shard_size);
  // make_device_mesh names the world size and the shard size when one does not divide the other.
  const fsdp_muon::DeviceMesh mesh =
      shard_size > 0 ? fsdp_muon::make_device_mesh(comm, static_cast<int>(shard_size))
                     : fsdp_muon::one_dimensional_mesh(comm);

  std::vector<fsdp_muon::ShardingStrategy> strategies;
  {
    std::stringstream ss(strategies_flag);
    std::string item;
    while (std::getline(ss, item, ',')) {
      const auto s = fsdp_muon::parse_sharding_strategy(item);
      TORCH_CHECK(s.has_value(), "fsdp_strategies_bench: --strategies got '", item,
                  "'; give optim, optim_grads, optim_grads_params (comma-separated)");
      strategies.push_back(*s);
    }
  }
  std::vector<bool> prefetches;
  {
    std::stringstream ss(prefetch_flag);
    std::string item;
    while (std::getline(ss, item, ',')) {
      TORCH_CHECK(item == "on" || item == "off", "fsdp_strategies_bench: --prefetch got '", item,
                  "'; give on, off or on,off");
      prefetches.push_back(item == "on");
    }
  }

  // On a CPU shared with other work every configuration lives at once and they step in
  // rounds (run_rounds); on a GPU, whose allocator peak is per process, one after another.
  const bool sequential = sequential_flag || device.is_cuda();
  std::vector<Measured> results;
  std::vector<std::string> optimizer_descriptions;  // FsdpMuon::describe() of each
  int64_t model_bytes = 0, largest_group = 0, num_params = 0;
  std::vector<std::unique_ptr<Trainer>> trainers;
  auto finish = [&](Trainer& t) {
    results.push_back(t.result());
    optimizer_descriptions.push_back(t.describe_optimizer());
    model_bytes = t.model_bytes();
    largest_group = t.largest_group_bytes();
    num_params = t.num_params();
  };
  for (const auto strategy : strategies) {
    for (const bool prefetch : prefetches) {
      trainers.push_back(std::make_unique<Trainer>(setup, strategy, prefetch, mesh));
      if (sequential) {
        run_rounds({trainers.back().get()}, setup, *comm);
        finish(*trainers.back());
        trainers.clear();
      }
    }
  }
  if (!sequential) {
    std::vector<Trainer*> all;
    for (const auto& t : trainers) all.push_back(t.get());
    run_rounds(all, setup, *comm);
    for (const auto& t : trainers) finish(*t);
  }

  // Cross-rank: the slowest rank's times, the largest peaks.
  std::vector<double> local;
  for (const auto& m : results) {
    for (double v :
         {m.step, m.forward, m.backward, m.reduce_scatter, m.adamw, m.muon,
          static_cast<double>(m.peak_total), static_cast<double>(m.peak_group_max),
          static_cast<double>(m.cuda_peak), static_cast<double>(m.sharded_state),
          static_cast<double>(m.grad_shard_bytes), static_cast<double>(m.grad_replica_bytes),
          static_cast<double>(m.weight_gather_bytes), static_cast<double>(m.optim_intra_bytes),
          static_cast<double>(m.optim_inter_bytes)}) {
      local.push_back(v);
    }
  }
  constexpr int kFields = 15;
  at::Tensor maxes = at::tensor(local, at::kDouble).to(device);
  comm->all_reduce(maxes, fsdp_muon::ReduceOp::kMax);
  maxes = comm->to_host(maxes);

  // Every configuration ran the same training with one micro-batch, so the final losses are
  // bitwise equal (the strategies and prefetch move bytes, never change sums: docs/DESIGN.md
  // §2). A difference is a bug in a strategy: the run fails (exit 1) after printing its table.
  std::string loss_mismatch;
  for (const auto& m : results) {
    if (m.final_loss != results.front().final_loss) {
      loss_mismatch += format(" %s prefetch %s %.17g vs %s prefetch %s %.17g;",
                              fsdp_muon::to_string(m.strategy), m.prefetch ? "on" : "off",
                              m.final_loss, fsdp_muon::to_string(results.front().strategy),
                              results.front().prefetch ? "on" : "off", results.front().final_loss);
    }
  }
  // The bytes this rank sent must be what the mesh makes them: the two reduction stages as
  // CommStats counts them for these groups' shards (none across replicas on a 1-D mesh, some on
  // every rank with replicas), FsdpMuon's gather + scatter as its plan says, inter-node only
  // when it orthogonalizes once in the world on several replicas.
  std::string bytes_mismatch;
  for (const auto& m : results) {
    const std::string who =
        format(" %s prefetch %s:", fsdp_muon::to_string(m.strategy), m.prefetch ? "on" : "off");
    auto expect = [&](const char* what, int64_t got, int64_t want) {
      if (got != want) {
        bytes_mismatch += format("%s %s %lld bytes, expected %lld;", who.c_str(), what,
                                 static_cast<long long>(got), static_cast<long long>(want));
      }
    };
    expect("gradient reduce-scatter in the shard group", m.grad_shard_bytes,
           m.expected_grad_shard_bytes);
    expect("gradient all-reduce across replicas", m.grad_replica_bytes,
           m.expected_grad_replica_bytes);
    if ((mesh.replicas() > 1) != (m.grad_replica_bytes > 0)) {
      bytes_mismatch += format("%s %lld gradient bytes across %d replica(s);", who.c_str(),
                               static_cast<long long>(m.grad_replica_bytes), mesh.replicas());
    }
    expect("FsdpMuon gather + scatter", m.optim_intra_bytes + m.optim_inter_bytes,
           m.planned_optim_bytes);
    expect("FsdpMuon inter-node gather + scatter", m.optim_inter_bytes,
           m.planned_optim_inter_bytes);
    if (m.optim_inter_bytes > 0 &&
        (mesh.replicas() == 1 || m.replica_ns == fsdp_muon::ReplicaNewtonSchulz::kOncePerReplica)) {
      bytes_mismatch += format("%s %lld FsdpMuon inter-node bytes under %s on mesh %s;",
                               who.c_str(), static_cast<long long>(m.optim_inter_bytes),
                               fsdp_muon::to_string(m.replica_ns), mesh.shape().c_str());
    }
  }
  const auto losses_checked = [&]() {
    if (!bytes_mismatch.empty()) {
      std::fprintf(stderr,
                   "fsdp_strategies_bench: rank %d: bytes sent are not what mesh %s makes "
                   "them:%s\n",
                   rank, mesh.shape().c_str(), bytes_mismatch.c_str());
    }
    if (!loss_mismatch.empty()) {
      std::fprintf(stderr,
                   "fsdp_strategies_bench: rank %d: the final losses differ between "
                   "configurations that ran the same training:%s\n",
                   rank, loss_mismatch.c_str());
    }
    return loss_mismatch.empty() && bytes_mismatch.empty() ? 0 : 1;
  };
  // Whether any rank failed either check, for rank 0's report.
  at::Tensor failed =
      at::tensor({loss_mismatch.empty() ? 0.0 : 1.0, bytes_mismatch.empty() ? 0.0 : 1.0},
                 at::kDouble)
          .to(device);
  comm->all_reduce(failed, fsdp_muon::ReduceOp::kMax);
  failed = comm->to_host(failed);
  const bool losses_differ = failed[0].item<double>() > 0;
  const bool bytes_differ = failed[1].item<double>() > 0;
  if (rank != 0) return losses_checked();
  auto field = [&](size_t r, int f) { return maxes[r * kFields + f].item<double>(); };

  const std::string model_name =
      format("GPT-2 (%lld layers, width %lld, vocab %lld, %lld x %lld tokens per rank)",
             static_cast<long long>(setup.config.layers),
             static_cast<long long>(setup.config.width), static_cast<long long>(setup.config.vocab),
             static_cast<long long>(setup.batch), static_cast<long long>(setup.config.seq_len));
  std::printf(
      "fsdp_strategies_bench: %s, %.2f M parameters, %lld groups, W=%d on %s [%s], %d "
      "threads per rank, %lld steps after %lld warm-up, configurations %s\n",
      model_name.c_str(), num_params / 1e6, static_cast<long long>(setup.config.layers + 2), world,
      device.str().c_str(), comm->backend_name().c_str(), at::get_num_threads(),
      static_cast<long long>(setup.steps), static_cast<long long>(setup.warmup),
      sequential ? "one after another" : "side by side, stepping in turn");
  std::printf(
      "model weights %.2f MiB (weights + grads %.2f MiB); two groups' worth (2 x the "
      "largest group's weights + grads) %.2f MiB\n\n",
      model_bytes / kMiB, 2 * model_bytes / kMiB, 2 * largest_group / kMiB);
  // "peak MiB" is the library's count of unsharded weights and gradients; on a GPU "alloc MiB"
  // beside it is the CUDA caching allocator's peak of active bytes over the timed steps
  // (everything the process holds: sharded state, activations, staging, and blocks freed but
  // still waiting for another stream).
  const bool cuda = device.is_cuda();
  std::printf("%-26s %-4s %9s %8s %8s %8s %8s %8s %10s %9s %9s%s %10s %10s\n", "strategy", "pf",
              "step ms", "fwd", "bwd", "rs", "adamw", "muon", "peak MiB", "/W+G", "/2grp",
              cuda ? format(" %10s", "alloc MiB").c_str() : "", "state MiB", "loss");
  for (size_t r = 0; r < results.size(); ++r) {
    const auto& m = results[r];
    const double peak = field(r, 6);
    std::printf(
        "%-26s %-4s %9.1f %8.1f %8.1f %8.1f %8.1f %8.1f %10.2f %9.3f %9.3f%s %10.2f %10.6f\n",
        format("%s %s", fsdp_muon::to_string(m.strategy), zero_name(m.strategy)).c_str(),
        m.prefetch ? "on" : "off", field(r, 0) * 1e3, field(r, 1) * 1e3, field(r, 2) * 1e3,
        field(r, 3) * 1e3, field(r, 4) * 1e3, field(r, 5) * 1e3, peak / kMiB,
        peak / (2.0 * model_bytes), peak / (2.0 * largest_group),
        cuda ? format(" %10.2f", field(r, 8) / kMiB).c_str() : "", field(r, 9) / kMiB,
        m.final_loss);
  }
  if (shard_size > 0) {
    // The mesh, FsdpMuon's choice for it, and the bytes each communicator carried.
    std::printf("\nmesh %s (replicas x shard): %s\n", mesh.shape().c_str(),
                optimizer_descriptions.front().c_str());
    std::printf(
        "bytes per rank per step (MiB, max rank): gradient reduction in the shard group and "
        "across replicas, weight all-gathers in the shard group, FsdpMuon's gather + scatter "
        "within the replica and to other replicas\n");
    std::printf("%-26s %-4s %11s %11s %11s %11s %11s  %s\n", "strategy", "pf", "grad shard",
                "grad repl", "wt gather", "muon intra", "muon inter", "replica NS");
    for (size_t r = 0; r < results.size(); ++r) {
      const auto& m = results[r];
      std::printf("%-26s %-4s %11.3f %11.3f %11.3f %11.3f %11.3f  %s\n",
                  format("%s %s", fsdp_muon::to_string(m.strategy), zero_name(m.strategy)).c_str(),
                  m.prefetch ? "on" : "off", field(r, 10) / kMiB, field(r, 11) / kMiB,
                  field(r, 12) / kMiB, field(r, 13) / kMiB, field(r, 14) / kMiB,
                  fsdp_muon::to_string(m.replica_ns));
    }
  }
  std::printf("\n");
  for (size_t r = 0; r < results.size(); ++r) {
    const auto& m = results[r];
    std::string line = format(
        "strategy: strategy=%s prefetch=%d world=%d device=%s step_ms=%.3f forward_ms=%.3f "
        "backward_ms=%.3f reduce_scatter_ms=%.3f adamw_ms=%.3f muon_ms=%.3f",
        fsdp_muon::to_string(m.strategy), m.prefetch ? 1 : 0, world,
        device.type() == c10::kCUDA ? "cuda" : "cpu", field(r, 0) * 1e3, field(r, 1) * 1e3,
        field(r, 2) * 1e3, field(r, 3) * 1e3, field(r, 4) * 1e3, field(r, 5) * 1e3);
    line += format(
        " peak_unsharded_bytes=%lld peak_group_max_bytes=%lld sharded_state_bytes=%lld "
        "model_bytes=%lld largest_group_bytes=%lld params=%lld final_loss=%.6f",
        static_cast<long long>(field(r, 6)), static_cast<long long>(field(r, 7)),
        static_cast<long long>(field(r, 9)), static_cast<long long>(model_bytes),
        static_cast<long long>(largest_group), static_cast<long long>(num_params), m.final_loss);
    line += format(
        " mesh=%s replicas=%d shard_size=%d replica_ns=%s grad_shard_bytes=%lld "
        "grad_replica_bytes=%lld weight_gather_bytes=%lld optim_intra_bytes=%lld "
        "optim_inter_bytes=%lld",
        mesh.shape().c_str(), mesh.replicas(), mesh.shard_size(),
        fsdp_muon::to_string(m.replica_ns), static_cast<long long>(field(r, 10)),
        static_cast<long long>(field(r, 11)), static_cast<long long>(field(r, 12)),
        static_cast<long long>(field(r, 13)), static_cast<long long>(field(r, 14)));
    if (device.is_cuda()) {
      line += format(" cuda_peak_active_bytes=%lld", static_cast<long long>(field(r, 8)));
    }
    std::printf("%s\n", line.c_str());
  }

  if (shard_size > 0) {
    // The checks, over every rank (the failing ranks' details are on stderr).
    if (losses_differ || bytes_differ) {
      std::printf("checks FAILED on some rank:%s%s\n",
                  losses_differ ? " final losses differ between configurations;" : "",
                  bytes_differ ? " bytes by communicator are not what the mesh makes them;" : "");
    } else {
      std::printf(
          "checks passed on every rank: final losses bitwise equal across the %zu "
          "configurations; bytes by communicator as mesh %s and each FsdpMuon plan make them\n",
          results.size(), mesh.shape().c_str());
    }
  }
  // Headline for this W: ZeRO-3's peak against two groups' worth, its step against ZeRO-1's.
  auto find = [&](fsdp_muon::ShardingStrategy s, bool prefetch) -> int {
    for (size_t r = 0; r < results.size(); ++r) {
      if (results[r].strategy == s && results[r].prefetch == prefetch) return static_cast<int>(r);
    }
    return -1;
  };
  const int z1 = find(fsdp_muon::ShardingStrategy::kOptim, true);
  const int z3 = find(fsdp_muon::ShardingStrategy::kOptimGradsParams, true);
  std::string headline =
      format("headline: %s W=%d%s on %s:", model_name.c_str(), world,
             shard_size > 0 ? format(" (mesh %s)", mesh.shape().c_str()).c_str() : "",
             device.str().c_str());
  if (z3 >= 0) {
    headline += format(
        " ZeRO-3 peak unsharded %.2f MiB = %.2fx two groups' worth (%.3fx "
        "weights + grads)",
        field(z3, 6) / kMiB, field(z3, 6) / (2.0 * largest_group),
        field(z3, 6) / (2.0 * model_bytes));
  }
  if (z1 >= 0 && z3 >= 0) {
    headline += format(", step ZeRO-3 / ZeRO-1 %.2fx (prefetch on)", field(z3, 0) / field(z1, 0));
  }
  if (device.is_cuda() && z3 >= 0 && z1 >= 0) {
    headline += format(", CUDA allocator peak ZeRO-3 / ZeRO-1 %.2fx", field(z3, 8) / field(z1, 8));
  }
  std::printf("%s\n", headline.c_str());
  std::fflush(stdout);
  return losses_checked();
}

}  // namespace fsdp_muon_bench
