// char_gpt: a small GPT-style character language model trained data-parallel with sharded
// parameters, through the user tier: shard() and one MuonAdamW, which steps the hidden matrices
// (attention and MLP weights) with Muon and everything else with AdamW; `--optimizer adamw` is
// the baseline with AdamW on everything.
//
//   torchrun --standalone --nproc_per_node=2 build/examples/char_gpt/char_gpt --compare
//   mpirun -np 2 build/examples/char_gpt/char_gpt --optimizer muon --steps 300
//   torchrun --standalone --nproc_per_node=2 --no-python build/examples/char_gpt/char_gpt
//       --sharding optim_grads_params
//   torchrun --standalone --nproc_per_node=4 --no-python build/examples/char_gpt/char_gpt
//       --shard-size 2        (HSDP: 2 replicas of 2 shard ranks)

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>
#include <CLI/CLI.hpp>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp/qk_clip.h>
#include <fsdp_muon/fsdp/shard_module.h>
#include <fsdp_muon/muon/muon_options.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>

#include "checkpoint_hook.h"
#include "corpus.h"
#include "model.h"

namespace char_gpt {
namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string optimizer = "muon";
  bool compare = false;
  fsdp_muon::ShardingStrategy sharding = fsdp_muon::FsdpParameterGroupOptions{}.sharding_strategy();
  int64_t steps = 600;
  int64_t batch = 32;
  int64_t seq_len = 64;
  int64_t d_model = 96;
  int64_t layers = 3;
  int64_t heads = 4;
  double lr = 0.02;
  double adamw_lr = 3e-3;
  int64_t warmup = 20;
  double cooldown = 0.4;
  // MuonOptions::newton_schulz, from the --ns-* flags (turbo_muon: custom_coefficients).
  fsdp_muon::NewtonSchulzOptions newton_schulz;
  fsdp_muon::Normalization normalization = fsdp_muon::Normalization::kNone;
  std::string qkv_layout = "qkv";
  int64_t moe = 0;
  int shard_size = 0;  // 0: every rank (a 1-D mesh)
  double qk_clip = 0;
  int64_t eval_every = 100;
  int64_t log_every = 0;
  uint64_t seed = 1234;
  std::string data = "/usr/share/common-licenses";
  double val_fraction = 0.1;
  int threads = 0;
  double max_val_loss = NAN;
  std::string checkpoint;
  std::string resume;
  int64_t stop_at = 0;
  double timeout = fsdp_muon::InitOptions{}.timeout_seconds;
};

