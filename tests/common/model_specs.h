#pragma once
// Models described by their parameters' names and shapes, the fixture the optimizer and
// checkpoint tests build their sharded groups and single-device references from.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp_muon::testing {

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
};

// One group's parameters: N(0, 0.25) values from the current seed, in order, requiring grad.
inline std::vector<std::pair<std::string, at::Tensor>> random_parameters(
    const std::vector<Spec>& specs) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const Spec& spec : specs) {
    named.emplace_back(spec.name, at::randn(spec.shape).mul_(0.5).requires_grad_(true));
  }
  return named;
}

}  // namespace fsdp_muon::testing
