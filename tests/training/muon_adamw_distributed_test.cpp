// The user tier (ShardedModel + MuonAdamW) across ranks: a small transformer-like language model
// with embeddings, norms, biases, a 3-D expert tensor and an output head, trained the way the
// README shows, against the explicit API (shard_module + FsdpMuon + AdamW, the loop written out)
// bit for bit under every sharding strategy with an LR scheduler; micro-batches accumulated
// without communication; the default routing and its override; checkpoints saved at W = 2 and
// resumed at W = 3 by both tiers alike; and the errors of misuse. In-process worlds of 1-4 ranks,
// and the save / resume pair as real jobs (torchrun W = 2, then mpirun W = 3).

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/schedulers/step_lr.h>
#include <torch/torch.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp_muon.h>

#include "checkpoint/file_io.h"
#include "common/distributed_main.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using testing::world;
using testing::world_ptr;

// Sizes no world size up to 4 divides, so some ranks hold nothing of some parameters.
constexpr int64_t kVocab = 11, kDim = 6, kHidden = 7, kExperts = 2, kSeq = 5, kBatch = 3;
constexpr int64_t kSteps = 6;

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    experts = register_parameter("experts", at::randn({kExperts, kDim, kDim}) * 0.3);
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    fc1 = register_module("fc1", torch::nn::Linear(kDim, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kDim));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = norm(x);
    const at::Tensor mixed = at::einsum("bsn,eon->bso", {h, experts}) / kExperts;
    return x + fc2(at::gelu(fc1(h))) + mixed;
  }
  at::Tensor experts;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    b0 = register_module("b0", Block());
    b1 = register_module("b1", Block());
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  // As a user writes it; under ShardingStrategy::kOptim nothing else is needed.
  at::Tensor forward(const at::Tensor& tokens) { return head(b1(b0(embed(tokens)))); }
  // Each direct child through `run(child, input)`: its group's forward() boundary.
  template <typename Run>
  at::Tensor forward_with(Run&& run, const at::Tensor& tokens) {
    at::Tensor h = run(embed, tokens);
    h = run(b0, h);
    h = run(b1, h);
    return run(head, h);
  }
  torch::nn::Embedding embed{nullptr};
  Block b0{nullptr}, b1{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TinyLm);

TinyLm make_model() {
  testing::SeededRandom random(5);
  return TinyLm();
}

struct Batch {
  at::Tensor inputs, targets;
};

// This rank's batch at `step` of a world of `world_size`.
Batch batch_of(int rank, int64_t step, int64_t micro = 0) {
  testing::SeededRandom random(1000 + 100 * step + 10 * micro + rank);
  // A learnable language: a random first token, then next = (3 * token + 1) mod kVocab.
  std::vector<at::Tensor> columns = {at::randint(0, kVocab, {kBatch})};
  for (int64_t t = 0; t < kSeq; ++t) columns.push_back((columns.back() * 3 + 1).remainder(kVocab));
  const at::Tensor tokens = at::stack(columns, 1);
  return {tokens.narrow(1, 0, kSeq), tokens.narrow(1, 1, kSeq)};
}

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, kVocab}), targets.reshape(-1));
}

constexpr double kMuonLr = 0.05, kAdamWLr = 0.02, kGamma = 0.7;

MuonOptions muon_options() {
  return MuonOptions(kMuonLr)
      .newton_schulz(NewtonSchulzOptions().compute_dtype(at::kFloat))
      .weight_decay(0.01);
}
torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(kAdamWLr).weight_decay(0.01);
}
FsdpMuonConfig fsdp_config() { return FsdpMuonConfig().rates(CostRates()); }

ShardModuleOptions strategy_options(ShardingStrategy strategy) {
  return ShardModuleOptions().group_options(
      FsdpParameterGroupOptions().sharding_strategy(strategy));
}