// The options, declared once with CLI11 (its --help lists them with their defaults; a value of
// the wrong type, out of range or not among the choices is an error naming the option).
Flags parse_flags(int argc, char** argv) {
  Flags f;
  CLI::App app(
      "char_gpt: a character-level GPT trained with fsdp_muon (launch with torchrun, "
      "mpirun, srun or alone)",
      "char_gpt");
  app.option_defaults()->always_capture_default();
  std::string sharding, compute_dtype = "bf16", method = "standard", preconditioning = "none";
  std::string coefficients = "quintic", normalization = "none";
  const auto names = [](auto... values) {
    return std::vector<std::string>{fsdp_muon::to_string(values)...};
  };
  app.add_option("--optimizer", f.optimizer,
                 "muon: Muon on the hidden matrices + AdamW on the rest; adamw: AdamW on "
                 "everything (the baseline)")
      ->check(CLI::IsMember({"muon", "adamw"}));
  app.add_flag("--compare", f.compare, "run muon, then adamw with the same budget, and compare");
  app.add_option("--sharding", sharding,
                 "what each group keeps unsharded between uses: optim (ZeRO-1), optim_grads "
                 "(ZeRO-2), optim_grads_params (ZeRO-3); default: the library's")
      ->check(CLI::IsMember(names(fsdp_muon::ShardingStrategy::kOptim,
                                  fsdp_muon::ShardingStrategy::kOptimGrads,
                                  fsdp_muon::ShardingStrategy::kOptimGradsParams)));
  app.add_option("--shard-size", f.shard_size,
                 "HSDP: shard each group over N ranks (a node), replicate over world size / N "
                 "(0: every rank, plain FSDP)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", f.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch", f.batch, "sequences per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--seq-len", f.seq_len, "characters per sequence")->check(CLI::Range(2, 1 << 20));
  app.add_option("--d-model", f.d_model, "model width")->check(CLI::PositiveNumber);
  app.add_option("--layers", f.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--heads", f.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "Muon learning rate");
  app.add_option("--adamw-lr", f.adamw_lr,
                 "AdamW learning rate (the best of 0.002, 0.003, 0.0045, 0.006, 0.01 for "
                 "--optimizer adamw at the default budget)");
  app.add_option("--warmup", f.warmup, "linear warm-up steps");
  app.add_option("--cooldown", f.cooldown, "fraction of steps over which lr decays to 0")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--ns-dtype", compute_dtype, "NewtonSchulzOptions::compute_dtype")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--ns-method", method, "NewtonSchulzOptions::method")
      ->check(CLI::IsMember(names(fsdp_muon::NsMethod::kStandard, fsdp_muon::NsMethod::kGram,
                                  fsdp_muon::NsMethod::kAuto)));
  app.add_option("--ns-preconditioning", preconditioning, "NewtonSchulzOptions::preconditioning")
      ->check(CLI::IsMember(
          names(fsdp_muon::NsPreconditioning::kNone, fsdp_muon::NsPreconditioning::kAol)));
  std::vector<std::string> schedules = {
#define CHAR_GPT_PRESET_NAME(enumerator, name, ...) name,
      FSDP_MUON_NS_PRESETS(CHAR_GPT_PRESET_NAME)
#undef CHAR_GPT_PRESET_NAME
          "turbo_muon"};
  app.add_option("--ns-coefficients", coefficients,
                 "the (a, b, c) schedule: a preset, or turbo_muon (Turbo-Muon's 4 tuples, built "
                 "for --ns-preconditioning aol)")
      ->check(CLI::IsMember(schedules));
  app.add_option("--ns-steps", f.newton_schulz.steps(),
                 "Newton-Schulz iterations (with aol, one fewer is validated only for "
                 "turbo_muon --ns-steps 4)")
      ->check(CLI::PositiveNumber);
  app.add_option("--normalization", normalization,
                 "normuon divides each row of the update by the root of an EMA of its mean "
                 "square (NorMuon), then restores its norm")
      ->check(CLI::IsMember(
          names(fsdp_muon::Normalization::kNone, fsdp_muon::Normalization::kNorMuon)));
  app.add_option("--qkv-layout", f.qkv_layout,
                 "how Muon sees each fused QKV weight: qkv (Q, K, V apart), heads (every head "
                 "apart) or whole (one matrix)")
      ->check(CLI::IsMember({"qkv", "heads", "whole"}));
  app.add_option("--moe", f.moe,
                 "E experts per block instead of the dense MLP, fused [E, 4d, d] and [E, d, 4d] "
                 "(MatrixLayout::batched), top-1 routing (0: dense)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--qk-clip", f.qk_clip,
                 "QK-clip after every step: heads whose largest logit exceeded TAU are scaled "
                 "back; the run fails if one stays above TAU (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval-every", f.eval_every, "validation loss every N steps (0: at the end)");
  app.add_option("--log-every", f.log_every,
                 "progress line every N steps when stderr is not a terminal (0: steps / 10)");
  app.add_option("--seed", f.seed, "model init and data order");
  app.add_option("--data", f.data, "folder of text files");
  app.add_option("--val-fraction", f.val_fraction, "last fraction of every file held out")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--threads", f.threads, "intra-op threads per rank (0: as launched)");
  app.add_option("--max-val-loss", f.max_val_loss,
                 "fail unless the final validation loss is below X (nan: the corpus' unigram "
                 "entropy)");
  app.add_option("--checkpoint", f.checkpoint,
                 "write a checkpoint under DIR at the end (DIR/latest names it)");
  app.add_option("--resume", f.resume,
                 "continue from the newest checkpoint under DIR (any world size)");
  app.add_option("--stop-at", f.stop_at,
                 "stop after step N (the schedule still spans --steps; 0: --steps)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--timeout", f.timeout,
                 "seconds the rendezvous and every collective may wait for the other ranks "
                 "(FSDP_MUON_TIMEOUT, when set, wins)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));  // --help: the usage, status 0; else the error, non-zero
  }

  if (!sharding.empty()) f.sharding = *fsdp_muon::parse_sharding_strategy(sharding);
  f.newton_schulz.compute_dtype(compute_dtype == "bf16" ? at::kBFloat16 : at::kFloat)
      .method(*fsdp_muon::parse_ns_method(method))
      .preconditioning(*fsdp_muon::parse_ns_preconditioning(preconditioning));
  if (coefficients == "turbo_muon") {
    f.newton_schulz.custom_coefficients({{4.6051, -9.6552, 5.6769},
                                         {4.7505, -6.0861, 2.1790},
                                         {2.7763, -2.3190, 0.5523},
                                         {2.4231, -2.2861, 0.8193}});
  } else {
    f.newton_schulz.coefficients(*fsdp_muon::parse_ns_coefficients(coefficients));
  }
  f.normalization = normalization == fsdp_muon::to_string(fsdp_muon::Normalization::kNorMuon)
                        ? fsdp_muon::Normalization::kNorMuon
                        : fsdp_muon::Normalization::kNone;
  TORCH_CHECK(f.qk_clip >= 0.0 && std::isfinite(f.qk_clip),
              "char_gpt: --qk-clip must be a positive threshold (0: off), got ", f.qk_clip);
  TORCH_CHECK(!(f.compare && (!f.checkpoint.empty() || !f.resume.empty())),
              "char_gpt: --compare runs two trainings; use --checkpoint/--resume with one "
              "--optimizer at a time");
  TORCH_CHECK(f.stop_at >= 0 && f.stop_at <= f.steps, "char_gpt: --stop-at must be in [0, ",
              "--steps]");
  if (f.stop_at == 0) f.stop_at = f.steps;
  // Before training, not after it: the save at the end would refuse such a folder.
  if (!f.checkpoint.empty()) check_checkpoint_root(f.checkpoint);
  if (f.log_every <= 0) f.log_every = std::max<int64_t>(1, f.steps / 10);
  return f;
}

std::string format_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%lld:%02lld", static_cast<long long>(s / 60),
                static_cast<long long>(s % 60));
  return buf;
}

