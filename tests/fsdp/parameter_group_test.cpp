// FsdpParameterGroup and shard_module on one rank (a transport-free world-size-1
// communicator): aliasing of the module's tensors, in-place gradient accumulation, zero_grad
// and its repair, mixed precision, the sharded-parameter lookup, grouping and errors. The
// multi-rank behaviour is tested by parameter_group_distributed_test.cpp.

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp/shard_module.h>

#include "common/local_communicator.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

std::shared_ptr<Communicator> local() { return std::make_shared<testing::LocalCommunicator>(); }

// True when `view` lies inside `buffer`'s memory.
bool inside(const at::Tensor& view, const at::Tensor& buffer) {
  if (!view.is_alias_of(buffer)) return false;
  return view.storage_offset() >= buffer.storage_offset() &&
         view.storage_offset() + view.numel() <= buffer.storage_offset() + buffer.numel();
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    scale = register_parameter("scale", torch::ones({3}));
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    act = register_module("act", torch::nn::Tanh());
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(act(fc1(x))) * scale; }
  torch::Tensor scale;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Tanh act{nullptr};
};
TORCH_MODULE(Net);

std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

TEST(AccumulateGrad, AddsIntoADefinedGradInPlace) {
  // The whole design rests on this LibTorch behaviour: with a defined .grad() and grad mode
  // off during backward, AccumulateGrad does `grad += new_grad` on the same tensor.
  torch::Tensor buffer = torch::zeros({6});
  torch::Tensor w = torch::ones({2, 3}, torch::requires_grad());
  w.mutable_grad() = buffer.view({2, 3});
  const c10::TensorImpl* impl = w.grad().unsafeGetTensorImpl();
  (w * 2).sum().backward();
  (w * 3).sum().backward();
  EXPECT_EQ(w.grad().unsafeGetTensorImpl(), impl);
  EXPECT_TRUE(torch::equal(buffer, torch::full({6}, 5.0)));
}

TEST(FsdpParameterGroup, ModuleParametersAliasTheModelWeights) {
  torch::manual_seed(0);
  Net net;
  const auto before = clone_all(net->parameters());
  auto groups = shard_module(*net, local());
  ASSERT_EQ(groups.size(), 3u);  // own "scale", fc1, fc2; act has no parameters
  EXPECT_EQ(groups[0]->name(), "");
  EXPECT_EQ(groups[1]->name(), "fc1");
  EXPECT_EQ(groups[2]->name(), "fc2");
  EXPECT_EQ(groups[1]->slot(0).name, "fc1.weight");
  EXPECT_EQ(groups[1]->slot(1).name, "fc1.bias");

  const auto params = net->parameters();
  ASSERT_EQ(params.size(), before.size());
  size_t k = 0;
  for (const auto& group : groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
      EXPECT_TRUE(inside(params[k], group->model_weights())) << group->slot(i).name;
      EXPECT_TRUE(inside(params[k].grad(), group->full_grad_buffer())) << group->slot(i).name;
      EXPECT_TRUE(params[k].requires_grad());
      EXPECT_TRUE(params[k].is_same(group->model_parameters()[i]));
      EXPECT_TRUE(torch::equal(params[k], before[k]));
      // World size 1: the rank holds all of it, in the main-weight shard.
      EXPECT_TRUE(torch::equal(group->sharded_parameter(i), before[k].reshape({-1})));
      EXPECT_TRUE(inside(group->sharded_parameter(i), group->main_weight_shard()));
      EXPECT_TRUE(inside(group->sharded_parameter(i).grad(), group->grad_shard()));
      EXPECT_TRUE(group->sharded_parameter(i).requires_grad());
    }
  }
}