// The user tier, as the README's loop writes it.
struct UserTier {
  TinyLm net = make_model();
  std::shared_ptr<ShardedModel> model;
  std::unique_ptr<MuonAdamW> optimizer;
  std::unique_ptr<torch::optim::StepLR> scheduler;
  ShardingStrategy strategy;

  explicit UserTier(ShardingStrategy strategy) : strategy(strategy) {
    model = shard(*net, world_ptr(), strategy_options(strategy));
    optimizer = std::make_unique<MuonAdamW>(model, muon_options(), adamw_options(),
                                            MuonAdamWConfig().fsdp_muon(fsdp_config()));
    scheduler = std::make_unique<torch::optim::StepLR>(*optimizer, 1, kGamma);
  }
  // Under kOptim the module as it is (the README's loop); else through the group boundaries.
  at::Tensor forward(const at::Tensor& tokens) {
    if (strategy == ShardingStrategy::kOptim) return net->forward(tokens);
    return net->forward_with(
        [&](auto child, const at::Tensor& x) { return model->forward(child, x); }, tokens);
  }
  double train_step(int64_t step) {
    const Batch b = batch_of(world().rank(), step);
    optimizer->zero_grad();
    const at::Tensor loss = loss_of(forward(b.inputs), b.targets);
    loss.backward();
    optimizer->step();
    scheduler->step();
    return loss.item<double>();
  }
  const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups() const { return model->groups(); }
};

// The same training with the explicit API: groups, two optimizers, the loop written out.
struct ExplicitApi {
  TinyLm net = make_model();
  std::vector<std::shared_ptr<FsdpParameterGroup>> groups_;
  std::unique_ptr<FsdpMuon> muon;
  std::unique_ptr<torch::optim::AdamW> adamw;
  std::vector<std::shared_ptr<FsdpParameterGroup>> refresh_after_step;
  int64_t steps_ = 0;  // for the schedule: StepLR(1, kGamma) scales from its second step() on

  explicit ExplicitApi(ShardingStrategy strategy) {
    groups_ = shard_module(*net, world_ptr(), strategy_options(strategy));
    std::vector<at::Tensor> batched, whole, others;
    for (const auto& g : groups_) {
      const bool hidden_group = g->name() == "b0" || g->name() == "b1";
      for (size_t i = 0; i < g->num_parameters(); ++i) {
        const size_t dim = g->slot(i).shape.size();
        (hidden_group && dim == 3   ? batched
         : hidden_group && dim == 2 ? whole
                                    : others)
            .push_back(g->sharded_parameter(i));
      }
      if (!hidden_group) refresh_after_step.push_back(g);
    }
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    param_groups.emplace_back(batched, std::make_unique<MuonOptions>(
                                           muon_options().matrix_layout(MatrixLayout::batched())));
    param_groups.emplace_back(whole, std::make_unique<MuonOptions>(muon_options()));
    muon = std::make_unique<FsdpMuon>(param_groups, muon_options(), fsdp_config());
    adamw = std::make_unique<torch::optim::AdamW>(others, adamw_options());
  }
  double train_step(int64_t step) {
    const Batch b = batch_of(world().rank(), step);
    for (auto& g : groups_) g->zero_grad();
    size_t k = 0;
    const at::Tensor logits = net->forward_with(
        [&](auto child, const at::Tensor& x) {
          return groups_[k++]->forward([&](const at::Tensor& in) { return child->forward(in); }, x);
        },
        b.inputs);
    const at::Tensor loss = loss_of(logits, b.targets);
    loss.backward();
    for (auto& g : groups_) g->reduce_scatter_grads();
    adamw->step();
    muon->step();
    for (auto& g : refresh_after_step) g->refresh_model_weights();
    if (steps_++ > 0) {
      for (torch::optim::Optimizer* opt : optimizers()) {
        for (auto& group : opt->param_groups()) {
          group.options().set_lr(group.options().get_lr() * kGamma);
        }
      }
    }
    return loss.item<double>();
  }
  std::vector<torch::optim::Optimizer*> optimizers() const { return {adamw.get(), muon.get()}; }
  const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups() const { return groups_; }
};

