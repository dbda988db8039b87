#pragma once
// Sharded parameter -> its group and index, for find_sharded_parameter() (docs/DESIGN.md §2):
// one process-wide map, written by the groups as they are built and destroyed.

#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdp_muon/fsdp/parameter_group.h>

namespace fsdp_muon::fsdp {

// Maps sharded[i] to (group, i). Call at the end of the group's construction.
void register_sharded_parameters(FsdpParameterGroup* group, const std::vector<at::Tensor>& sharded);
// Forgets the entries `group` made; call first thing in the group's destructor.
void unregister_sharded_parameters(const FsdpParameterGroup* group,
                                   const std::vector<at::Tensor>& sharded);

}  // namespace fsdp_muon::fsdp