// Rank 0's progress: redrawn in place on a terminal, one line every --log-every steps otherwise
// (CTest, pipes, log files).
class Progress {
 public:
  Progress(bool enabled, int64_t total_steps, int64_t log_every)
      : enabled_(enabled),
        tty_(enabled && isatty(STDERR_FILENO)),
        total_(total_steps),
        log_every_(log_every) {}

  void start(int64_t first_step) {
    first_step_ = first_step;
    start_ = Clock::now();
    last_draw_ = start_ - std::chrono::seconds(1);
  }

  void update(int64_t step, double loss, int64_t tokens_per_step) {
    if (!enabled_) return;
    const auto now = Clock::now();
    const bool last = step == total_;
    if (tty_ ? (!last && now - last_draw_ < std::chrono::milliseconds(200))
             : (!last && step % log_every_ != 0)) {
      return;
    }
    last_draw_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const int64_t done = step - first_step_;
    const double tokens_per_s = elapsed > 0 ? done * tokens_per_step / elapsed : 0.0;
    const double left = done > 0 ? elapsed / done * (total_ - step) : 0.0;
    const int width = 24;
    const int filled = static_cast<int>(width * step / total_);
    char line[256];
    std::snprintf(line, sizeof(line), "[%s%s] step %lld/%lld  loss %.3f  %.1fk tok/s  left %s",
                  std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                  static_cast<long long>(step), static_cast<long long>(total_), loss,
                  tokens_per_s / 1000.0, format_duration(left).c_str());
    if (tty_) {
      std::cerr << '\r' << line << "\x1b[K" << (last ? "\n" : "") << std::flush;
    } else {
      std::cerr << line << '\n' << std::flush;
    }
  }

