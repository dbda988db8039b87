#pragma once
// How the ranks agree that they built the same FsdpParameterGroup before its first collective
// (docs/DESIGN.md §2): each describes what it built as lines of text, the texts are compared by
// hash, and only when some rank differs are they gathered to name the first difference.

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/fsdp/parameter_group.h>

namespace fsdp_muon::fsdp {

// "ok", the options and the mesh shape (DeviceMesh::shape()), then one line per parameter (name,
// shape, dtype); devices are left out.
std::vector<std::string> describe_group(
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const FsdpParameterGroupOptions& options, const std::string& mesh_shape);

// The first line where rank r's description differs from rank 0's, as a sentence.
std::string first_difference(const std::vector<std::string>& zero,
                             const std::vector<std::string>& other, int r);

// Every rank calls this with its description (describe_group's, or {"error", its own
// validation message}) before the group's first collective. When some rank differs from rank
// 0, every rank throws, naming the ranks that differ and the first difference; when all agree
// on an error (or the world is one rank), that error is thrown. `who` starts the messages.
void agree_on_group(Communicator& comm, const std::vector<std::string>& description,
                    const std::string& who);

}  // namespace fsdp_muon::fsdp
