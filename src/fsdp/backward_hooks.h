#pragma once
// The places autograd calls into a group under full sharding (docs/DESIGN.md §2, Sharding
// strategies): before the backward of what the group's forward() computed (to gather the
// weights again and make room for the full gradients), after each parameter's gradient has been
// accumulated (to keep it in the group's buffer), and once that backward has reached the
// forward()'s inputs (to reduce-scatter: FSDP2's post-backward hook, the same point of the
// backward on every rank whichever parameters got gradients).

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp_muon {
namespace fsdp {

class BackwardParticipant {
 public:
  virtual ~BackwardParticipant() = default;
  // The gradients of the outputs of one of the group's forward() calls are ready; the backward
  // of the function that computed them runs next.
  virtual void pre_backward() = 0;
  // AccumulateGrad has added this backward's gradient into parameter `index`'s .grad().
  virtual void gradient_accumulated(size_t index) = 0;
  // The gradients of the inputs of one of the group's forward() calls are computed: the
  // backward of that call has passed through the group.
  virtual void post_backward() = 0;
};

// Autograd nodes outlive nothing they should not: they refer to a participant by an id, looked
// up under a mutex, so a node that runs after its group is destroyed finds nothing and does
// nothing.
int64_t register_participant(BackwardParticipant* participant);
void unregister_participant(int64_t id);

// `outputs` with those that require grad passed through an identity autograd function whose
// backward calls pre_backward() of participant `id` before passing the gradients on.
std::vector<at::Tensor> before_backward(int64_t id, const std::vector<at::Tensor>& outputs);

// `inputs` with those that require grad passed through an identity autograd function whose
// backward calls post_backward() of participant `id` once all their gradients are computed.
// `*hooked` says whether any did (else `inputs` come back as they are and nothing is called).
std::vector<at::Tensor> after_backward(int64_t id, const std::vector<at::Tensor>& inputs,
                                       bool* hooked);

// Installs (replacing any) the post-accumulate-grad hook of leaf `param`: it calls
// gradient_accumulated(index) of participant `id`. clear_accumulate_hook removes it.
void set_accumulate_hook(const at::Tensor& param, int64_t id, size_t index);
void clear_accumulate_hook(const at::Tensor& param);

}  // namespace fsdp
}  // namespace fsdp_muon