  // A message between redraws: on a terminal it must not be written over the bar.
  void message(const std::string& text) {
    if (!enabled_) return;
    if (tty_) std::cerr << "\r\x1b[K";
    std::cerr << text << '\n' << std::flush;
  }

 private:
  bool enabled_, tty_;
  int64_t total_, log_every_, first_step_ = 0;
  Clock::time_point start_, last_draw_;
};

// The model's groups by part (shard_group_of's keys), in forward order.
struct ShardedParts {
  std::shared_ptr<fsdp_muon::FsdpParameterGroup> embeddings, head;
  std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>> blocks;
};

ShardedParts sharded_parts(
    const std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>>& groups, int64_t n_layers) {
  ShardedParts parts;
  parts.blocks.resize(n_layers);
  for (const auto& g : groups) {
    if (g->name() == "embeddings") {
      parts.embeddings = g;
    } else if (g->name() == "head") {
      parts.head = g;
    } else {
      TORCH_CHECK(g->name().rfind("blocks.", 0) == 0, "char_gpt: unexpected group ", g->name());
      parts.blocks.at(std::stoll(g->name().substr(7))) = g;
    }
  }
  for (const auto& b : parts.blocks) TORCH_CHECK(b != nullptr, "char_gpt: a block has no group");
  TORCH_CHECK(parts.embeddings && parts.head, "char_gpt: embeddings or head has no group");
  return parts;
}

// The model's forward with each part inside its group's forward(): under optim_grads_params a
// group's weights are unsharded only while its part runs forward or backward, and under
// optim_grads and optim_grads_params its gradients are reduce-scattered as soon as backward is
// done with it (under optim the groups only run the part).
at::Tensor sharded_forward(CharGpt& model, const ShardedParts& parts, const at::Tensor& tokens) {
  at::Tensor x =
      parts.embeddings->forward([&](const at::Tensor& t) { return model->embed(t); }, tokens);
  for (size_t i = 0; i < parts.blocks.size(); ++i) {
    x = parts.blocks[i]->forward(
        [&model, i](const at::Tensor& h) { return model->block(static_cast<int64_t>(i), h); }, x);
  }
  return parts.head->forward([&](const at::Tensor& h) { return model->head(h); }, x);
}

// Mean validation loss over the whole held-out text; every rank evaluates its share of the
// windows and one all-reduce combines them.
double validation_loss(CharGpt& model, const ShardedParts& parts, const Batch& windows,
                       fsdp_muon::Communicator& comm, const c10::Device& device) {
  torch::NoGradGuard no_grad;
  const int64_t vocab = model->config().vocab_size;
  double sum = 0.0;
  const int64_t n = windows.inputs.size(0);
  for (int64_t start = 0; start < n; start += 64) {
    const int64_t len = std::min<int64_t>(64, n - start);
    const at::Tensor logits =
        sharded_forward(model, parts, windows.inputs.narrow(0, start, len).to(device));
    const at::Tensor targets = windows.targets.narrow(0, start, len).to(device);
    sum += at::cross_entropy_loss(logits.reshape({-1, vocab}).to(at::kFloat), targets.reshape(-1),
                                  /*weight=*/{}, at::Reduction::Sum)
               .item<double>();
  }
  at::Tensor totals =
      at::tensor({sum, static_cast<double>(n * windows.inputs.size(1))}, at::kDouble).to(device);
  comm.all_reduce(totals, fsdp_muon::ReduceOp::kSum);
  totals = totals.cpu();
  return totals[0].item<double>() / totals[1].item<double>();
}