TEST(FsdpParameterGroup, BackwardAccumulatesIntoTheFlatBufferAndZeroGradKeepsIt) {
  torch::manual_seed(1);
  Net net;
  auto groups = shard_module(*net, local());
  const torch::Tensor x = torch::randn({4, 5});
  net->forward(x).sum().backward();
  std::vector<torch::Tensor> once;
  for (const auto& p : net->parameters()) once.push_back(p.grad().clone());
  net->forward(x).sum().backward();
  size_t k = 0;
  for (const auto& group : groups) {
    for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
      const auto p = group->model_parameters()[i];
      EXPECT_TRUE(inside(p.grad(), group->full_grad_buffer()));
      EXPECT_TRUE(torch::allclose(p.grad(), 2 * once[k]));
    }
    const ParameterSlot& slot = group->slot(0);
    EXPECT_TRUE(torch::equal(group->full_grad_buffer().narrow(0, slot.offset, slot.numel),
                             group->model_parameters()[0].grad().reshape({-1})));
    group->reduce_scatter_grads();
    EXPECT_TRUE(torch::equal(group->grad_shard(), group->full_grad_buffer()));
    const auto grad_views = group->model_parameters();
    const c10::TensorImpl* impl = grad_views[0].grad().unsafeGetTensorImpl();
    group->zero_grad();
    EXPECT_EQ(grad_views[0].grad().unsafeGetTensorImpl(), impl);
    EXPECT_EQ(group->full_grad_buffer().abs().sum().item<float>(), 0.0f);
    EXPECT_EQ(group->grad_shard().abs().sum().item<float>(), 0.0f);
  }
}

TEST(FsdpParameterGroup, ReduceScatterRepairsGradsClearedBySetToNone) {
  torch::manual_seed(2);
  Net net;
  Net reference;
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    torch::NoGradGuard g;
    reference->parameters()[i].copy_(net->parameters()[i]);
  }
  auto groups = shard_module(*net, local());
  const torch::Tensor x = torch::randn({4, 5});
  net->forward(x).sum().backward();  // leaves stale values in the buffer
  net->zero_grad();                  // set_to_none: .grad() undefined
  std::vector<torch::Tensor> sharded;
  for (const auto& g : groups) {
    for (const auto& sp : g->sharded_parameters()) sharded.push_back(sp);
  }
  torch::optim::AdamW adamw(sharded);
  adamw.zero_grad(/*set_to_none=*/false);  // zeroes the gradient shard in place
  EXPECT_TRUE(inside(sharded[0].grad(), groups[0]->grad_shard()));
  adamw.zero_grad();  // set_to_none, on the sharded parameters
  EXPECT_FALSE(sharded[0].grad().defined());
  const torch::Tensor x2 = torch::randn({4, 5});
  net->forward(x2).sum().backward();  // autograd creates fresh .grad() tensors elsewhere
  reference->forward(x2).sum().backward();
  const auto ref = reference->parameters();
  size_t k = 0;
  for (const auto& group : groups) {
    group->reduce_scatter_grads();
    for (size_t i = 0; i < group->num_parameters(); ++i, ++k) {
      const auto p = group->model_parameters()[i];
      EXPECT_TRUE(inside(p.grad(), group->full_grad_buffer())) << group->slot(i).name;
      EXPECT_TRUE(inside(group->sharded_parameter(i).grad(), group->grad_shard()));
      EXPECT_TRUE(torch::equal(group->sharded_parameter(i).grad(), ref[k].grad().reshape({-1})))
          << group->slot(i).name;
    }
  }
}

TEST(FsdpParameterGroup, UnusedParameterAfterSetToNoneReducesAsZero) {
  auto a = torch::randn({3}, torch::requires_grad());
  auto b = torch::randn({3}, torch::requires_grad());
  auto group = std::make_shared<FsdpParameterGroup>(
      std::vector<std::pair<std::string, at::Tensor>>{{"a", a}, {"b", b}}, local());
  (a * b).sum().backward();
  a.mutable_grad() = at::Tensor();
  b.mutable_grad() = at::Tensor();
  (b * 2).sum().backward();  // a unused
  group->reduce_scatter_grads();
  EXPECT_TRUE(torch::equal(group->sharded_parameter(0).grad(), torch::zeros({3})));
  EXPECT_TRUE(torch::equal(group->sharded_parameter(1).grad(), torch::full({3}, 2.0)));
}

