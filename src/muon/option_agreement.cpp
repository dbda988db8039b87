#include "muon/option_agreement.h"

#include <cstdio>

namespace fsdp_muon::detail {
namespace {

std::string exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

}  // namespace

std::string describe_math_options(const MuonOptions& o) {
  std::string text = "lr " + exact(o.lr()) + ", momentum " + exact(o.momentum()) +
                     ", nesterov " + (o.nesterov() ? "true" : "false") + ", weight_decay " +
                     exact(o.weight_decay()) + " (" + to_string(o.weight_decay_method()) +
                     "), ns_steps " + std::to_string(o.ns_steps()) + ", coefficients " +
                     to_string(o.coefficients()) + ", custom_coefficients [";
  for (size_t k = 0; k < o.custom_coefficients().size(); ++k) {
    const auto& abc = o.custom_coefficients()[k];
    text += (k ? "; " : "") + exact(abc[0]) + " " + exact(abc[1]) + " " + exact(abc[2]);
  }
  text += "], scale_mode " + std::string(to_string(o.scale_mode())) + ", extra_scale_factor " +
          exact(o.extra_scale_factor()) + ", eps " + exact(o.eps()) + ", ns_dtype " +
          c10::toString(o.ns_dtype()) + ", skip_non_matrix " +
          (o.skip_non_matrix() ? "true" : "false");
  return text;
}

uint64_t fingerprint(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace fsdp_muon::detail
