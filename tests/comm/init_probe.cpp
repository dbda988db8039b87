// A tiny program for launch tests: init_from_env(), one all-reduce, a line saying who it was.
// Any error is printed (without the C++ backtrace) and the exit code is non-zero.
//   init_probe [--timeout=<seconds>] [--backend=auto|nccl|gloo] [--absent-rank=<r>]
// --absent-rank: rank r skips the all-reduce (it waits out the others' timeout, then exits 0),
// so the others must fail with a timeout instead of hanging.

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <fsdp_muon/comm/communicator.h>

#include "comm/launch_environment.h"

int main(int argc, char** argv) {
  at::set_num_threads(1);
  fsdp_muon::InitOptions options;
  int absent_rank = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--timeout=", 0) == 0) {
      options.timeout_seconds = std::stod(arg.substr(10));
    } else if (arg.rfind("--absent-rank=", 0) == 0) {
      absent_rank = std::stoi(arg.substr(14));
    } else if (arg.rfind("--backend=", 0) == 0) {
      options.backend = arg.substr(10);
    } else {
      std::fprintf(stderr, "init_probe: unknown argument %s\n", argv[i]);
      return 64;
    }
  }
  try {
    const auto env = fsdp_muon::detail::read_launch_environment();
    auto comm = fsdp_muon::init_from_env(options);
    if (comm->rank() == absent_rank) {
      std::this_thread::sleep_for(std::chrono::duration<double>(options.timeout_seconds + 3));
      std::printf("init_probe: rank %d stayed away\n", comm->rank());
      return 0;
    }
    at::Tensor t = at::ones({3}, at::TensorOptions().device(comm->device()));
    comm->all_reduce(t);
    const bool ok = at::equal(t.cpu(), at::full({3}, comm->size(), at::kFloat));
    std::printf("init_probe: rank %d of %d via %s, backend %s, all_reduce %s\n", comm->rank(),
                comm->size(), env.launcher.c_str(), comm->backend_name().c_str(),
                ok ? "ok" : "WRONG");
    comm->barrier();
    return ok ? 0 : 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "init_probe error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "init_probe error: %s\n", e.what());
  }
  return 2;
}