TEST(FsdpParameterGroup, GradientsReplacedByAutogradAreCopiedBack) {
  // create_graph=true makes AccumulateGrad replace .grad() (grad + new) instead of adding in
  // place; Module::zero_grad(false) swaps in a detached alias. Both must still reduce right.
  auto w = torch::ones({4}, torch::requires_grad());
  auto group = std::make_shared<FsdpParameterGroup>(
      std::vector<std::pair<std::string, at::Tensor>>{{"w", w}}, local());
  (w * 2).sum().backward();
  (w * w).sum().backward({}, /*retain_graph=*/true, /*create_graph=*/true);
  EXPECT_FALSE(inside(w.grad(), group->full_grad_buffer()));
  group->reduce_scatter_grads();
  EXPECT_TRUE(inside(w.grad(), group->full_grad_buffer()));
  EXPECT_TRUE(torch::equal(group->sharded_parameter(0).grad(), torch::full({4}, 4.0)));

  struct Holder : torch::nn::Module {
    explicit Holder(const at::Tensor& t) { register_parameter("w", t); }
  } holder(w);
  holder.zero_grad(/*set_to_none=*/false);
  (w * 3).sum().backward();
  group->reduce_scatter_grads();
  EXPECT_TRUE(torch::equal(group->sharded_parameter(0).grad(), torch::full({4}, 3.0)));
}

TEST(FsdpParameterGroup, FrozenParametersGetNoGradient) {
  auto frozen = torch::ones({3});  // requires_grad false
  auto w = torch::ones({3}, torch::requires_grad());
  auto group = std::make_shared<FsdpParameterGroup>(
      std::vector<std::pair<std::string, at::Tensor>>{{"frozen", frozen}, {"w", w}}, local());
  EXPECT_FALSE(group->sharded_parameter(0).requires_grad());
  EXPECT_FALSE(group->sharded_parameter(0).grad().defined());
  EXPECT_TRUE(group->sharded_parameter(1).requires_grad());
  torch::optim::AdamW adamw(group->sharded_parameters(),
                            torch::optim::AdamWOptions(0.1).weight_decay(0.5));
  (w * frozen).sum().backward();
  group->reduce_scatter_grads();
  EXPECT_FALSE(frozen.grad().defined());
  adamw.step();
  group->refresh_model_weights();
  EXPECT_TRUE(torch::equal(frozen, torch::ones({3})));  // skipped: no decay, no update
  EXPECT_FALSE(torch::equal(w, torch::ones({3})));
}

TEST(FsdpParameterGroup, RefreshCopiesMainWeightsIntoTheModuleParameters) {
  torch::manual_seed(3);
  Net net;
  auto groups = shard_module(*net, local());
  for (const auto& group : groups) {
    torch::NoGradGuard g;
    for (const auto& sp : group->sharded_parameters()) sp.add_(1.0);
  }
  const auto stale = clone_all(net->parameters());
  const auto version = net->fc1->weight._version();
  for (const auto& group : groups) group->refresh_model_weights();
  const auto params = net->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_TRUE(torch::equal(params[k], stale[k] + 1.0));
  }
  EXPECT_GT(net->fc1->weight._version(), version);
}

TEST(FsdpParameterGroup, RefreshRejectsAModuleMovedAwayFromTheBuffer) {
  auto w = torch::randn({4}, torch::requires_grad());
  FsdpParameterGroup group({{"w", w}}, local(), FsdpParameterGroupOptions().name("g"));
  w.set_data(torch::randn({4}));
  try {
    group.refresh_model_weights();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'w' no longer points into"), std::string::npos)
        << e.what();
  }
}

