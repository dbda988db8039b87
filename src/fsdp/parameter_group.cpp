// FsdpParameterGroup, the facade (docs/DESIGN.md §2): its constructor runs the construction
// steps of fsdp/group_storage.h, agrees across ranks (fsdp/group_agreement.h) and starts the
// full-sharding state machine (fsdp/sharding_state_machine.h); its calls dispatch to the
// storage (kOptim) or to the state machine (kOptimGrads, kOptimGradsParams).

#include <fsdp_muon/fsdp/parameter_group.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "common/check.h"
#include "fsdp/group_agreement.h"
#include "fsdp/group_storage.h"
#include "fsdp/sharded_parameter_registry.h"
#include "fsdp/sharding_schedule.h"
#include "fsdp/sharding_state_machine.h"
#include "fsdp/storage_bytes.h"

namespace fsdp_muon {

struct FSDP_MUON_LOCAL FsdpParameterGroup::Impl {
  fsdp::GroupStorage storage;
  // Declared after the storage it works on, so it is destroyed first: its collectives in flight
  // finish while their buffers still exist.
  fsdp::ShardingStateMachine machine{storage};
};

namespace {

// The 1-D mesh of a communicator, after the null check the communicator constructor always made.
DeviceMesh mesh_of(std::shared_ptr<Communicator> comm, const FsdpParameterGroupOptions& options) {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");  // runs before the constructor's body opens it
  FSDP_MUON_CHECK(comm != nullptr, fsdp::group_label(options.name()), "the communicator is null");
  return one_dimensional_mesh(std::move(comm));
}

// What a rank can check about its mesh alone; a mesh assembled by hand rather than by
// make_device_mesh() may be inconsistent on some ranks only, so this runs inside the agreement.
void check_mesh(const DeviceMesh& mesh, const std::string& who) {
  const int replicas = mesh.replicas();
  const int shard_size = mesh.shard_size();
  FSDP_MUON_CHECK(mesh.world->size() == replicas * shard_size &&
                      mesh.world->rank() == mesh.world_rank(mesh.replica(), mesh.shard->rank()),
                  who, "the mesh is inconsistent: world rank ", mesh.world->rank(), " of ",
                  mesh.world->size(), ", shard rank ", mesh.shard->rank(), " of ", shard_size,
                  ", replica ", mesh.replica(), " of ", replicas,
                  " (a mesh needs world size = replicas x shard size and world rank = replica x "
                  "shard size + shard rank); build it with make_device_mesh()");
  FSDP_MUON_CHECK(mesh.shard->device() == mesh.world->device() &&
                      mesh.replicate->device() == mesh.world->device(),
                  who, "the mesh's communicators move tensors on different devices (world ",
                  mesh.world->device(), ", shard ", mesh.shard->device(), ", replicate ",
                  mesh.replicate->device(), "); build the mesh with make_device_mesh()");
}

}  // namespace

FsdpParameterGroup::FsdpParameterGroup(std::vector<std::pair<std::string, at::Tensor>> named_params,
                                       std::shared_ptr<Communicator> comm,
                                       FsdpParameterGroupOptions options)
    // `options` is copied, not moved: mesh_of() reads it, in an unspecified order.
    : FsdpParameterGroup(std::move(named_params), mesh_of(std::move(comm), options), options) {}

FsdpParameterGroup::FsdpParameterGroup(std::vector<std::pair<std::string, at::Tensor>> named_params,
                                       const DeviceMesh& mesh, FsdpParameterGroupOptions options)
    : impl_(std::make_unique<Impl>()) {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  fsdp::GroupStorage& s = impl_->storage;
  s.options = std::move(options);
  const std::string who = s.label();
  FSDP_MUON_CHECK(mesh.world != nullptr && mesh.shard != nullptr && mesh.replicate != nullptr, who,
                  "the mesh has a null communicator (world, shard or replicate); build it with "
                  "make_device_mesh(world, shard_size) or one_dimensional_mesh(comm)");
  s.mesh = mesh;
  s.comm = mesh.shard;

  // Validate, then agree across the whole world (every rank of every replica builds the same
  // group on the same mesh shape) before the first collective. A local error is not thrown here
  // but described, so that every rank learns of it through the same exchange and throws too: a
  // rank that threw alone would leave the others hanging in the broadcast below
  // (docs/DESIGN.md §5, Agreement).
  fsdp::ValidatedParameters validated;
  std::vector<std::string> description;
  try {
    check_mesh(s.mesh, who);
    validated = fsdp::validate_parameters(s, named_params);
    description = fsdp::describe_group(named_params, s.options, s.mesh.shape());
  } catch (...) {
    description = {"error", detail::current_exception_message()};
  }
  fsdp::agree_on_group(*s.mesh.world, description, who);

  s.layout = fsdp::compute_flat_layout(validated.named_shapes, validated.alignment, s.comm->size());
  fsdp::allocate_buffers(s, named_params, validated.param_dtype);
  fsdp::attach_parameters(s, std::move(named_params));
  {
    at::NoGradGuard no_grad;
    // The strategy's frees (docs/DESIGN.md §2, Sharding strategies).
    impl_->machine.start(s.options.sharding_strategy());
  }
  fsdp::register_sharded_parameters(this, s.sharded);
}

FsdpParameterGroup::~FsdpParameterGroup() {
  // First, so that find_sharded_parameter() never finds a group being destroyed; the state
  // machine's destructor then unhooks the group from autograd and the schedule.
  fsdp::unregister_sharded_parameters(this, impl_->storage.sharded);
}

const std::string& FsdpParameterGroup::name() const { return impl_->storage.options.name(); }
size_t FsdpParameterGroup::num_parameters() const { return impl_->storage.params.size(); }

const ParameterSlot& FsdpParameterGroup::slot(size_t index) const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  impl_->storage.check_index(index);
  return impl_->storage.layout.slots[index];
}

