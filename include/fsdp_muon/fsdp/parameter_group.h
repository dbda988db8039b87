#pragma once
// FsdpParameterGroup (docs/DESIGN.md §2): an ordered list of named parameters of one dtype, packed
// into flat buffers that are sharded evenly across the ranks of a Communicator, or across the
// shard group of a DeviceMesh and replicated over its replicas (HSDP).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/config.h>
#include <fsdp_muon/fsdp/group_options.h>

namespace fsdp_muon {

// Where one parameter lives in the flat layout.
struct FSDP_MUON_API ParameterSlot {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // element offset of its first element in the padded flat buffer
};

class FSDP_MUON_API FsdpParameterGroup : public std::enable_shared_from_this<FsdpParameterGroup> {
 public:
  // The tensors are the module's parameters: they are re-pointed to views into the group's
  // unsharded model-weight buffer, and their .grad() to views into its full-gradient buffer.
  // Every rank of `comm` must construct the same group (names, shapes, dtypes, order, options);
  // the ranks compare what they built before the group's first collective, and where it differs
  // (or a parameter is invalid on some rank) every rank throws, naming the ranks that differ from
  // rank 0 and the first difference.
  // On `comm` alone: the 1-D mesh one_dimensional_mesh(comm) (no collective of its own).
  FsdpParameterGroup(std::vector<std::pair<std::string, at::Tensor>> named_params,
                     std::shared_ptr<Communicator> comm, FsdpParameterGroupOptions options = {});
  // On a mesh (HSDP, docs/DESIGN.md §2, Meshes): sharded over mesh.shard, replicated over
  // mesh.replicate. Every rank of mesh.world builds the same group on a mesh of the same shape;
  // the parameters start as world rank 0's (broadcast_from_rank0). Gradients are reduce-scattered
  // (mean) in the shard group, then all-reduced (mean) over the replicas, so every replica holds
  // the same gradient and main-weight shards. On a 1-D mesh (replicas() == 1) this is exactly
  // the communicator constructor on mesh.shard.
  FsdpParameterGroup(std::vector<std::pair<std::string, at::Tensor>> named_params,
                     const DeviceMesh& mesh, FsdpParameterGroupOptions options = {});
  ~FsdpParameterGroup();
  FsdpParameterGroup(const FsdpParameterGroup&) = delete;
  FsdpParameterGroup& operator=(const FsdpParameterGroup&) = delete;

  // ---- layout ----
  const std::string& name() const;
  size_t num_parameters() const;
  const ParameterSlot& slot(size_t index) const;
  // Layout calls are in shard ranks (0..communicator()->size() - 1), the same in every replica.
  int64_t padded_numel() const;  // multiple of the shard size
  int64_t shard_numel() const;   // padded_numel() / shard size
  // Elements [first, second) of parameter `index` (flattened, row-major) that shard rank `rank`
  // holds; first == second when it holds none of it.
  std::pair<int64_t, int64_t> held_range(size_t index, int rank) const;
  // held_range(index, communicator()->rank()).
  std::pair<int64_t, int64_t> held_range(size_t index) const;
  // Element offset in `rank`'s shard (main weights, gradients) where its held part of parameter
  // `index` starts; 0 when it holds none of it.
  int64_t shard_offset(size_t index, int rank) const;
  // Index of the parameter named `name`, or nullopt.
  std::optional<size_t> index_of(const std::string& name) const;
  c10::ScalarType compute_dtype() const;  // dtype of model weights and full gradients
  c10::ScalarType main_dtype() const;     // dtype of main weights and gradient shards
  // The communicator the group is sharded over: mesh().shard (the one it was built on, for the
  // communicator constructor).
  const std::shared_ptr<Communicator>& communicator() const;
  const DeviceMesh& mesh() const;
  const FsdpParameterGroupOptions& options() const;

  // ---- what optimizers see ----
  // One per parameter, in order: the 1-D local slice of the main weights (shape {0} when this
  // rank holds none of it), whose .grad() is the matching slice of the gradient shard.
  std::vector<at::Tensor> sharded_parameters() const;
  const at::Tensor& sharded_parameter(size_t index) const;

  // ---- buffers ----
  // flat, padded, compute dtype; an error while resharded (kOptimGradsParams: unshard() first)
  const at::Tensor& model_weights() const;
  // flat, padded, compute dtype; under kOptimGrads/kOptimGradsParams an error outside the
  // group's backward (the gradients are in grad_shard())
  const at::Tensor& full_grad_buffer() const;
  const at::Tensor& main_weight_shard() const;       // flat, shard_numel(), main dtype
  const at::Tensor& grad_shard() const;              // flat, shard_numel(), main dtype
  std::vector<at::Tensor> model_parameters() const;  // the module's tensors (views)

