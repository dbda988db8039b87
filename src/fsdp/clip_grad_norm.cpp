#include <fsdp_muon/fsdp/clip_grad_norm.h>
#include <fsdp_muon/fsdp/parameter_group.h>

#include <cmath>
#include <limits>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "common/check.h"
#include "common/enum_names.h"

namespace fsdp_muon {
namespace {

constexpr detail::EnumName<NonFiniteGradients> kNonFiniteNames[] = {
    {NonFiniteGradients::kIgnore, "ignore"},
    {NonFiniteGradients::kSkipStep, "skip_step"},
    {NonFiniteGradients::kThrow, "throw"},
};
static_assert(detail::rows_in_enumerator_order(kNonFiniteNames));

}  // namespace

const char* to_string(NonFiniteGradients mode) { return detail::name_of(kNonFiniteNames, mode); }

double clip_grad_norm(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                      double max_norm, double norm_type, NonFiniteGradients non_finite) {
  FSDP_MUON_API_SCOPE("clip_grad_norm");
  FSDP_MUON_CHECK(!groups.empty() && groups[0] != nullptr,
                  groups.empty() ? "no groups given" : "group 0 is null");
  const bool inf_norm = std::isinf(norm_type) && norm_type > 0;
  // Every replica must clip by the same factor or the replicas drift apart: the arguments are
  // checked and agreed over the world (docs/DESIGN.md, "Agreement") before the norm's all-reduce.
  detail::agree_on_arguments(
      *groups[0]->mesh().world, "its arguments",
      "Every rank must call clip_grad_norm with the same groups, in the same order, the same "
      "max_norm, norm_type and non_finite",
      [&] {
        FSDP_MUON_CHECK(std::isfinite(max_norm) && max_norm > 0,
                        "max_norm must be a positive number, got ", max_norm);
        FSDP_MUON_CHECK(inf_norm || (std::isfinite(norm_type) && norm_type > 0),
                        "norm_type must be positive (2.0 for the Euclidean norm, "
                        "std::numeric_limits<double>::infinity() for the largest element), got ",
                        norm_type);
        std::unordered_set<const FsdpParameterGroup*> seen;
        std::string names;
        for (size_t i = 0; i < groups.size(); ++i) {
          FSDP_MUON_CHECK(groups[i] != nullptr, "group ", i, " is null");
          FSDP_MUON_CHECK(seen.insert(groups[i].get()).second, "group '", groups[i]->name(),
                          "' is given twice; its gradient would count twice in the norm");
          FSDP_MUON_CHECK(groups[i]->communicator() == groups[0]->communicator() &&
                              groups[i]->mesh().same_as(groups[0]->mesh()),
                          "group '", groups[i]->name(), "' is on another communicator than group '",
                          groups[0]->name(), "' (mesh ", groups[i]->mesh().shape(), " against ",
                          groups[0]->mesh().shape(),
                          "); clip the groups of each communicator or mesh in a call of their own");
          names += (i ? ", '" : "'") + groups[i]->name() + "' (" +
                   std::to_string(groups[i]->padded_numel()) + " elements)";
        }
        return std::vector<std::string>{"max_norm = " + detail::exact_text(max_norm),
                                        "norm_type = " + detail::exact_text(norm_type),
                                        std::string("non_finite = ") + to_string(non_finite),
                                        "groups = [" + names + "]"};
      });
  // The shard group, not the world: on a mesh every replica holds the same gradient shards
  // (docs/DESIGN.md §2, Meshes), so summing over the world would count each element once per
  // replica. Each replica computes the same norm and the same factor from the same bits.
  Communicator& comm = *groups[0]->communicator();

  // This rank's part of the norm, in double whatever the gradients' dtype: on CUDA one
  // multi-tensor kernel reads each gradient once and accumulates in double (no double copy where
  // the gradients share a dtype; elsewhere ATen converts one gradient at a time).
  std::vector<at::Tensor> grads;
  for (const auto& group : groups) {
    for (const at::Tensor& p : group->sharded_parameters()) {
      const at::Tensor& g = p.grad();
      if (g.defined() && g.numel() > 0) grads.push_back(g);
    }
  }
  at::Tensor local = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(comm.device()));
  if (!grads.empty()) {
    const at::Tensor norms = at::stack(at::_foreach_norm(
        grads, inf_norm ? std::numeric_limits<double>::infinity() : norm_type, at::kDouble));
    local =
        (inf_norm ? norms.max() : (norm_type == 2.0 ? norms.square() : norms.pow(norm_type)).sum())
            .reshape({1});
  }
  // A maximum over ranks may drop a NaN (a comparison with NaN is false, so which value wins
  // depends on the order it meets the others in): for the largest element a second entry, 1
  // where this rank's maximum is NaN (ATen's norms and max keep NaN), travels in the same
  // all-reduce. A sum keeps NaN as is.
  if (inf_norm) local = at::cat({local, local.isnan().to(at::kDouble)});
  comm.all_reduce(local, inf_norm ? ReduceOp::kMax : ReduceOp::kSum);
  const at::Tensor reduced = comm.to_host(local);
  const double first = reduced[0].item<double>();
  const double total =
      inf_norm ? (reduced[1].item<double>() > 0 ? std::numeric_limits<double>::quiet_NaN() : first)
               : (norm_type == 2.0 ? std::sqrt(first) : std::pow(first, 1.0 / norm_type));

  if (!std::isfinite(total)) {
    FSDP_MUON_CHECK(
        non_finite != NonFiniteGradients::kThrow, "the gradients' total norm is ", total,
        " (a NaN or Inf gradient on some rank); nothing was clipped. Find the parameter "
        "with FsdpMuon's non_finite_gradients(kThrow), or pass kSkipStep to skip the step");
    if (non_finite == NonFiniteGradients::kSkipStep) return total;
  }
  // torch's rule: scale by max_norm / (norm + 1e-6), never up.
  const double coefficient = std::min(max_norm / (total + 1e-6), 1.0);
  if (!(coefficient < 1.0) && !std::isnan(coefficient)) return total;
  if (!grads.empty()) at::_foreach_mul_(grads, coefficient);
  return total;
}

}  // namespace fsdp_muon