int64_t FsdpParameterGroup::padded_numel() const { return impl_->storage.layout.padded_numel; }
int64_t FsdpParameterGroup::shard_numel() const { return impl_->storage.layout.shard_numel; }

std::pair<int64_t, int64_t> FsdpParameterGroup::held_range(size_t index, int rank) const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  impl_->storage.check_index(index);
  return impl_->storage.layout.held_range(index, rank);
}

std::pair<int64_t, int64_t> FsdpParameterGroup::held_range(size_t index) const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  return held_range(index, impl_->storage.comm->rank());
}

int64_t FsdpParameterGroup::shard_offset(size_t index, int rank) const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  impl_->storage.check_index(index);
  return impl_->storage.layout.shard_offset(index, rank);
}

std::optional<size_t> FsdpParameterGroup::index_of(const std::string& name) const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  const std::vector<ParameterSlot>& slots = impl_->storage.layout.slots;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].name == name) return i;
  }
  return std::nullopt;
}

c10::ScalarType FsdpParameterGroup::compute_dtype() const { return impl_->storage.compute_dtype; }
c10::ScalarType FsdpParameterGroup::main_dtype() const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  return impl_->storage.options.main_dtype();
}

const std::shared_ptr<Communicator>& FsdpParameterGroup::communicator() const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  return impl_->storage.comm;
}

const DeviceMesh& FsdpParameterGroup::mesh() const { return impl_->storage.mesh; }

const FsdpParameterGroupOptions& FsdpParameterGroup::options() const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  return impl_->storage.options;
}

std::vector<at::Tensor> FsdpParameterGroup::sharded_parameters() const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  return impl_->storage.sharded;
}

const at::Tensor& FsdpParameterGroup::sharded_parameter(size_t index) const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  impl_->storage.check_index(index);
  return impl_->storage.sharded[index];
}

const at::Tensor& FsdpParameterGroup::model_weights() const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  const fsdp::GroupStorage& s = impl_->storage;
  const fsdp::ShardingStateMachine& m = impl_->machine;
  // The buffer of a resharded group has no bytes; a kernel reading it would read a null
  // pointer, so the accessor refuses instead (docs/DESIGN.md §2).
  FSDP_MUON_CHECK(m.weights() == fsdp::ShardingStateMachine::Weights::kLive, s.label(),
                  "model_weights(): the model weights are resharded (sharding strategy ",
                  to_string(m.strategy()), "); call unshard() first, and reshard() when done");
  return s.model_weights;
}

const at::Tensor& FsdpParameterGroup::full_grad_buffer() const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  const fsdp::GroupStorage& s = impl_->storage;
  const fsdp::ShardingStateMachine& m = impl_->machine;
  FSDP_MUON_CHECK(!m.shards_grads() || fsdp::storage_bytes(s.full_grad) > 0, s.label(),
                  "full_grad_buffer(): under sharding strategy ", to_string(m.strategy()),
                  " the full gradients exist only during the group's backward and are "
                  "reduce-scattered into grad_shard() as soon as they are complete; read "
                  "grad_shard() instead");
  return s.full_grad;
}
const at::Tensor& FsdpParameterGroup::main_weight_shard() const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  return impl_->storage.main_shard;
}
const at::Tensor& FsdpParameterGroup::grad_shard() const { return impl_->storage.grad_shard; }
std::vector<at::Tensor> FsdpParameterGroup::model_parameters() const {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  return impl_->storage.params;
}