TEST(FsdpParameterGroup, MixedPrecisionKeepsFp32MainWeights) {
  torch::manual_seed(4);
  auto w = torch::randn({3, 5}, torch::requires_grad());
  const auto original = w.detach().clone();
  for (auto reduce : {at::kBFloat16, at::kFloat}) {
    auto p = original.clone().requires_grad_(true);
    FsdpParameterGroup group(
        {{"w", p}}, local(),
        FsdpParameterGroupOptions().compute_dtype(at::kBFloat16).reduce_dtype(reduce));
    EXPECT_EQ(p.scalar_type(), at::kBFloat16);  // the module computes in bf16 now
    EXPECT_EQ(group.compute_dtype(), at::kBFloat16);
    EXPECT_EQ(group.model_weights().scalar_type(), at::kBFloat16);
    EXPECT_EQ(group.full_grad_buffer().scalar_type(), at::kBFloat16);
    EXPECT_EQ(group.main_weight_shard().scalar_type(), at::kFloat);
    EXPECT_EQ(group.grad_shard().scalar_type(), at::kFloat);
    // Main weights start from the fp32 values, not from their bf16 rounding.
    EXPECT_TRUE(torch::equal(group.sharded_parameter(0), original.reshape({-1})));
    EXPECT_TRUE(torch::equal(p, original.to(at::kBFloat16)));
    EXPECT_EQ(p.grad().scalar_type(), at::kBFloat16);
    (p.to(at::kFloat) * 3).sum().backward();
    group.reduce_scatter_grads();
    EXPECT_TRUE(torch::equal(group.sharded_parameter(0).grad(), torch::full({15}, 3.0)));
    {
      torch::NoGradGuard g;
      group.sharded_parameter(0).add_(1e-3);
    }
    group.refresh_model_weights();
    EXPECT_TRUE(torch::equal(p, (original + 1e-3).to(at::kBFloat16)));
  }
}

TEST(FsdpParameterGroup, AdamWOnShardedParametersMatchesAdamWOnTheModule) {
  torch::manual_seed(5);
  Net net;
  Net reference;
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    torch::NoGradGuard g;
    reference->parameters()[i].copy_(net->parameters()[i]);
  }
  auto groups = shard_module(*net, local());
  std::vector<torch::Tensor> sharded;
  for (const auto& g : groups) {
    for (const auto& sp : g->sharded_parameters()) sharded.push_back(sp);
  }
  const auto opts = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW adamw(sharded, opts);
  torch::optim::AdamW ref_adamw(reference->parameters(), opts);
  for (int step = 0; step < 5; ++step) {
    const torch::Tensor x = torch::randn({4, 5});
    for (auto& g : groups) g->zero_grad();
    ref_adamw.zero_grad();
    net->forward(x).pow(2).sum().backward();
    reference->forward(x).pow(2).sum().backward();
    for (auto& g : groups) g->reduce_scatter_grads();
    adamw.step();
    ref_adamw.step();
    for (auto& g : groups) g->refresh_model_weights();
    const auto params = net->parameters();
    const auto ref = reference->parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      EXPECT_TRUE(torch::equal(params[k], ref[k])) << "step " << step << " parameter " << k;
    }
  }
}

TEST(FsdpParameterGroup, AdamWHandlesAnEmptyShardedParameter) {
  auto empty = torch::zeros({0, 4}, torch::requires_grad());
  auto w = torch::ones({4}, torch::requires_grad());
  auto group = std::make_shared<FsdpParameterGroup>(
      std::vector<std::pair<std::string, at::Tensor>>{{"empty", empty}, {"w", w}}, local());
  EXPECT_EQ(group->sharded_parameter(0).sizes(), at::IntArrayRef({0}));
  EXPECT_EQ(group->sharded_parameter(0).grad().sizes(), at::IntArrayRef({0}));
  torch::optim::AdamW adamw(group->sharded_parameters(), torch::optim::AdamWOptions(0.1));
  (w * empty.sum(0)).sum().backward();
  (w * 2).sum().backward();
  group->reduce_scatter_grads();
  adamw.step();
  group->refresh_model_weights();
  EXPECT_TRUE(torch::allclose(w, torch::full({4}, 1.0 - 0.1 - 0.1 * 1e-2)));
}

