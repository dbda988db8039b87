#pragma once
// Factory for the CPU communicator, for programs that bring their own c10d Store (init_from_env()
// is the usual way in). Kept apart from communicator.h so that code which only moves tensors
// does not pull in c10d.

#include <chrono>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/config.h>

namespace fsdp_muon {

// c10d Gloo over `store`, for CPU tensors; every call has completed when it returns.
// `hostname` is the address this rank's Gloo device binds to (empty: this machine's hostname,
// or loopback when it does not resolve; GLOO_SOCKET_IFNAME, when set, names an interface
// instead). `timeout` bounds the connection set-up and every collective.
FSDP_MUON_API std::shared_ptr<Communicator> make_gloo_communicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size,
    std::chrono::milliseconds timeout = std::chrono::minutes(5), const std::string& hostname = "");

}  // namespace fsdp_muon
