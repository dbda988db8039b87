#pragma once
// The store the ranks of a communicator meet in (docs/DESIGN.md §5, Launch). Internal header.

#include <chrono>
#include <string>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fsdp_muon/comm/communicator.h>

namespace fsdp_muon::detail {

// The base store of this rendezvous: a TCPStore at MASTER_ADDR:MASTER_PORT (served by rank 0, or
// by torchrun's agent), without an address a FileStore every rank of this node can see, and for
// a world of one a HashStore. One per process and rendezvous (a TCPStore server must outlive
// every client, and a FileStore deletes its file once world-size instances are gone), made on
// first use; every blocking step is bounded by `timeout`.
c10::intrusive_ptr<c10d::Store> base_store(const LaunchEnvironment& e,
                                           std::chrono::milliseconds timeout);

// Where that store is, for messages: "at MASTER_ADDR=.. MASTER_PORT=..", "in <file>" or "in this
// process".
std::string store_place(const LaunchEnvironment& e);

}  // namespace fsdp_muon::detail