TEST(FsdpParameterGroup, FindShardedParameter) {
  auto a = torch::randn({2, 3}, torch::requires_grad());
  auto b = torch::randn({5}, torch::requires_grad());
  auto group = std::make_shared<FsdpParameterGroup>(
      std::vector<std::pair<std::string, at::Tensor>>{{"a", a}, {"b", b}}, local(),
      FsdpParameterGroupOptions().name("blk"));
  const torch::Tensor handle = group->sharded_parameters()[1];  // a copy of the handle
  auto info = find_sharded_parameter(handle);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->group.get(), group.get());
  EXPECT_EQ(info->index, 1u);
  EXPECT_EQ(info->slot().name, "b");
  EXPECT_EQ(info->slot().shape, std::vector<int64_t>({5}));
  EXPECT_EQ(find_sharded_parameter(group->sharded_parameter(0))->slot().shape,
            std::vector<int64_t>({2, 3}));
  // Anything else is not a sharded parameter: the module's tensors, views, copies, undefined.
  EXPECT_FALSE(find_sharded_parameter(a).has_value());
  EXPECT_FALSE(find_sharded_parameter(handle.view({5})).has_value());
  EXPECT_FALSE(find_sharded_parameter(handle.clone()).has_value());
  EXPECT_FALSE(find_sharded_parameter(torch::Tensor()).has_value());
  EXPECT_FALSE(find_sharded_parameter(group->main_weight_shard()).has_value());
  info.reset();
  group.reset();  // entries leave with the group
  EXPECT_FALSE(find_sharded_parameter(handle).has_value());
  // A group not owned by a shared_ptr cannot hand out one.
  auto c = torch::randn({2}, torch::requires_grad());
  FsdpParameterGroup on_stack({{"c", c}}, local());
  EXPECT_FALSE(find_sharded_parameter(on_stack.sharded_parameter(0)).has_value());
}

TEST(FsdpParameterGroup, RejectsBadParameters) {
  using Named = std::vector<std::pair<std::string, at::Tensor>>;
  auto f32 = torch::randn({3}, torch::requires_grad());
  auto f64 = torch::randn({3}, torch::dtype(torch::kDouble).requires_grad(true));
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"a", f32}, {"b", f64}}, local());
      },
      {"must share one dtype"});
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"a", f32}, {"a", torch::randn({2})}}, local());
      },
      {"parameter name 'a' appears twice"});
  testing::expect_error([&] { FsdpParameterGroup({{"", f32}}, local()); }, {"empty name"});
  // Every message starts with the class, then the group's name when it has one.
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"", f32}}, local());
      },
      {"fsdp_muon::FsdpParameterGroup: a parameter has an empty name"});
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"", f32}}, local(), FsdpParameterGroupOptions().name("g"));
      },
      {"fsdp_muon::FsdpParameterGroup: group 'g': a parameter has an empty name"});
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"a", f32}, {"b", f32}}, local());
      },
      {"tied weights"});
  testing::expect_error([&] { FsdpParameterGroup(Named{}, local()); }, {"no parameters"});
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"i", torch::ones({3}, torch::kLong)}}, local());
      },
      {"only floating-point"});
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"s", torch::eye(3).to_sparse()}}, local());
      },
      {"not a dense strided tensor"});
  testing::expect_error([&] { FsdpParameterGroup({{"x", f32 * 2}}, local()); }, {"not a leaf"});
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"a", f32}}, nullptr);
      },
      {"communicator is null"});
  testing::expect_error(
      [&] {
        FsdpParameterGroup({{"a", f32}}, local(), FsdpParameterGroupOptions().alignment_bytes(6));
      },
      {"alignment_bytes"});
  // Nothing was re-pointed by the failed constructions.
  EXPECT_EQ(f32.grad().defined(), false);
}

TEST(ShardModule, PolicyGroupsByKeyInOrderOfFirstAppearance) {
  torch::manual_seed(6);
  Net net;
  ShardModuleOptions options;
  options.policy([](const std::string&, const at::Tensor& p) {
    return p.dim() >= 2 ? std::string("matrices") : std::string("vectors");
  });
  auto groups = shard_module(*net, local(), options);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0]->name(), "vectors");  // "scale" comes first
  EXPECT_EQ(groups[1]->name(), "matrices");
  std::vector<std::string> vectors, matrices;
  for (size_t i = 0; i < groups[0]->num_parameters(); ++i)
    vectors.push_back(groups[0]->slot(i).name);
  for (size_t i = 0; i < groups[1]->num_parameters(); ++i)
    matrices.push_back(groups[1]->slot(i).name);
  EXPECT_EQ(vectors, std::vector<std::string>({"scale", "fc1.bias", "fc2.bias"}));
  EXPECT_EQ(matrices, std::vector<std::string>({"fc1.weight", "fc2.weight"}));
  EXPECT_EQ(groups[1]->index_of("fc2.weight"), std::optional<size_t>(1));
  EXPECT_FALSE(groups[1]->index_of("scale").has_value());
}

