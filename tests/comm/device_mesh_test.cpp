// Communicator::split, all_reduce_async and DeviceMesh across real processes (CTest starts this
// under torchrun and mpirun at 1-4 and 6 ranks). Every value is a function of the world rank, so
// each rank checks exactly what its sub-communicators moved, and every counter its formula.

#include <numeric>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fsdp_muon/comm/device_mesh.h>

#include "common/distributed_main.h"
#include "common/test_util.h"

namespace fsdp_muon {
namespace {

using testing::expect_error;
using testing::world;
using testing::world_ptr;

at::Tensor longs(const std::vector<int64_t>& values) {
  return at::tensor(values, at::kLong).to(world().device());
}

std::vector<int64_t> host_values(Communicator& c, const at::Tensor& t) {
  const at::Tensor h = c.to_host(t).contiguous();
  return std::vector<int64_t>(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel());
}

FSDP_MUON_WORLD_TEST(Split, GroupsByColorAndRanksByKey) {
  const int w = world().size();
  const int r = world().rank();
  // Two colors (one when w == 1); keys reverse the order inside each.
  auto sub = world().split(/*color=*/r % 2, /*key=*/-r);
  std::vector<int64_t> members;
  for (int p = w - 1; p >= 0; --p) {
    if (p % 2 == r % 2) members.push_back(p);
  }
  ASSERT_EQ(sub->size(), static_cast<int>(members.size()));
  const auto mine = std::find(members.begin(), members.end(), r) - members.begin();
  EXPECT_EQ(sub->rank(), mine);
  EXPECT_EQ(sub->device(), world().device());
  EXPECT_EQ(sub->backend_name(), world().backend_name());

  // An all-gather of world ranks lands in the new rank order; only the sub's counters move.
  world().reset_stats();
  const at::Tensor all =
      at::empty({sub->size()}, at::TensorOptions().dtype(at::kLong).device(world().device()));
  sub->all_gather(longs({r}), all);
  EXPECT_EQ(host_values(*sub, all), members);
  EXPECT_EQ(sub->stats().all_gather_bytes, (sub->size() - 1) * 8);
  EXPECT_EQ(world().stats().calls, 0);

  // Sum over the group, synchronous and asynchronous alike.
  const int64_t sum = std::accumulate(members.begin(), members.end(), int64_t{0});
  at::Tensor t = longs({r, 1});
  sub->all_reduce(t);
  EXPECT_EQ(host_values(*sub, t), (std::vector<int64_t>{sum, sub->size()}));
  at::Tensor u = longs({r, 1});
  auto work = sub->all_reduce_async(u);
  work->wait();
  EXPECT_EQ(host_values(*sub, u), (std::vector<int64_t>{sum, sub->size()}));
  EXPECT_EQ(sub->stats().all_reduce_bytes, 2 * (2 * (sub->size() - 1) * 16 / sub->size()));

  // A split of a split: every rank alone.
  auto alone = sub->split(sub->rank(), 0);
  EXPECT_EQ(alone->size(), 1);
  at::Tensor v = longs({r});
  alone->all_reduce(v);
  EXPECT_EQ(host_values(*alone, v), (std::vector<int64_t>{r}));
  EXPECT_EQ(alone->stats().total_bytes(), 0);
}

FSDP_MUON_WORLD_TEST(Split, NegativeColorIsAnErrorOnEveryRank) {
  const int bad = world().size() - 1;
  expect_error([&] { world().split(world().rank() == bad ? -3 : 0, 0); },
               {"fsdp_muon::Communicator::split: rank " + std::to_string(bad),
                "passed color -3; colors must be >= 0"});
  // The communicator is still usable afterwards.
  at::Tensor t = longs({1});
  world().all_reduce(t);
  EXPECT_EQ(host_values(world(), t), (std::vector<int64_t>{world().size()}));
}

FSDP_MUON_WORLD_TEST(AllReduceAsync, MatchesAllReduceAndOverlapsAnother) {
  const int r = world().rank();
  const int w = world().size();
  at::Tensor a = at::arange(5, at::kFloat).add(r).to(world().device());
  at::Tensor b = a.clone();
  world().all_reduce(a);
  auto first = world().all_reduce_async(b, ReduceOp::kSum);
  at::Tensor m = longs({r});
  auto second = world().all_reduce_async(m, ReduceOp::kMax);
  second->wait();
  first->wait();
  EXPECT_TRUE(at::equal(a.cpu(), b.cpu()));
  EXPECT_EQ(host_values(world(), m), (std::vector<int64_t>{w - 1}));
}

// Every divisor of the world size as shard size.
FSDP_MUON_WORLD_TEST(DeviceMesh, EveryDivisorOfTheWorld) {
  const int w = world().size();
  const int r = world().rank();
  for (int s = 1; s <= w; ++s) {
    if (w % s != 0) continue;
    SCOPED_TRACE("shard_size " + std::to_string(s));
    const DeviceMesh mesh = make_device_mesh(world_ptr(), s);
    EXPECT_EQ(mesh.world.get(), &world());
    EXPECT_EQ(mesh.shard_size(), s);
    EXPECT_EQ(mesh.replicas(), w / s);
    EXPECT_EQ(mesh.replica(), r / s);
    EXPECT_EQ(mesh.shard->rank(), r % s);
    EXPECT_EQ(mesh.world_rank(mesh.replica(), mesh.shard->rank()), r);
    EXPECT_EQ(mesh.shape(), std::to_string(w / s) + "x" + std::to_string(s));
    EXPECT_EQ(mesh.one_dimensional(), s == w);
    if (s == w) {
      EXPECT_EQ(mesh.shard.get(), &world());  // today's 1-D case: the same communicator
    }
    // The shard group is the contiguous block of this replica, the replicate group the ranks of
    // this shard rank in every replica.
    at::Tensor in_shard = longs({r});
    mesh.shard->all_reduce(in_shard);
    const int first = (r / s) * s;
    EXPECT_EQ(host_values(*mesh.shard, in_shard)[0], int64_t{s} * first + s * (s - 1) / 2);
    at::Tensor in_replica = longs({r});
    mesh.replicate->all_reduce(in_replica);
    int64_t expected = 0;
    for (int q = 0; q < w / s; ++q) expected += q * s + r % s;
    EXPECT_EQ(host_values(*mesh.replicate, in_replica)[0], expected);
    EXPECT_TRUE(mesh.same_as(mesh));
  }
}

FSDP_MUON_WORLD_TEST(DeviceMesh, OneDimensionalMeshIsNotACollective) {
  world().reset_stats();
  const DeviceMesh mesh = one_dimensional_mesh(world_ptr());
  EXPECT_EQ(world().stats().calls, 0);
  EXPECT_EQ(mesh.shard.get(), &world());
  EXPECT_EQ(mesh.replicas(), 1);
  EXPECT_TRUE(mesh.one_dimensional());
  at::Tensor t = longs({7});
  mesh.replicate->all_reduce(t);
  EXPECT_EQ(host_values(world(), t), (std::vector<int64_t>{7}));
  // Two 1-D meshes of one communicator are the same mesh.
  EXPECT_TRUE(mesh.same_as(one_dimensional_mesh(world_ptr())));
}

FSDP_MUON_WORLD_TEST(DeviceMesh, ShardSizeThatDoesNotDivideIsAnErrorOnEveryRank) {
  const int w = world().size();
  const int bad = w + 1;
  expect_error([&] { make_device_mesh(world_ptr(), bad); },
               {"fsdp_muon::make_device_mesh: shard_size=" + std::to_string(bad) +
                    " does not divide the world size " + std::to_string(w),
                "pass a divisor"});
  expect_error([&] { make_device_mesh(world_ptr(), 0); }, {"shard_size=0 does not divide"});
  if (w == 4 || w == 6) {
    expect_error([&] { make_device_mesh(world_ptr(), w == 4 ? 3 : 4); },
                 {"does not divide the world size " + std::to_string(w)});
  }
}

FSDP_MUON_WORLD_TEST(DeviceMesh, RanksPassingDifferentShardSizesFailTogether) {
  const int w = world().size();
  if (w < 2) GTEST_SKIP() << "needs two ranks";
  expect_error([&] { make_device_mesh(world_ptr(), world().rank() == w - 1 ? 1 : w); },
               {"fsdp_muon::make_device_mesh: rank " + std::to_string(w - 1) +
                    " passed shard_size=1 but rank 0 passed " + std::to_string(w),
                "every rank must pass the same shard size"});
}

}  // namespace
}  // namespace fsdp_muon
