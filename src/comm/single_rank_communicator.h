#pragma once
// The communicator of a group of one rank (docs/DESIGN.md §5, Meshes): what split() gives a
// color only one rank passed, and the replicate communicator of a 1-D mesh. Internal header.

#include <memory>
#include <string>

#include <c10/core/Device.h>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon::detail {

// Rank 0 of 1 on `device`: every collective is a local copy (or nothing) on the caller's current
// stream, counts no bytes sent (there is no peer), and cannot fail or wait for anyone.
// `backend_name` is the parent's: what runs is as exact as the parent's transport would be.
std::shared_ptr<Communicator> make_single_rank_communicator(c10::Device device,
                                                            const std::string& backend_name);

}  // namespace fsdp_muon::detail
