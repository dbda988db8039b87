#include "bench_util.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <exception>
#include <numeric>
#include <sstream>

#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>

namespace fsdp_muon_bench {

struct Flags::Parser {
  CLI::App app;
  int argc;
  char** argv;
  bool parsed = false;

  // --key, added once (a mode may read an option another read already).
  CLI::Option* option(const std::string& key, bool flag) {
    if (CLI::Option* known = app.get_option_no_throw("--" + key)) return known;
    return flag ? app.add_flag("--" + key) : app.add_option("--" + key)->expected(1);
  }
  void parse(const std::string& usage) {
    app.allow_extras();
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      TORCH_CHECK(false, e.what(), "\n", usage);
    }
    parsed = true;
  }
};

Flags::Flags(int argc, char** argv, const std::string& usage)
    : parser_(new Parser{CLI::App(usage), argc, argv}), usage_(usage) {
  parser_->app.set_help_flag();  // run_main prints the usage for --help
}

Flags::~Flags() = default;

bool Flags::has(const std::string& key) {
  CLI::Option* flag = parser_->option(key, /*flag=*/true);
  parser_->parse(usage_);
  return flag->count() > 0;
}

namespace {

// The option's value as T, or a message naming the option and what it expects.
template <typename T>
T value_as(CLI::Option* option, const std::string& key, const char* expected) {
  try {
    return option->as<T>();
  } catch (const CLI::Error&) {
    TORCH_CHECK(false, "--", key, " got '", option->as<std::string>(), "'; ", expected);
  }
}

}  // namespace

CLI::Option* Flags::given(const std::string& key) {
  CLI::Option* option = parser_->option(key, /*flag=*/false);
  parser_->parse(usage_);
  return option->count() > 0 ? option : nullptr;
}

std::string Flags::get(const std::string& key, const std::string& fallback) {
  CLI::Option* option = given(key);
  return option ? option->as<std::string>() : fallback;
}

int64_t Flags::get_int(const std::string& key, int64_t fallback) {
  CLI::Option* option = given(key);
  return option ? value_as<int64_t>(option, key, "give an integer") : fallback;
}

double Flags::get_double(const std::string& key, double fallback) {
  CLI::Option* option = given(key);
  return option ? value_as<double>(option, key, "give a number") : fallback;
}

std::vector<int64_t> Flags::get_ints(const std::string& key, const std::vector<int64_t>& fallback) {
  CLI::Option* option = given(key);
  if (!option) return fallback;
  std::vector<int64_t> out;
  std::stringstream items(option->as<std::string>());
  std::string item;
  while (std::getline(items, item, ',')) {
    size_t used = 0;
    int64_t x = 0;
    try {
      x = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used == item.size() && !item.empty(), "--", key, " got '",
                option->as<std::string>(), "'; give comma-separated integers");
    out.push_back(x);
  }
  return out;
}

void Flags::finish() {
  if (!parser_->parsed) parser_->parse(usage_);
  const std::vector<std::string> rest = parser_->app.remaining();
  TORCH_CHECK(rest.empty(), "unknown option ", rest.empty() ? "" : rest.front(), "\n", usage_);
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
                                              int64_t newton_schulz_steps,
                                              c10::ScalarType compute_dtype) {
  std::vector<fsdp_muon::PlanGroup> groups;
  groups.reserve(model.groups.size());
  for (const auto& [name, shapes] : model.groups) {
    groups.push_back(fsdp_muon::plan_group_from_shapes(
        name, shapes, world_size, fsdp_muon::NewtonSchulzOptions().steps(newton_schulz_steps),
        compute_dtype, 16));
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
  } catch (const c10::Error& e) {
    // The message without the C++ backtrace: these are the user's mistakes, not the code's.
    std::fprintf(stderr, "%s: error: %s\n", program, e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 2;
  }
}

}  // namespace fsdp_muon_bench