// splitmix64 of (seed, rank, step): well-spread generator seeds for neighbouring steps.
uint64_t batch_seed(uint64_t seed, int rank, int64_t step) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(rank) * 0xBF58476D1CE4E5B9ULL +
               static_cast<uint64_t>(step) * 0x94D049BB133111EBULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct RunResult {
  std::string optimizer;
  double initial_val_loss = 0.0;
  double final_val_loss = 0.0;
  double seconds = 0.0;
  double tokens_per_second = 0.0;
  int64_t steps_run = 0;
  // --qk-clip: the largest attention logit measured right after a clip, and the heads clipped.
  double largest_logit_after_clip = -std::numeric_limits<double>::infinity();
  int64_t clipped_heads = 0;
};

RunResult train(const Flags& flags, const std::string& optimizer_name, const Corpus& corpus,
                const fsdp_muon::DeviceMesh& mesh) {
  // Data parallelism spans the whole world; the groups shard over the mesh's shard group.
  const std::shared_ptr<fsdp_muon::Communicator>& comm = mesh.world;
  const bool rank0 = comm->rank() == 0;
  const c10::Device device = comm->device();
  Progress progress(rank0, flags.steps, flags.log_every);

  // Same initial weights on every rank (the groups also broadcast rank 0's), a different data
  // stream per rank: this is data parallelism.
  torch::manual_seed(flags.seed);
  ModelConfig config;
  config.vocab_size = corpus.vocab_size();
  config.seq_len = flags.seq_len;
  config.d_model = flags.d_model;
  config.n_layers = flags.layers;
  config.n_heads = flags.heads;
  config.n_experts = flags.moe;
  CharGpt model(config);
  model->to(device);
  int64_t num_params = 0;
  std::map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& item : model->named_parameters()) {
    num_params += item.value().numel();
    name_of[item.value().unsafeGetTensorImpl()] = item.key();
  }

  const auto sharded = fsdp_muon::shard(
      *model, mesh,
      fsdp_muon::ShardModuleOptions()
          .policy(shard_group_of)
          .group_options(fsdp_muon::FsdpParameterGroupOptions().sharding_strategy(flags.sharding)));
  const auto& groups = sharded->groups();
  const ShardedParts parts = sharded_parts(groups, config.n_layers);

  // One optimizer: MuonAdamW's default routing sends the hidden matrices (the 2-D and 3-D
  // weights of the blocks) to Muon and the embeddings, norms, biases and head to AdamW; the
  // baseline routes everything to AdamW. Each block's fused QKV weight is Q, K and V
  // (--qkv-layout), the experts' 3-D weights E matrices each.
  const bool use_muon = optimizer_name == "muon";
  const double adamw_lr = flags.adamw_lr;
  const int64_t d = config.d_model, dh = config.d_model / config.n_heads;
  const fsdp_muon::MatrixLayout qkv_layout =
      flags.qkv_layout == "whole" ? fsdp_muon::MatrixLayout::whole()
      : flags.qkv_layout == "qkv"
          ? fsdp_muon::MatrixLayout::row_blocks({d, d, d})
          : fsdp_muon::MatrixLayout::row_blocks(std::vector<int64_t>(3 * config.n_heads, dh));
  auto routing = fsdp_muon::MuonAdamWConfig().matrix_layout(
      [&](const std::string& name, const at::Tensor& param) {
        const bool qkv = name.size() > 11 && name.compare(name.size() - 11, 11, ".qkv.weight") == 0;
        return qkv                ? qkv_layout
               : param.dim() == 3 ? fsdp_muon::MatrixLayout::batched()
                                  : fsdp_muon::MatrixLayout::whole();
      });
  if (!use_muon) routing.use_muon([](const std::string&, const at::Tensor&) { return false; });
  fsdp_muon::MuonAdamW optimizer(
      sharded,
      fsdp_muon::MuonOptions(flags.lr)
          .newton_schulz(flags.newton_schulz)
          .normalization(flags.normalization),
      torch::optim::AdamWOptions(adamw_lr).betas(std::make_tuple(0.9, 0.95)).weight_decay(0.0),
      routing);
  int64_t muon_numel = 0;
  for (const fsdp_muon::ShardedModelParameter& p : sharded->parameters()) {
    const bool hidden = is_hidden_matrix(p.name, p.meta);
    TORCH_CHECK(!use_muon || optimizer.uses_muon(p.name) == hidden,
                "char_gpt: MuonAdamW's default routing disagrees with is_hidden_matrix on ",
                p.name);
    if (hidden) muon_numel += p.meta.numel();
  }

  if (rank0) {
    std::ostringstream ss;
    ss << "== " << optimizer_name << ": " << num_params << " parameters (" << muon_numel
       << " in hidden matrices stepped by " << (use_muon ? "FsdpMuon" : "AdamW") << "), "
       << groups.size() << " FSDP groups (sharding " << fsdp_muon::to_string(flags.sharding)
       << "), " << comm->size() << " rank(s) on " << device << " [" << comm->backend_name()
       << "], mesh " << mesh.shape() << " (replicas x shard), " << flags.steps << " steps x "
       << comm->size() << " ranks x " << flags.batch << " seqs x " << flags.seq_len << " chars, lr";
    if (use_muon) ss << " muon " << flags.lr << " +";
    ss << " adamw " << adamw_lr;
    if (use_muon) ss << "; qkv layout " << flags.qkv_layout;
    if (flags.moe > 0) ss << "; " << flags.moe << " experts per block, top-1";
    progress.message(ss.str());
  }

  // QK-clip's view of each block's fused QKV projection: queries in rows [0, d), keys in [d, 2d).
  std::vector<fsdp_muon::QkClipLayer> qk_layers;
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const std::string qkv = "blocks." + std::to_string(i) + ".qkv.";
    qk_layers.push_back(fsdp_muon::QkClipLayer(qkv + "weight", qkv + "weight", config.n_heads,
                                               config.d_model / config.n_heads)
                            .key_row_offset(config.d_model)
                            .query_bias(qkv + "bias")
                            .key_bias(qkv + "bias"));
  }

  TrainingState state;
  state.model = sharded;
  state.optimizer = &optimizer;
  if (!flags.resume.empty()) {
    load_checkpoint(flags.resume, state);
    if (rank0)
      progress.message("resumed from " + flags.resume + " at step " + std::to_string(state.step));
  }

  const Batch val_windows =
      validation_windows(corpus.validation, flags.seq_len, comm->rank(), comm->size());
  RunResult result;
  result.optimizer = optimizer_name;
  result.initial_val_loss = validation_loss(model, parts, val_windows, *comm, device);
  if (rank0) {
    char line[128];
    std::snprintf(line, sizeof(line), "step %lld: val loss %.4f",
                  static_cast<long long>(state.step), result.initial_val_loss);
    progress.message(line);
  }

  // Linear warm-up, constant, then a linear decay to zero over the last `cooldown` of the run.
  // Base rates from the flags, not from the optimizers: a resumed optimizer carries the decayed
  // rate it was saved with.
  std::vector<std::pair<torch::optim::OptimizerOptions*, double>> base_lrs;
  for (auto& g : optimizer.param_groups()) {
    const bool muon_group = dynamic_cast<const fsdp_muon::MuonOptions*>(&g.options()) != nullptr;
    base_lrs.emplace_back(&g.options(), muon_group ? flags.lr : adamw_lr);
  }
  auto lr_scale = [&](int64_t step) {
    double s = std::min(1.0, static_cast<double>(step + 1) / std::max<int64_t>(1, flags.warmup));
    const double decay_start = flags.steps * (1.0 - flags.cooldown);
    if (step >= decay_start && flags.cooldown > 0) {
      s *= std::max(0.0, (flags.steps - step) / (flags.steps * flags.cooldown));
    }
    return s;
  };

  at::Generator data_gen = at::detail::createCPUGenerator();
  const int64_t tokens_per_step = comm->size() * flags.batch * flags.seq_len;
  const int64_t vocab = corpus.vocab_size();
  const int64_t first_step = state.step;
  double smoothed = NAN;
  double val = result.initial_val_loss;
  progress.start(first_step);
  const auto t0 = Clock::now();
  while (state.step < flags.stop_at) {
    const int64_t step = state.step;
    for (auto& [options, base] : base_lrs) options->set_lr(base * lr_scale(step));

    // The batch is a function of (seed, rank, step): a resumed run sees the same data.
    data_gen.set_current_seed(batch_seed(flags.seed, comm->rank(), step));
    const Batch batch = sample_batch(corpus.train, flags.batch, flags.seq_len, data_gen);
    optimizer.zero_grad();
    const at::Tensor logits = sharded_forward(model, parts, batch.inputs.to(device));
    const at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, vocab}).to(at::kFloat),
                                                   batch.targets.to(device).reshape(-1));
    loss.backward();   // ends by reduce-scattering every group's gradients
    optimizer.step();  // AdamW, FsdpMuon, then every group's model weights refreshed
    if (flags.qk_clip > 0) {
      // This batch's largest logit per head with the updated weights (one more forward, no
      // gradient), recording each block's input; then the clip; then the same blocks on the
      // same inputs with the clipped weights: no head may exceed τ any more.
      model->record_max_logits(true);
      {
        at::NoGradGuard no_grad;
        sharded_forward(model, parts, batch.inputs.to(device));
      }
      model->record_max_logits(false);
      const fsdp_muon::QkClipResult clip =
          fsdp_muon::qk_clip(groups, qk_layers, flags.qk_clip, model->max_logits());
      for (const auto& block : parts.blocks) block->unshard();
      at::Tensor after = model->recheck_max_logits().max().reshape({1}).to(at::kDouble);
      for (const auto& block : parts.blocks) block->reshard();
      comm->all_reduce(after, fsdp_muon::ReduceOp::kMax);
      const double before_max = clip.max_logits.max().item<double>();
      const double after_max = comm->to_host(after).item<double>();
      result.largest_logit_after_clip = std::max(result.largest_logit_after_clip, after_max);
      result.clipped_heads += clip.clipped_heads;
      if (rank0 && (step + 1) % flags.log_every == 0) {
        char line[160];
        std::snprintf(line, sizeof(line),
                      "step %lld: max logit %.3f -> %.3f after qk-clip (tau %.3g, %lld heads)",
                      static_cast<long long>(step + 1), before_max, after_max, flags.qk_clip,
                      static_cast<long long>(clip.clipped_heads));
        progress.message(line);
      }
    }
    state.step = step + 1;

    const double l = loss.item<double>();
    smoothed = std::isnan(smoothed) ? l : 0.9 * smoothed + 0.1 * l;
    progress.update(state.step, smoothed, tokens_per_step);
    const bool last = state.step == flags.stop_at;
    if (last || (flags.eval_every > 0 && state.step % flags.eval_every == 0)) {
      val = validation_loss(model, parts, val_windows, *comm, device);
      if (rank0) {
        char line[128];
        std::snprintf(line, sizeof(line), "step %lld: val loss %.4f",
                      static_cast<long long>(state.step), val);
        progress.message(line);
      }
    }
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  result.final_val_loss = val;
  result.steps_run = state.step - first_step;
  result.tokens_per_second =
      result.seconds > 0 ? (state.step - first_step) * tokens_per_step / result.seconds : 0.0;

  if (!flags.checkpoint.empty()) {
    const std::string folder = save_checkpoint(flags.checkpoint, state);
    if (rank0) progress.message("checkpoint written to " + folder);
  }
  return result;
}

