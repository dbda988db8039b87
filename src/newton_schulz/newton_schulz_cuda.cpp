// Temporary: delegates to the ATen path until the cuBLAS path lands.
#include "newton_schulz/newton_schulz_internal.h"

namespace fsdp_muon::detail {
at::Tensor newton_schulz_cuda(const at::Tensor& x, const NewtonSchulzOptions& options) {
  return newton_schulz_aten(x, options);
}
}  // namespace fsdp_muon::detail