// Each of the three calls of a training step: kOptim's in the storage, full sharding's in the
// state machine.
void FsdpParameterGroup::zero_grad() {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  at::NoGradGuard no_grad;
  if (impl_->machine.shards_grads()) {
    impl_->machine.zero_grad();
  } else {
    impl_->storage.zero_grad();
    impl_->machine.mark_reduced();  // nothing unreduced is left to forget
  }
}

void FsdpParameterGroup::reduce_scatter_grads() {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  at::NoGradGuard no_grad;
  if (impl_->machine.shards_grads()) {
    impl_->machine.collect_grads();
  } else {
    // ZeRO-1: the one collective here that the user starts by hand, so the one a rank can miss;
    // the others then wait out the timeout in it. The error says so (docs/DESIGN.md §2).
    try {
      impl_->storage.reduce_scatter_grads();
    } catch (...) {
      TORCH_CHECK(false, detail::current_exception_message(), " (in ", impl_->storage.label(),
                  "reduce_scatter_grads(), sharding strategy optim: every rank must call it for "
                  "every group, in the same order, after each backward; a rank that skipped it "
                  "is waiting in another collective, e.g. FsdpMuon::step()'s agreement)");
    }
    impl_->machine.mark_reduced();
  }
}

bool FsdpParameterGroup::has_unreduced_gradients() const { return impl_->machine.unreduced(); }

void FsdpParameterGroup::refresh_model_weights() {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  at::NoGradGuard no_grad;
  impl_->machine.check_parameters_alias();
  if (impl_->machine.shards_weights()) {
    impl_->machine.refresh();
  } else {
    impl_->storage.refresh_model_weights();
  }
}

ShardingStrategy FsdpParameterGroup::sharding_strategy() const { return impl_->machine.strategy(); }

at::Tensor FsdpParameterGroup::forward(const std::function<at::Tensor(const at::Tensor&)>& fn,
                                       const at::Tensor& input) {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  FSDP_MUON_CHECK(fn, impl_->storage.label(), "forward(): the function is empty");
  const std::vector<at::Tensor> outputs =
      forward([&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
              std::vector<at::Tensor>{input});
  return outputs[0];
}

std::vector<at::Tensor> FsdpParameterGroup::forward(
    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn,
    const std::vector<at::Tensor>& inputs) {
  FSDP_MUON_API_SCOPE("FsdpParameterGroup");
  fsdp::ShardingStateMachine& m = impl_->machine;
  FSDP_MUON_CHECK(fn, impl_->storage.label(), "forward(): the function is empty");
  const std::vector<at::Tensor> hooked_inputs = m.before_forward(inputs);
  std::vector<at::Tensor> outputs;
  try {
    outputs = fn(hooked_inputs);
  } catch (...) {
    m.forward_threw();
    throw;
  }
  return m.after_forward(std::move(outputs));
}

void FsdpParameterGroup::unshard() { impl_->machine.unshard(); }
void FsdpParameterGroup::reshard() { impl_->machine.reshard(); }

int64_t FsdpParameterGroup::unsharded_bytes() const { return impl_->machine.held_bytes(); }
int64_t FsdpParameterGroup::peak_unsharded_bytes() const { return impl_->machine.peak_bytes(); }
void FsdpParameterGroup::reset_peak_unsharded_bytes() { impl_->machine.reset_peak_bytes(); }

void share_forward_order(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  FSDP_MUON_API_SCOPE("share_forward_order");
  auto order = std::make_shared<fsdp::ForwardOrder>();
  for (const auto& g : groups) {
    FSDP_MUON_CHECK(g != nullptr, "a group is null");
    g->impl_->machine.set_forward_order(order);
  }
}

int64_t total_unsharded_bytes(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  int64_t total = 0;
  for (const auto& g : groups) {
    if (g) total += g->unsharded_bytes();
  }
  return total;
}

namespace {
fsdp::ShardingSchedule& shared_schedule(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  FSDP_MUON_CHECK(!groups.empty() && groups.front(),
                  "no groups given; pass the groups shard_module() returned");
  const Communicator* comm = groups.front()->communicator().get();
  for (const auto& g : groups) {
    FSDP_MUON_CHECK(g && g->communicator().get() == comm,
                    "the groups do not share one communicator; the peak is kept per communicator, "
                    "so pass the groups of one communicator");
  }
  return *fsdp::ShardingSchedule::of(*comm);
}
}  // namespace

int64_t peak_total_unsharded_bytes(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  FSDP_MUON_API_SCOPE("peak_total_unsharded_bytes");
  return shared_schedule(groups).peak_unsharded_bytes();
}

void reset_peak_total_unsharded_bytes(
    const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups) {
  FSDP_MUON_API_SCOPE("reset_peak_total_unsharded_bytes");
  shared_schedule(groups).reset_peak_unsharded_bytes();
}

}  // namespace fsdp_muon
