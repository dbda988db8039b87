#pragma once
// The cost model's rates measured at FsdpMuon's construction (docs/DESIGN.md §7): one
// Newton–Schulz of a representative shape, and a short all-to-all on the shard and on the
// replicate communicators, the slowest rank's figures everywhere, so that every rank plans from
// identical numbers. Internal header.

#include <cstdint>
#include <string>
#include <vector>

#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/newton_schulz/newton_schulz.h>
#include <fsdp_muon/optimizer/fsdp_muon_introspection.h>
#include <fsdp_muon/planning/owner_plan.h>
#include <torch/optim/optimizer.h>

namespace fsdp_muon::detail {

// What measure_rates() found; 0 (latency: negative) for what it did not measure: no matrix, a
// shard group of one rank (nothing moves within a replica), one replica.
struct MeasuredRates {
  bool measured = false;  // calibration ran
  double newton_schulz_flops_per_second = 0;
  double bytes_per_second = 0;
  double inter_node_bytes_per_second = 0;
  double exchange_latency_seconds = -1;
  double seconds = 0;  // how long the calibration took on this rank
};

// A matrix the optimizer will orthogonalize, as the calibration sees it.
struct CalibrationShape {
  int64_t rows = 0;
  int64_t cols = 0;
  NewtonSchulzOptions newton_schulz;
};

// The shape timed: the matrix of median Newton–Schulz FLOPs among `shapes` (the lower middle
// one of an even count, in the order given after a stable sort), scaled down with its aspect
// ratio kept to at most `max_elements` (each side at least 1). Empty `shapes`: rows == 0.
CalibrationShape representative_shape(std::vector<CalibrationShape> shapes, int64_t max_elements);

// Collective over mesh.world (every rank calls it, with the same shape): times a Newton–Schulz
// of `shape` on mesh.world's device (after one untimed call), then, on the shard and on the
// replicate communicator each, an all-to-all of one element per peer (the latency) and one of
// `bytes_per_peer` per peer (the rate: its bytes sent over its time less the latency's); each
// time is the fastest of three runs on a rank, then the maximum over the world's ranks (one
// all-reduce), so every rank returns the same rates.
MeasuredRates measure_rates(const DeviceMesh& mesh, const CalibrationShape& shape,
                            int64_t bytes_per_peer);

// The rates FsdpMuon plans at: config.rates() exactly when it has a value (nothing was
// measured); otherwise CostRates() with each rate `measured` has replaced by its measurement.
CostRates planned_rates(const FsdpMuonConfig& config, const MeasuredRates& measured);

// Where those rates came from, for describe(): "given by FsdpMuonConfig::rates", or "measured at
// construction", naming the rates that kept CostRates' defaults for want of anything to measure.
std::string rates_source(const FsdpMuonConfig& config, const MeasuredRates& measured);

// FsdpMuon's calibration, collective over mesh.world, the mesh of the first sharded parameter's
// group (FsdpParameterGroup::mesh; none: nothing measured): a rank measures when
// config.rates() is std::nullopt. The ranks first agree on that (one all-reduce; ranks that
// differ are an error on every rank), then measure_rates() times the median 2-D parameter (the
// last two sides of a 3-D one) by Newton–Schulz FLOPs, within 2^18 elements on the CPU and 2^22
// on CUDA, and all-to-alls of 256 KiB (CPU) or 8 MiB (CUDA) per peer. Nothing measured
// (measured == false) when no rank calibrates.
// `defaults`: the options of a parameter group given without its own.
MeasuredRates calibrate(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                        const MuonOptions& defaults, const FsdpMuonConfig& config);

}  // namespace fsdp_muon::detail