// Every group's main-weight shard, bit for bit.
template <typename A, typename B>
void expect_same_shards(const A& a, const B& b, const std::string& what) {
  ASSERT_EQ(a.groups().size(), b.groups().size());
  for (size_t g = 0; g < a.groups().size(); ++g) {
    EXPECT_TRUE(at::equal(a.groups()[g]->main_weight_shard(), b.groups()[g]->main_weight_shard()))
        << testing::failure_prefix() << what << ": group '" << a.groups()[g]->name() << "' differs";
  }
}

const ShardedModelParameter& parameter_named(const ShardedModel& model, const std::string& name) {
  for (const auto& p : model.parameters()) {
    if (p.name == name) return p;
  }
  throw std::runtime_error("no parameter " + name);
}

FSDP_MUON_WORLD_TEST(MuonAdamW, RoutesHiddenMatricesToMuonAndTheRestToAdamW) {
  UserTier user(ShardingStrategy::kOptim);
  const MuonAdamW& opt = *user.optimizer;
  for (const char* name : {"b0.experts", "b0.fc1.weight", "b0.fc2.weight", "b1.experts"}) {
    EXPECT_TRUE(opt.uses_muon(name)) << name;
  }
  for (const char* name : {"embed.weight", "head.weight", "head.bias", "b0.fc1.bias",
                           "b0.norm.weight", "b1.norm.bias"}) {
    EXPECT_FALSE(opt.uses_muon(name)) << name;
  }
  EXPECT_TRUE(parameter_named(*user.model, "embed.weight").embedding);
  EXPECT_TRUE(parameter_named(*user.model, "head.weight").output_head);
  EXPECT_FALSE(parameter_named(*user.model, "b1.fc2.weight").output_head);
  EXPECT_EQ(parameter_named(*user.model, "b1.experts").meta.sizes(),
            at::IntArrayRef({kExperts, kDim, kDim}));
  // One param group per layout (batched experts first: they come first), then AdamW's.
  ASSERT_EQ(opt.param_groups().size(), 3u);
  EXPECT_EQ(static_cast<const MuonOptions&>(opt.param_groups()[0].options()).matrix_layout(),
            MatrixLayout::batched());
  EXPECT_EQ(opt.param_groups()[1].params().size(), 4u);
  EXPECT_NE(dynamic_cast<const torch::optim::AdamWOptions*>(&opt.param_groups()[2].options()),
            nullptr);
  // Every 2-D weight to Muon instead, by a predicate.
  TinyLm net = make_model();
  auto model = shard(*net, world_ptr());
  MuonAdamW every_matrix(
      model, muon_options(), adamw_options(),
      MuonAdamWConfig()
          .fsdp_muon(fsdp_config())
          .use_muon([](const std::string&, const at::Tensor& p) { return p.dim() == 2; }));
  EXPECT_TRUE(every_matrix.uses_muon("embed.weight"));
  EXPECT_TRUE(every_matrix.uses_muon("head.weight"));
  EXPECT_FALSE(every_matrix.uses_muon("b0.experts"));
}