TEST(ShardModule, GroupOptionsReachEveryGroup) {
  Net net;
  auto groups = shard_module(
      *net, local(),
      ShardModuleOptions().group_options(
          FsdpParameterGroupOptions().compute_dtype(at::kBFloat16).alignment_bytes(64)));
  for (const auto& g : groups) {
    EXPECT_EQ(g->model_weights().scalar_type(), at::kBFloat16);
    for (size_t i = 0; i < g->num_parameters(); ++i) EXPECT_EQ(g->slot(i).offset % 32, 0);
  }
  EXPECT_EQ(net->fc1->weight.scalar_type(), at::kBFloat16);
}

// A world of one whose asynchronous all-gathers fail when waited for, as on a communicator that
// was aborted (a timeout, a dead peer).
class FailedWork final : public CommWork {
 protected:
  void do_wait() override { TORCH_CHECK(false, "the communicator was aborted (test)"); }
};

class AbortedGatherCommunicator final : public Communicator {
 public:
  AbortedGatherCommunicator() : Communicator(/*rank=*/0, /*size=*/1) {}
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::string backend_name() const override { return "aborted"; }

 protected:
  void do_all_to_all_v(const at::Tensor& send, const std::vector<int64_t>&, const at::Tensor& recv,
                       const std::vector<int64_t>&) override {
    recv.copy_(send);
  }
  void do_all_gather(const at::Tensor& send, const at::Tensor& recv) override { recv.copy_(send); }
  void do_all_gather_v(const at::Tensor& send, const at::Tensor& recv,
                       const std::vector<int64_t>&) override {
    recv.copy_(send);
  }
  void do_reduce_scatter_mean(const at::Tensor& send, const at::Tensor& recv) override {
    recv.copy_(send);
  }
  void do_all_reduce(const at::Tensor&, ReduceOp) override {}
  void do_broadcast(const at::Tensor&, int) override {}
  void do_barrier() override {}
  std::unique_ptr<CommWork> do_all_gather_async(const at::Tensor&, const at::Tensor&) override {
    return std::make_unique<FailedWork>();
  }
};

// A gather that fails leaves the group resharded: zero_grad() and reshard() work, and every
// later use of the weights fails with the same clear error instead of touching a gather that
// is gone.
TEST(FsdpParameterGroup, AFailedGatherLeavesTheGroupResharded) {
  at::Tensor w = torch::randn({3, 4}, torch::requires_grad());
  auto group = std::make_shared<FsdpParameterGroup>(
      std::vector<std::pair<std::string, at::Tensor>>{{"w", w}},
      std::make_shared<AbortedGatherCommunicator>(),
      FsdpParameterGroupOptions().sharding_strategy(ShardingStrategy::kOptimGradsParams));
  const std::string failed = "gathering the weights failed: the communicator was aborted (test)";
  auto forward = [&] {
    group->forward([&](const at::Tensor& x) { return x.matmul(w); }, torch::ones({2, 3}));
  };
  testing::expect_error(forward, {failed});
  group->reshard();
  group->zero_grad();
  testing::expect_error(forward, {failed});
  testing::expect_error([&] { group->unshard(); }, {failed});
  group->reshard();
  group->zero_grad();
  EXPECT_EQ(group->unsharded_bytes(), 0);
}

TEST(ShardModule, RejectsTiedWeights) {
  struct Tied : torch::nn::Module {
    Tied() {
      a = register_module("a", torch::nn::Linear(3, 3));
      register_parameter("tied", a->weight);  // the same tensor under a second name
    }
    torch::nn::Linear a{nullptr};
  } tied;
  testing::expect_error([&] { shard_module(tied, local()); },
                        {"'tied' and 'a.weight' are the same tensor"});
}

}  // namespace
}  // namespace fsdp_muon
