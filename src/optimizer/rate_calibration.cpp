// Rate calibration (docs/DESIGN.md §7): the cost model's rates measured where FsdpMuon runs.
#include "optimizer/rate_calibration.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/muon/muon_options.h>

#include "comm/agreement.h"
#include "common/check.h"

namespace fsdp_muon::detail {
namespace {

using Clock = std::chrono::steady_clock;

// Each figure is the fastest of this many timed runs on a rank: a shared machine's interference
// only ever slows a run down, so the minimum is the stable estimate of what the hardware does,
// and one slow run must not change the plan (docs/DESIGN.md §7).
constexpr int kTimedRuns = 3;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Waits for the device work behind `t`: one element read through to_host, the only host wait
// library code makes (bounded by the communicator's timeout; CPU work is done already).
void settle(Communicator& comm, const at::Tensor& t) {
  if (t.is_cuda()) (void)comm.to_host(t.reshape(-1).narrow(0, 0, std::min<int64_t>(1, t.numel())));
}

// One all-to-all of `per_peer` fp32 elements to every peer, timed.
double time_all_to_all(Communicator& comm, int64_t per_peer) {
  const int64_t n = comm.size();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(comm.device());
  const at::Tensor send = at::zeros({n * per_peer}, options);
  const at::Tensor recv = at::empty({n * per_peer}, options);
  const std::vector<int64_t> counts(n, per_peer);
  settle(comm, send);
  const auto start = Clock::now();
  comm.all_to_all_v(send, counts, recv, counts);
  settle(comm, recv);
  return seconds_since(start);
}

// [latency, bulk] seconds on `comm`: after an untimed one, the fastest of kTimedRuns
// one-element all-to-alls, then of kTimedRuns of `per_peer` elements per peer. Zeros for a
// communicator of one rank (nothing to send).
std::pair<double, double> probe(Communicator& comm, int64_t per_peer) {
  if (comm.size() == 1) return {0.0, 0.0};
  (void)time_all_to_all(comm, 1);
  double latency = std::numeric_limits<double>::infinity(), bulk = latency;
  for (int k = 0; k < kTimedRuns; ++k) latency = std::min(latency, time_all_to_all(comm, 1));
  for (int k = 0; k < kTimedRuns; ++k) bulk = std::min(bulk, time_all_to_all(comm, per_peer));
  return {latency, bulk};
}

double link_rate(const Communicator& comm, int64_t per_peer, double latency, double bulk) {
  const double sent = static_cast<double>((comm.size() - 1) * per_peer * 4);
  // A bulk transfer no slower than the latency probe: the link is faster than this clock can
  // tell; its bytes over the latency is a lower bound.
  return sent / std::max(bulk - latency, std::max(latency, 1e-9));
}

}  // namespace

CalibrationShape representative_shape(std::vector<CalibrationShape> shapes, int64_t max_elements) {
  if (shapes.empty()) return {};
  std::stable_sort(shapes.begin(), shapes.end(),
                   [](const CalibrationShape& a, const CalibrationShape& b) {
                     return newton_schulz_flops(a.rows, a.cols, a.newton_schulz) <
                            newton_schulz_flops(b.rows, b.cols, b.newton_schulz);
                   });
  CalibrationShape median = shapes[(shapes.size() - 1) / 2];
  const double numel = static_cast<double>(median.rows) * static_cast<double>(median.cols);
  if (numel > static_cast<double>(max_elements)) {
    const double scale = std::sqrt(static_cast<double>(max_elements) / numel);
    median.rows = std::max<int64_t>(1, static_cast<int64_t>(std::floor(median.rows * scale)));
    median.cols = std::max<int64_t>(1, static_cast<int64_t>(std::floor(median.cols * scale)));
  }
  return median;
}

MeasuredRates measure_rates(const DeviceMesh& mesh, const CalibrationShape& shape,
                            int64_t bytes_per_peer) {
  FSDP_MUON_API_SCOPE("measure_rates");
  FSDP_MUON_CHECK(bytes_per_peer >= 4, "bytes_per_peer must be >= 4, got ", bytes_per_peer);
  const auto start = Clock::now();
  const int64_t per_peer = bytes_per_peer / 4;
  // [Newton–Schulz, shard latency, shard bulk, replicate latency, replicate bulk] seconds.
  std::vector<double> times(5, 0.0);
  if (shape.rows > 0 && shape.cols > 0) {
    // Values do not change a GEMM's time; a fixed matrix leaves the caller's RNG alone.
    const at::Tensor x =
        at::sin(at::arange(shape.rows * shape.cols,
                           at::TensorOptions().dtype(at::kFloat).device(mesh.world->device())))
            .reshape({shape.rows, shape.cols});
    settle(*mesh.world, newton_schulz(x, shape.newton_schulz));  // pays one-time set-up
    times[0] = std::numeric_limits<double>::infinity();
    for (int k = 0; k < kTimedRuns; ++k) {
      const auto ns_start = Clock::now();
      settle(*mesh.world, newton_schulz(x, shape.newton_schulz));
      times[0] = std::min(times[0], seconds_since(ns_start));
    }
  }
  std::tie(times[1], times[2]) = probe(*mesh.shard, per_peer);
  std::tie(times[3], times[4]) = probe(*mesh.replicate, per_peer);
  // The slowest rank's figures, on every rank.
  at::Tensor slowest = mesh.world->to_device(at::tensor(times, at::kDouble));
  mesh.world->all_reduce(slowest, ReduceOp::kMax);
  slowest = mesh.world->to_host(slowest);
  const auto at_ = [&](int i) { return slowest[i].item<double>(); };

  MeasuredRates rates;
  rates.measured = true;
  if (at_(0) > 0) {
    rates.newton_schulz_flops_per_second =
        newton_schulz_flops(shape.rows, shape.cols, shape.newton_schulz) / at_(0);
  }
  if (mesh.shard->size() > 1) {
    rates.bytes_per_second = link_rate(*mesh.shard, per_peer, at_(1), at_(2));
    rates.exchange_latency_seconds = at_(1);
  }
  if (mesh.replicate->size() > 1) {
    rates.inter_node_bytes_per_second = link_rate(*mesh.replicate, per_peer, at_(3), at_(4));
    if (rates.exchange_latency_seconds < 0) rates.exchange_latency_seconds = at_(3);
  }
  rates.seconds = seconds_since(start);
  return rates;
}

CostRates planned_rates(const FsdpMuonConfig& config, const MeasuredRates& measured) {
  if (config.rates()) return *config.rates();
  CostRates rates;
  if (!measured.measured) return rates;
  if (measured.newton_schulz_flops_per_second > 0) {
    rates.newton_schulz_flops_per_second(measured.newton_schulz_flops_per_second);
  }
  if (measured.bytes_per_second > 0) rates.bytes_per_second(measured.bytes_per_second);
  if (measured.inter_node_bytes_per_second > 0) {
    rates.inter_node_bytes_per_second(measured.inter_node_bytes_per_second);
  }
  if (measured.exchange_latency_seconds >= 0) {
    rates.exchange_latency_seconds(measured.exchange_latency_seconds);
  }
  return rates;
}

std::string rates_source(const FsdpMuonConfig& config, const MeasuredRates& measured) {
  if (config.rates()) return "given by FsdpMuonConfig::rates";
  if (!measured.measured) return "CostRates' defaults (nothing to measure with)";
  std::string defaulted;
  const auto add = [&](bool missing, const char* name) {
    if (missing) defaulted += (defaulted.empty() ? "" : ", ") + std::string(name);
  };
  add(measured.newton_schulz_flops_per_second <= 0, "newton_schulz_flops_per_second");
  add(measured.bytes_per_second <= 0, "bytes_per_second");
  add(measured.inter_node_bytes_per_second <= 0, "inter_node_bytes_per_second");
  add(measured.exchange_latency_seconds < 0, "exchange_latency_seconds");
  return "measured at construction" +
         (defaulted.empty() ? std::string()
                            : " (CostRates' default, nothing to measure it on: " + defaulted + ")");
}

MeasuredRates calibrate(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                        const MuonOptions& muon_defaults, const FsdpMuonConfig& config) {
  std::optional<DeviceMesh> found;
  for (const auto& group : param_groups) {
    for (const at::Tensor& p : group.params()) {
      if (found) break;
      if (auto info = find_sharded_parameter(p)) found = info->group->mesh();
    }
  }
  if (!found) return {};  // nobody to measure with; FsdpMuon reports the error
  const DeviceMesh& mesh = *found;
  const bool wants = !config.rates().has_value();
  std::vector<CalibrationShape> shapes;
  const std::vector<int64_t> calibrating =
      agree_on_sum(*mesh.world, 1, [&](std::vector<int64_t>& mine) {
        // Every MuonOptions checked here, in construction's first agreement: a rank with an
        // invalid option would otherwise fail alone in the calibration's Newton-Schulz while
        // the others wait in its exchange, and they would learn nothing but a timeout.
        muon_defaults.validate();
        for (const auto& group : param_groups) {
          if (!group.has_options()) continue;
          if (const auto* options = dynamic_cast<const MuonOptions*>(&group.options())) {
            options->validate();
          }
        }
        mine[0] = wants ? 1 : 0;
        if (!wants) return;
        for (const auto& group : param_groups) {
          const auto* options = group.has_options()
                                    ? dynamic_cast<const MuonOptions*>(&group.options())
                                    : &muon_defaults;
          if (options == nullptr) continue;  // an error FsdpMuon reports later
          for (const at::Tensor& p : group.params()) {
            const auto info = find_sharded_parameter(p);
            if (!info) continue;
            const std::vector<int64_t>& shape = info->slot().shape;
            if (shape.size() < 2 || shape.size() > 3) continue;
            shapes.push_back({shape[shape.size() - 2], shape.back(), options->newton_schulz()});
          }
        }
      });
  const int64_t world = mesh.world->size();
  FSDP_MUON_CHECK(calibrating[0] == 0 || calibrating[0] == world, calibrating[0], " of ", world,
                  " ranks measure the cost model's rates at construction and the others do not; "
                  "give every rank the same FsdpMuonConfig::rates (std::nullopt: measured, a "
                  "CostRates: planned at as given)");
  if (calibrating[0] == 0) return {};
  const bool cuda = mesh.world->device().is_cuda();
  // On the CPU 2^18 elements (e.g. 296 x 887 for a 768 x 2304 matrix) keep the GEMMs near the
  // rate of the real ones at ~10 ms a run; 2^16 measured 60% of GPT-2's NS rate.
  return measure_rates(mesh, representative_shape(std::move(shapes), cuda ? 1 << 22 : 1 << 18),
                       cuda ? 8 << 20 : 256 << 10);
}

}  // namespace fsdp_muon::detail