FSDP_MUON_WORLD_TEST(MuonAdamW, EqualsTheExplicitApiBitwiseUnderEveryStrategy) {
  for (ShardingStrategy strategy : {ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                    ShardingStrategy::kOptimGradsParams}) {
    const std::string what = std::string("strategy ") + to_string(strategy);
    UserTier user(strategy);
    ExplicitApi explicit_api(strategy);
    double first = 0, last = 0;
    for (int64_t step = 0; step < kSteps; ++step) {
      const double a = user.train_step(step);
      const double b = explicit_api.train_step(step);
      EXPECT_EQ(a, b) << testing::failure_prefix() << what << ", step " << step;
      (step == 0 ? first : last) = a;
    }
    expect_same_shards(user, explicit_api, what);
    // The scheduler scaled both learning rates after every step but the first; the inner
    // optimizers took them at each step (the last one ran with one scaling less).
    const double scaled = std::pow(kGamma, kSteps - 1);
    EXPECT_DOUBLE_EQ(user.optimizer->param_groups()[0].options().get_lr(), kMuonLr * scaled);
    EXPECT_DOUBLE_EQ(user.optimizer->param_groups()[2].options().get_lr(), kAdamWLr * scaled);
    EXPECT_DOUBLE_EQ(user.optimizer->muon()->param_groups()[1].options().get_lr(),
                     kMuonLr * scaled / kGamma);
    EXPECT_DOUBLE_EQ(user.optimizer->adamw()->param_groups()[0].options().get_lr(),
                     kAdamWLr * scaled / kGamma);
    EXPECT_LT(last, first) << testing::failure_prefix() << what << ": the loss did not fall";
  }
}

FSDP_MUON_WORLD_TEST(MuonAdamW, MicroBatchesAccumulateWithoutCommunication) {
  UserTier quiet(ShardingStrategy::kOptim), synced(ShardingStrategy::kOptim);
  const int rank = world().rank();
  const auto backward = [&](UserTier& t, int64_t micro) {
    const Batch b = batch_of(rank, 0, micro);
    loss_of(t.forward(b.inputs), b.targets).backward();
  };
  quiet.optimizer->zero_grad();
  world().reset_stats();
  quiet.model->set_requires_gradient_sync(false);
  backward(quiet, 0);
  const int64_t quiet_first = world().stats().reduce_scatter_bytes;
  quiet.model->set_requires_gradient_sync(true);
  backward(quiet, 1);
  const int64_t quiet_bytes = world().stats().reduce_scatter_bytes;
  quiet.optimizer->step();

  synced.optimizer->zero_grad();
  world().reset_stats();
  backward(synced, 0);
  backward(synced, 1);
  const int64_t synced_bytes = world().stats().reduce_scatter_bytes;
  synced.optimizer->step();

  EXPECT_EQ(quiet_first, 0);
  EXPECT_EQ(2 * quiet_bytes, synced_bytes);
  if (world().size() > 1) {
    EXPECT_GT(quiet_bytes, 0);
  }
  expect_same_shards(quiet, synced, "two micro-batches");
}

FSDP_MUON_WORLD_TEST(MuonAdamW, MisuseIsAClearError) {
  {
    UserTier user(ShardingStrategy::kOptim);
    user.model->set_requires_gradient_sync(false);
    testing::expect_error([&] { user.optimizer->step(); },
                          {"MuonAdamW", "gradient sync is off", "set_requires_gradient_sync"});
    testing::expect_error(
        [&] {
          user.optimizer->add_param_group(torch::optim::OptimizerParamGroup({at::zeros({2})}));
        },
        {"add_param_group", "fixed at construction"});
    torch::nn::Linear stranger(2, 2);
    testing::expect_error([&] { user.model->group_of(*stranger); },
                          {"group_of", "not one of this model's"});
  }
  {
    UserTier user(ShardingStrategy::kOptimGradsParams);
    testing::expect_error(
        [&] { user.model->set_requires_gradient_sync(false); },
        {"set_requires_gradient_sync(false)", "group 'embed'", "optim_grads_params", "kOptim"});
  }
  TinyLm net = make_model();
  auto model = shard(*net, world_ptr());
  testing::expect_error(
      [&] {
        MuonAdamW bad(model, muon_options(), adamw_options(),
                      MuonAdamWConfig()
                          .fsdp_muon(fsdp_config())
                          .use_muon([](const std::string&, const at::Tensor&) { return true; }));
      },
      {"parameter 'b0.norm.weight'", "neither 2-D nor 3-D", "use_muon"});
  testing::expect_error([&] { MuonAdamW none(nullptr); }, {"model is null"});
}

