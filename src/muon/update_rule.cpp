#include "muon/update_rule.h"

#include <map>
#include <mutex>

#include <c10/util/Exception.h>

#include "common/check.h"
#include "muon/muon_math.h"

namespace fsdp_muon::detail {
namespace {

// The library's variants, one row each (docs/DESIGN.md §4).
std::map<int, UpdateRule> built_in_rules() {
  std::map<int, UpdateRule> rules;
  rules[static_cast<int>(Normalization::kNone)] = UpdateRule{"none", false, nullptr};
  rules[static_cast<int>(Normalization::kNorMuon)] =
      UpdateRule{"normuon", true, &muon_normuon_normalize, /*transforms_batches=*/true};
  return rules;
}

struct Registry {
  std::mutex mutex;
  std::map<int, UpdateRule> rules = built_in_rules();
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

const UpdateRule& update_rule(Normalization normalization) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.rules.find(static_cast<int>(normalization));
  FSDP_MUON_CHECK(
      it != r.rules.end(), "normalization has an unknown value ", static_cast<int>(normalization),
      "; use Normalization::kNone or Normalization::kNorMuon (or register the variant's "
      "rule first)");
  return it->second;  // std::map: entries stay where they are as others are added
}

bool has_update_rule(Normalization normalization) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.rules.count(static_cast<int>(normalization)) > 0;
}

void register_update_rule(Normalization value, UpdateRule rule) {
  FSDP_MUON_API_SCOPE("register_update_rule");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto [it, added] = r.rules.emplace(static_cast<int>(value), std::move(rule));
  FSDP_MUON_CHECK(added, "normalization value ", static_cast<int>(value), " already has the rule '",
                  it->second.name, "'; pick a value of your own");
}

}  // namespace fsdp_muon::detail
