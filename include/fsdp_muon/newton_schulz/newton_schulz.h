#pragma once
// Newton–Schulz orthogonalization (docs/DESIGN.md §4): the function every Muon in this library
// runs, its schedule and its FLOPs (the engine tier; its options are in ns_options.h).

#include <array>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdp_muon/config.h>
#include <fsdp_muon/newton_schulz/ns_options.h>

namespace fsdp_muon {

// The (a, b, c) tuple of every iteration for these options, after the schedule's cycle /
// repeat-last rule has been applied. Throws on invalid options (steps < 1, cubic5 with a step
// count other than 5, a custom tuple that is not finite).
FSDP_MUON_API std::vector<std::array<double, 3>> newton_schulz_schedule(
    const NewtonSchulzOptions& options);

// FLOPs (multiply-adds counted as 2) of orthogonalizing one rows × cols matrix with these
// options, counting the GEMMs only. For kAuto, the method it picks for that shape. Throws on
// invalid options.
FSDP_MUON_API double newton_schulz_flops(int64_t rows, int64_t cols,
                                         const NewtonSchulzOptions& options);

// The method options.method() resolves to for a rows × cols matrix (kAuto: the cheaper one by
// newton_schulz_flops, standard on a tie).
FSDP_MUON_API NsMethod resolve_ns_method(int64_t rows, int64_t cols,
                                         const NewtonSchulzOptions& options);

// Orthogonalizes a 2-D matrix or a 3-D batch of same-shape matrices. The result has the input's
// shape and the compute dtype converted back to the input's dtype. CPU tensors go through ATen;
// CUDA tensors through cuBLAS on the caller's current stream.
FSDP_MUON_API at::Tensor newton_schulz(const at::Tensor& x,
                                       const NewtonSchulzOptions& options = {});

}  // namespace fsdp_muon