// ---- a checkpoint saved at W = 2 by the user tier, resumed at W = 3 by both tiers ----

constexpr int64_t kStepsBeforeSave = 2, kStepsAfterResume = 2;

void save_after_two_steps(const std::string& dir) {
  UserTier user(ShardingStrategy::kOptim);
  for (int64_t step = 0; step < kStepsBeforeSave; ++step) user.train_step(step);
  CheckpointUserState state;
  state.ints["step"] = kStepsBeforeSave;
  save_checkpoint(dir, *user.model, *user.optimizer, SaveCheckpointOptions().user_state(state));
}

void resume_and_compare(const std::string& dir) {
  // The user tier resumes under ZeRO-3, the explicit API under ZeRO-1: checkpoints hold shards
  // only, so the strategy may change too.
  UserTier user(ShardingStrategy::kOptimGradsParams);
  ExplicitApi explicit_api(ShardingStrategy::kOptim);
  const CheckpointUserState state = load_checkpoint(dir, *user.model, *user.optimizer);
  load_checkpoint(dir, explicit_api.groups(), explicit_api.optimizers());
  ASSERT_EQ(state.ints.at("step"), kStepsBeforeSave);
  // The learning rates come back as saved: scaled once (after step 1).
  EXPECT_DOUBLE_EQ(user.optimizer->param_groups()[0].options().get_lr(), kMuonLr * kGamma);
  EXPECT_DOUBLE_EQ(user.optimizer->param_groups()[2].options().get_lr(), kAdamWLr * kGamma);
  expect_same_shards(user, explicit_api, "after the load");
  for (int64_t step = kStepsBeforeSave; step < kStepsBeforeSave + kStepsAfterResume; ++step) {
    EXPECT_EQ(user.train_step(step), explicit_api.train_step(step))
        << testing::failure_prefix() << "step " << step;
  }
  expect_same_shards(user, explicit_api, "after resuming at W = 3");
}

std::string checkpoint_dir() {
  const char* v = std::getenv("FSDP_MUON_TRAINING_CHECKPOINT_DIR");
  return v != nullptr ? v : "";
}

TEST(MuonAdamWCheckpoint, SavedAtTwoRanksResumesAtThreeLikeTheExplicitApi) {
  if (!testing::in_process()) GTEST_SKIP() << "in-process only; the launched pair below runs it";
  const std::string dir = checkpoint_dir();
  ASSERT_FALSE(dir.empty()) << "FSDP_MUON_TRAINING_CHECKPOINT_DIR is not set (CTest sets it)";
  checkpoint::remove_tree(dir);
  testing::on_world_of(2, [&] { save_after_two_steps(dir); });
  testing::on_world_of(3, [&] { resume_and_compare(dir); });
}

FSDP_MUON_WORLD_TEST(MuonAdamWCheckpointSave, AfterTwoSteps) {
  if (testing::in_process()) GTEST_SKIP() << "launched only; the in-process test above runs it";
  const std::string dir = checkpoint_dir();
  ASSERT_FALSE(dir.empty()) << "FSDP_MUON_TRAINING_CHECKPOINT_DIR is not set (CTest sets it)";
  if (world().rank() == 0) checkpoint::remove_tree(dir);
  world().barrier();
  save_after_two_steps(dir);
}

FSDP_MUON_WORLD_TEST(MuonAdamWCheckpointResume, AtAnotherWorldSize) {
  if (testing::in_process()) GTEST_SKIP() << "launched only; the in-process test above runs it";
  const std::string dir = checkpoint_dir();
  ASSERT_FALSE(dir.empty()) << "FSDP_MUON_TRAINING_CHECKPOINT_DIR is not set (CTest sets it)";
  resume_and_compare(dir);
}

}  // namespace
}  // namespace fsdp_muon
