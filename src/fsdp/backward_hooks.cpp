#include "fsdp/backward_hooks.h"

#include <mutex>
#include <unordered_map>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "common/check.h"

namespace fsdp_muon {
namespace fsdp {
namespace {

std::mutex& participants_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<int64_t, BackwardParticipant*>& participants() {
  static std::unordered_map<int64_t, BackwardParticipant*> map;
  return map;
}

BackwardParticipant* find_participant(int64_t id) {
  std::lock_guard<std::mutex> lock(participants_mutex());
  auto it = participants().find(id);
  return it == participants().end() ? nullptr : it->second;
}

// An identity on the tensors given whose backward calls `Hook` on the group. Autograd runs it
// before the backward of what consumes the outputs (PreBackward: on a forward()'s outputs, the
// C++ counterpart of FSDP2's pre-backward hook, which LibTorch modules lack) or once the
// gradients of all the inputs are computed (PostBackward: on a forward()'s inputs, so the
// group learns that this call's backward is done).
template <void (BackwardParticipant::*Hook)()>
struct NotifyInBackward : public torch::autograd::Function<NotifyInBackward<Hook>> {
  // A TensorList, which Function::apply counts as differentiable inputs (a std::vector it
  // would not).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, int64_t id) {
    ctx->saved_data["participant"] = id;
    // An output without a gradient stays undefined instead of becoming a tensor of zeros.
    ctx->set_materialize_grads(false);
    return inputs.vec();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // Autograd calls in, not the user: name the group's API in its errors.
    FSDP_MUON_API_SCOPE("FsdpParameterGroup");
    if (BackwardParticipant* p = find_participant(ctx->saved_data["participant"].toInt())) {
      (p->*Hook)();
    }
    grads.emplace_back();  // for `id`, which has no gradient
    return grads;
  }
};
using PreBackward = NotifyInBackward<&BackwardParticipant::pre_backward>;
using PostBackward = NotifyInBackward<&BackwardParticipant::post_backward>;

// `tensors` with the differentiable ones replaced, in order, by `wrapped`.
std::vector<at::Tensor> replace_differentiable(const std::vector<at::Tensor>& tensors,
                                               const std::vector<at::Tensor>& wrapped) {
  std::vector<at::Tensor> result;
  result.reserve(tensors.size());
  size_t k = 0;
  for (const at::Tensor& t : tensors) {
    result.push_back(t.defined() && t.requires_grad() ? wrapped[k++] : t);
  }
  return result;
}

std::vector<at::Tensor> differentiable_of(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> differentiable;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.requires_grad()) differentiable.push_back(t);
  }
  return differentiable;
}

struct AccumulatedHook : public torch::autograd::PostAccumulateGradHook {
  AccumulatedHook(int64_t id, size_t index) : id(id), index(index) {}
  void operator()(const torch::autograd::Variable& /*param*/) override {
    FSDP_MUON_API_SCOPE("FsdpParameterGroup");
    if (BackwardParticipant* p = find_participant(id)) p->gradient_accumulated(index);
  }
  int64_t id;
  size_t index;
};

}  // namespace

int64_t register_participant(BackwardParticipant* participant) {
  static int64_t next_id = 0;
  std::lock_guard<std::mutex> lock(participants_mutex());
  const int64_t id = next_id++;
  participants()[id] = participant;
  return id;
}

void unregister_participant(int64_t id) {
  std::lock_guard<std::mutex> lock(participants_mutex());
  participants().erase(id);
}

std::vector<at::Tensor> before_backward(int64_t id, const std::vector<at::Tensor>& outputs) {
  const std::vector<at::Tensor> differentiable = differentiable_of(outputs);
  if (differentiable.empty()) return outputs;
  return replace_differentiable(outputs, PreBackward::apply(at::TensorList(differentiable), id));
}

std::vector<at::Tensor> after_backward(int64_t id, const std::vector<at::Tensor>& inputs,
                                       bool* hooked) {
  const std::vector<at::Tensor> differentiable = differentiable_of(inputs);
  *hooked = !differentiable.empty();
  if (differentiable.empty()) return inputs;
  return replace_differentiable(inputs, PostBackward::apply(at::TensorList(differentiable), id));
}

void set_accumulate_hook(const at::Tensor& param, int64_t id, size_t index) {
  torch::autograd::impl::set_post_acc_grad_hooks(param,
                                                 std::make_unique<AccumulatedHook>(id, index));
}

void clear_accumulate_hook(const at::Tensor& param) {
  torch::autograd::impl::set_post_acc_grad_hooks(param, nullptr);
}

}  // namespace fsdp
}  // namespace fsdp_muon
