#pragma once
// Small shared pieces of the benchmarks: flags, table formatting, the round-robin baseline plan.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fsdp_muon/planning/owner_plan.h>

#include "model_shapes.h"

namespace CLI {
class Option;
}  // namespace CLI

namespace fsdp_muon_bench {

// The benchmarks' command lines, parsed by CLI11 (--key value, --key=value, --flag). A mode
// declares each option where it reads it, with the default it computes there: every read adds
// the option to the parser and parses the command line again, so an option is only known once
// some mode has read it, and finish() reports what no read claimed.
class Flags {
 public:
  Flags(int argc, char** argv, const std::string& usage);
  ~Flags();
  Flags(const Flags&) = delete;
  Flags& operator=(const Flags&) = delete;
  bool has(const std::string& key);  // a bare --key
  std::string get(const std::string& key, const std::string& fallback);
  int64_t get_int(const std::string& key, int64_t fallback);
  double get_double(const std::string& key, double fallback);
  std::vector<int64_t> get_ints(const std::string& key, const std::vector<int64_t>& fallback);
  void finish();  // throws naming the first option no read claimed

 private:
  struct Parser;
  // The option --key holding one value, after parsing: null where the command line lacks it.
  CLI::Option* given(const std::string& key);
  std::unique_ptr<Parser> parser_;
  std::string usage_;
};

// The main() of a benchmark: --help prints `usage`; otherwise `run` gets the parsed flags. An
// exception is printed as "<program>: error: <what>" and exits 2.
int run_main(int argc, char** argv, const char* program, const char* usage,
             const std::function<int(Flags&)>& run);

// printf into a std::string.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// OwnerPlanOptions::max_bytes_ratio as the tables print it: "by cost" for kBytesRatioByCost.
std::string bytes_ratio_name(double max_bytes_ratio);

// The PlanGroups FsdpMuon would build for `model` at `world_size` (docs/DESIGN.md §2 layout of the
// compute dtype, 16-byte alignment; gathers move fp32).
std::vector<fsdp_muon::PlanGroup> plan_groups(const ModelShapes& model, int world_size,
                                              int64_t newton_schulz_steps = 5,
                                              c10::ScalarType compute_dtype = at::kBFloat16);

// The naive baseline: matrix k (counting every matrix of every group in order) goes to rank
// k % W whether or not it holds any of it. Costs and bytes are accounted as in plan_owners().
fsdp_muon::OwnerPlan round_robin_plan(const std::vector<fsdp_muon::PlanGroup>& groups,
                                      int world_size, int64_t element_bytes = 4);

}  // namespace fsdp_muon_bench
