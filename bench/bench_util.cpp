#include "bench_util.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <exception>
#include <numeric>
#include <sstream>

#include <c10/util/Exception.h>

namespace fsdp_muon_bench {

Flags::Flags(int argc, char** argv, const std::string& usage) : usage_(usage) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    TORCH_CHECK(arg.rfind("--", 0) == 0, "unexpected argument '", arg, "'\n", usage_);
    arg = arg.substr(2);
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      values_[arg.substr(0, eq)] = arg.substr(eq + 1);
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      values_[arg] = argv[++i];
    } else {
      values_[arg] = "";
    }
  }
}

bool Flags::has(const std::string& key) {
  auto it = values_.find(key);
  if (it == values_.end()) return false;
  TORCH_CHECK(it->second.empty(), "--", key, " takes no value (got '", it->second, "')");
  values_.erase(it);
  return true;
}

std::string Flags::get(const std::string& key, const std::string& fallback) {
  auto it = values_.find(key);
  if (it == values_.end()) return fallback;
  TORCH_CHECK(!it->second.empty(), "--", key, " needs a value\n", usage_);
  std::string value = it->second;
  values_.erase(it);
  return value;
}

int64_t Flags::get_int(const std::string& key, int64_t fallback) {
  const std::string v = get(key, "");
  if (v.empty()) return fallback;
  size_t used = 0;
  int64_t out = 0;
  try {
    out = std::stoll(v, &used);
  } catch (...) {
    used = 0;
  }
  TORCH_CHECK(used == v.size(), "--", key, " got '", v, "', which is not an integer");
  return out;
}

double Flags::get_double(const std::string& key, double fallback) {
  const std::string v = get(key, "");
  if (v.empty()) return fallback;
  size_t used = 0;
  double out = 0;
  try {
    out = std::stod(v, &used);
  } catch (...) {
    used = 0;
  }
  TORCH_CHECK(used == v.size(), "--", key, " got '", v, "', which is not a number");
  return out;
}

std::vector<int64_t> Flags::get_ints(const std::string& key, const std::vector<int64_t>& fallback) {
  const std::string v = get(key, "");
  if (v.empty()) return fallback;
  std::vector<int64_t> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int64_t x = 0;
    try {
      x = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    TORCH_CHECK(used == item.size() && !item.empty(), "--", key, " got '", v,
                "'; give comma-separated integers");
    out.push_back(x);
  }
  return out;
}

void Flags::finish() const {
  TORCH_CHECK(values_.empty(), "unknown option --", values_.empty() ? "" : values_.begin()->first,
              "\n", usage_);
}

std::string bytes_ratio_name(double max_bytes_ratio) {
  return max_bytes_ratio == fsdp_muon::kBytesRatioByCost ? std::string("by cost")
                                                         : format("%.2f", max_bytes_ratio);
}

std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return buf;
}

std::vector<fsdp_muon::PlanGroup> plan_groups(const ModelShapes& model, int world_size,
                                              int64_t ns_steps, c10::ScalarType compute_dtype) {
  std::vector<fsdp_muon::PlanGroup> groups;
  groups.reserve(model.groups.size());
  for (const auto& [name, shapes] : model.groups) {
    groups.push_back(fsdp_muon::plan_group_from_shapes(
        name, shapes, world_size, fsdp_muon::NewtonSchulzOptions().steps(ns_steps), compute_dtype,
        16));
  }
  return groups;
}

fsdp_muon::OwnerPlan round_robin_plan(const std::vector<fsdp_muon::PlanGroup>& groups,
                                      int world_size, int64_t element_bytes) {
  fsdp_muon::OwnerPlan plan;
  plan.world_size = world_size;
  plan.element_bytes = element_bytes;
  const size_t n = groups.size();
  plan.owner.resize(n);
  plan.cost.resize(n);
  plan.group_cost_per_rank.assign(n, std::vector<int64_t>(world_size, 0));
  plan.cost_per_rank.assign(world_size, 0);
  plan.group_full_bytes_per_rank.assign(n, std::vector<int64_t>(world_size, 0));
  plan.gather_bytes_per_rank.assign(world_size, 0);
  plan.scatter_bytes_per_rank.assign(world_size, 0);
  plan.inter_node_bytes_per_rank.assign(world_size, 0);
  plan.mesh = fsdp_muon::MeshShape{1, world_size};
  int64_t next = 0;
  for (size_t g = 0; g < n; ++g) {
    const auto& matrices = groups[g].matrices;
    plan.owner[g].assign(matrices.size(), -1);
    plan.cost[g].assign(matrices.size(), 0);
    for (size_t i = 0; i < matrices.size(); ++i) {
      const auto& m = matrices[i];
      if (m.rows * m.cols == 0) continue;
      const int o = static_cast<int>(next++ % world_size);
      const int64_t cost = fsdp_muon::plan_matrix_flops(m);
      plan.owner[g][i] = o;
      plan.cost[g][i] = cost;
      plan.cost_per_rank[o] += cost;
      plan.group_cost_per_rank[g][o] += cost;
      plan.group_full_bytes_per_rank[g][o] += m.rows * m.cols * element_bytes;
      for (int r = 0; r < world_size; ++r) {
        if (r == o) continue;
        const int64_t bytes = (m.held[r].second - m.held[r].first) * element_bytes;
        plan.gather_bytes_per_rank[r] += bytes;
        plan.scatter_bytes_per_rank[o] += bytes;
      }
    }
    const auto& per_rank = plan.group_cost_per_rank[g];
    const int64_t total = std::accumulate(per_rank.begin(), per_rank.end(), int64_t{0});
    const int64_t largest = *std::max_element(per_rank.begin(), per_rank.end());
    plan.group_balance.push_back(total > 0 ? largest * double(world_size) / total : 1.0);
  }
  return plan;
}

int run_main(int argc, char** argv, const char* program, const char* usage,
             const std::function<int(Flags&)>& run) {
  try {
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
        std::printf("%s", usage);
        return 0;
      }
    }
    Flags flags(argc, argv, usage);
    return run(flags);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 2;
  }
}

}  // namespace fsdp_muon_bench