  // ---- the FSDP cycle ----
  // Zeroes the full-gradient buffer and the gradient shards in place and (re)installs the
  // views as the .grad() of the module's parameters and of the sharded parameters. Use it
  // instead of Module::zero_grad() / Optimizer::zero_grad(), whose default set_to_none=true
  // detaches .grad() from the buffers (reduce_scatter_grads() repairs that, at a copy's cost).
  // Under kOptimGrads/kOptimGradsParams: finishes a reduce-scatter in flight, frees any full
  // gradients and unused prefetched weights, zeroes the gradient shards; the module's .grad()
  // stay undefined until the group's next backward.
  void zero_grad();
  // After backward: average the full gradients over ranks into the gradient shards (one
  // reduce-scatter; on a mesh of several replicas then one all-reduce over the replicas). A module
  // parameter whose .grad() is no longer the buffer view (set to None and re-created by autograd,
  // or replaced) has it copied in (undefined: zeros) and the view re-installed; the sharded
  // parameters' .grad() are re-installed too. Under kOptimGrads/kOptimGradsParams the
  // reduce-scatters were started during backward: this waits for the group's, frees the weights of
  // a prefetch nobody used, and refuses a module .grad() that did not come from a backward through
  // forward().
  void reduce_scatter_grads();
  // Under kOptim: whether a backward has accumulated gradients into the full gradients since the
  // last reduce_scatter_grads() or zero_grad(), i.e. the gradient shards do not hold them yet
  // (several backwards before one reduce_scatter_grads() accumulate micro-batches, as intended).
  // FsdpMuon::step() refuses to run while it is true on any rank. Always false under
  // kOptimGrads/kOptimGradsParams, which reduce during backward.
  bool has_unreduced_gradients() const;
  // Main-weight shards -> full model weights (cast to the compute dtype, one all-gather).
  // Under kOptimGradsParams while resharded: nothing is gathered; the next unshard() (forward)
  // gathers the new main weights.
  void refresh_model_weights();

  // ---- full sharding (docs/DESIGN.md §2, Sharding strategies) ----
  ShardingStrategy sharding_strategy() const;
  // Runs fn(input) with this group's model weights unsharded, and under kOptimGradsParams
  // reshards them when fn returns. Through autograd, backward unshards them again before fn's
  // backward runs, and under kOptimGrads/kOptimGradsParams the group's gradients are
  // reduce-scattered into the gradient shard as soon as they are all accumulated, and the full
  // gradients freed. Works under every strategy, so one loop serves all three. This is the C++
  // counterpart of FSDP2's pre/post-forward hooks. An output that views the weights is an
  // error under kOptimGradsParams (they are freed when fn returns).
  at::Tensor forward(const std::function<at::Tensor(const at::Tensor&)>& fn,
                     const at::Tensor& input);
  std::vector<at::Tensor> forward(
      const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn,
      const std::vector<at::Tensor>& inputs);
  // Gathers the model weights (under kOptimGradsParams; a no-op where they persist) for use
  // outside forward(): tied weights, evaluation, export. Collective: every rank must call it.
  void unshard();
  // Frees the model weights again under kOptimGradsParams (a no-op under the other strategies).
  void reshard();
  // Bytes of unsharded model-weight and full-gradient storage this rank holds right now.
  int64_t unsharded_bytes() const;
  // The highest unsharded_bytes() since construction or the last reset (for benchmarks).
  int64_t peak_unsharded_bytes() const;
  void reset_peak_unsharded_bytes();

 private:
  friend FSDP_MUON_API void share_forward_order(
      const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Makes `groups` (the groups of one model) share one forward order: forward() of a group
// prefetches the group whose forward() first ran after it, backward the one before
// (docs/DESIGN.md §2, Prefetch). shard_module() does this for the groups it makes; groups built
// one by one prefetch nothing until they share an order.
FSDP_MUON_API void share_forward_order(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups);

// What a sharded parameter maps back to.
struct FSDP_MUON_API ShardedParameterInfo {
  std::shared_ptr<FsdpParameterGroup> group;
  size_t index = 0;
  const ParameterSlot& slot() const { return group->slot(index); }
};

// Sum of unsharded_bytes() over `groups`: what this rank holds unsharded right now.
FSDP_MUON_API int64_t
total_unsharded_bytes(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups);
// The highest sum of unsharded bytes over all groups of `groups`' communicator at any moment
// since the groups were built or the last reset: the peak a rank held (docs/DESIGN.md §2). All
// groups must share one communicator.
FSDP_MUON_API int64_t
peak_total_unsharded_bytes(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups);
FSDP_MUON_API void reset_peak_total_unsharded_bytes(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups);

// The group and index of a sharded parameter, or nullopt when `tensor` is not one (or its group
// is not owned by a std::shared_ptr).
FSDP_MUON_API std::optional<ShardedParameterInfo> find_sharded_parameter(const at::Tensor& tensor);

}  // namespace fsdp_muon