int run(int argc, char** argv) {
  const Flags flags = parse_flags(argc, argv);
  if (flags.threads > 0) at::set_num_threads(flags.threads);
  fsdp_muon::InitOptions init;
  init.timeout_seconds = flags.timeout;
  const auto comm = fsdp_muon::init_from_env(init);
  const bool rank0 = comm->rank() == 0;
  TORCH_CHECK(flags.shard_size >= 0, "char_gpt: --shard-size must be >= 1 (0: every rank), got ",
              flags.shard_size);
  const fsdp_muon::DeviceMesh mesh = flags.shard_size > 0
                                         ? fsdp_muon::make_device_mesh(comm, flags.shard_size)
                                         : fsdp_muon::one_dimensional_mesh(comm);

  const Corpus corpus = load_corpus(flags.data, flags.val_fraction);
  const double threshold =
      std::isnan(flags.max_val_loss) ? corpus.unigram_entropy : flags.max_val_loss;
  if (rank0) {
    std::printf(
        "corpus: %zu files from %s, %lld training / %lld validation characters, "
        "vocabulary %lld\n",
        corpus.files.size(), flags.data.c_str(), static_cast<long long>(corpus.train.numel()),
        static_cast<long long>(corpus.validation.numel()),
        static_cast<long long>(corpus.vocab_size()));
    std::printf(
        "unigram entropy of the training text: %.4f nats/char (validation text under "
        "it: %.4f)\n",
        corpus.unigram_entropy, corpus.unigram_validation_loss);
    std::fflush(stdout);
  }

  std::vector<std::string> optimizers = flags.compare ? std::vector<std::string>{"muon", "adamw"}
                                                      : std::vector<std::string>{flags.optimizer};
  std::vector<RunResult> results;
  bool ok = true;
  for (const auto& name : optimizers) {
    const RunResult r = train(flags, name, corpus, mesh);
    results.push_back(r);
    // A run stopped early (--stop-at) only has to have improved; a full one must also beat the
    // unigram entropy (or --max-val-loss).
    const bool full = flags.stop_at == flags.steps;
    const bool learned = (!full || r.final_val_loss < threshold) &&
                         (r.final_val_loss < r.initial_val_loss || r.steps_run == 0);
    ok = ok && learned;
    // A clip scales a head's logits to τ exactly; rounding aside, none may stay above it.
    const bool clipped = flags.qk_clip <= 0 || r.steps_run == 0 ||
                         r.largest_logit_after_clip <= flags.qk_clip * (1 + 1e-4);
    ok = ok && clipped;
    if (rank0 && flags.qk_clip > 0) {
      std::printf("%s: qk-clip tau %.4g: %lld head clips; largest logit after a clip %.4f: %s\n",
                  name.c_str(), flags.qk_clip, static_cast<long long>(r.clipped_heads),
                  r.largest_logit_after_clip, clipped ? "bounded" : "ABOVE TAU");
    }
    if (rank0) {
      std::fflush(stderr);
      std::printf(
          "%s: val loss %.4f -> %.6f nats/char in %.1f s (%.1fk tok/s); unigram entropy "
          "%.4f: %s\n",
          name.c_str(), r.initial_val_loss, r.final_val_loss, r.seconds,
          r.tokens_per_second / 1000.0, corpus.unigram_entropy,
          learned ? "learned" : "DID NOT LEARN");
      std::fflush(stdout);
    }
  }
  if (rank0 && results.size() == 2) {
    const RunResult &m = results[0], &a = results[1];
    std::printf(
        "compare: final val loss muon %.4f vs adamw %.4f nats/char (unigram %.4f); "
        "muon %s by %.4f\n",
        m.final_val_loss, a.final_val_loss, corpus.unigram_entropy,
        m.final_val_loss < a.final_val_loss ? "lower" : "higher",
        std::abs(a.final_val_loss - m.final_val_loss));
    std::fflush(stdout);
  }
  comm->barrier();
  if (!ok && rank0) {
    std::fprintf(stderr, "char_gpt: final validation loss not below %.4f (%s)\n", threshold,
                 std::isnan(flags.max_val_loss) ? "the unigram entropy" : "--max-val-loss");
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace char_gpt

int main(int argc, char** argv) {
  try {
    return char_gpt::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "char_gpt: error: " << e.what() << std::endl;
    return 2;
  }
}
