#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp/qk_clip.h>

#include <cmath>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "common/check.h"

namespace fsdp_muon {
namespace {

struct Located {
  FsdpParameterGroup* group = nullptr;
  size_t index = 0;
};

Located locate(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
               const std::string& name, size_t layer, const char* role, size_t dims) {
  for (const auto& g : groups) {
    for (size_t i = 0; i < g->num_parameters(); ++i) {
      if (g->slot(i).name != name) continue;
      FSDP_MUON_CHECK(g->slot(i).shape.size() == dims, "layer ", layer, "'s ", role, " '", name,
                      "' has ", g->slot(i).shape.size(), " dimensions; a ", role, " has ", dims);
      return {g.get(), i};
    }
  }
  FSDP_MUON_CHECK(false, "layer ", layer, "'s ", role, " '", name,
                  "' is in none of the groups given; pass the groups that hold it, by the name "
                  "shard_module gives it (its path in the module)");
  return {};
}

// Multiplies rows [first_row, first_row + factors.size()) of the parameter's main weights by
// `factors` (one per row), on the slice this rank holds.
void scale_rows(const Located& where, int64_t first_row, const std::vector<double>& factors) {
  const ParameterSlot& slot = where.group->slot(where.index);
  const int64_t cols = slot.shape.size() == 2 ? slot.shape[1] : 1;
  const auto [first, second] = where.group->held_range(where.index);
  if (first == second) return;
  at::Tensor shard = where.group->sharded_parameter(where.index);
  std::vector<double> per_row(static_cast<size_t>(slot.shape[0]), 1.0);
  for (size_t r = 0; r < factors.size(); ++r) per_row[first_row + r] = factors[r];
  // One factor per row moves to the device (without a host wait: Communicator::to_device), and
  // is spread over the held elements there.
  const at::Tensor row_factors = where.group->communicator()->to_device(
      at::tensor(per_row, at::kDouble).to(shard.scalar_type()));
  const at::Tensor rows =
      at::arange(first, second, at::TensorOptions().dtype(at::kLong).device(shard.device()))
          .div(cols, "floor");
  const at::Tensor row_factor = row_factors.index_select(0, rows);
  shard.mul_(row_factor);
}

}  // namespace

QkClipResult qk_clip(const std::vector<std::shared_ptr<FsdpParameterGroup>>& groups,
                     const std::vector<QkClipLayer>& layers, double threshold,
                     const at::Tensor& max_logits) {
  FSDP_MUON_API_SCOPE("qk_clip");
  at::NoGradGuard no_grad;
  FSDP_MUON_CHECK(!groups.empty(), "no groups given");
  for (const auto& g : groups) {
    FSDP_MUON_CHECK(g != nullptr, "a group is null");
    FSDP_MUON_CHECK(g->mesh().same_as(groups[0]->mesh()), "group '", g->name(),
                    "' is on another mesh than group '", groups[0]->name(),
                    "'; give qk_clip the groups of one model");
  }
  // Every data-parallel rank saw other logits: the maxima are reduced over the world, every
  // replica included (docs/DESIGN.md §2, Clipping); every replica then scales its rows alike.
  Communicator& comm = *groups[0]->mesh().world;

  struct Resolved {
    Located query, key, query_bias, key_bias;
  };
  std::vector<Resolved> resolved(layers.size());
  int64_t heads = 0;
  // Every check before the first collective, and the arguments agreed in the same round
  // (docs/DESIGN.md, "Agreement"): a rank with a bad argument fails them all, and ranks that
  // passed other layers or τ would clip the replicas apart or mismatch in the maximum's
  // all-reduce.
  detail::agree_on_arguments(
      comm, "its arguments",
      "Every rank must call qk_clip with the same groups, layers (in the same order) and "
      "threshold; only max_logits' values differ between ranks",
      [&] {
        FSDP_MUON_CHECK(std::isfinite(threshold) && threshold > 0,
                        "threshold must be a positive number, got ", threshold);
        FSDP_MUON_CHECK(!layers.empty(), "no layers given");
        heads = layers[0].num_heads();
        for (size_t l = 0; l < layers.size(); ++l) {
          const QkClipLayer& layer = layers[l];
          FSDP_MUON_CHECK(layer.num_heads() > 0 && layer.head_dim() > 0, "layer ", l,
                          ": num_heads and head_dim must be positive, got ", layer.num_heads(),
                          " and ", layer.head_dim());
          FSDP_MUON_CHECK(layer.num_heads() == heads, "layer ", l, " has ", layer.num_heads(),
                          " heads and layer 0 has ", heads,
                          "; max_logits is [layers, heads], one count");
          const int64_t kv = layer.num_kv_heads() == 0 ? layer.num_heads() : layer.num_kv_heads();
          FSDP_MUON_CHECK(kv > 0 && layer.num_heads() % kv == 0, "layer ", l, ": num_kv_heads (",
                          kv, ") must divide num_heads (", layer.num_heads(), ")");
          Resolved& r = resolved[l];
          r.query = locate(groups, layer.query_weight(), l, "query weight", 2);
          r.key = locate(groups, layer.key_weight(), l, "key weight", 2);
          const auto check_rows = [&](const Located& w, int64_t offset, int64_t count,
                                      const std::string& name, const char* role) {
            const int64_t rows = w.group->slot(w.index).shape[0];
            FSDP_MUON_CHECK(offset >= 0 && offset + count <= rows, "layer ", l, "'s ", role,
                            " rows [", offset, ", ", offset + count, ") do not fit '", name,
                            "' with ", rows, " rows; check the row offset, num_heads and head_dim");
          };
          check_rows(r.query, layer.query_row_offset(), layer.num_heads() * layer.head_dim(),
                     layer.query_weight(), "query");
          check_rows(r.key, layer.key_row_offset(), kv * layer.head_dim(), layer.key_weight(),
                     "key");
          if (!layer.query_bias().empty()) {
            r.query_bias = locate(groups, layer.query_bias(), l, "query bias", 1);
            check_rows(r.query_bias, layer.query_row_offset(), layer.num_heads() * layer.head_dim(),
                       layer.query_bias(), "query bias");
          }
          if (!layer.key_bias().empty()) {
            r.key_bias = locate(groups, layer.key_bias(), l, "key bias", 1);
            check_rows(r.key_bias, layer.key_row_offset(), kv * layer.head_dim(), layer.key_bias(),
                       "key bias");
          }
        }
        FSDP_MUON_CHECK(max_logits.defined() && max_logits.dim() == 2 &&
                            max_logits.size(0) == static_cast<int64_t>(layers.size()) &&
                            max_logits.size(1) == heads,
                        "max_logits must be [layers, heads] = [", layers.size(), ", ", heads,
                        "], got ", max_logits.defined() ? max_logits.sizes() : at::IntArrayRef{});
        std::vector<std::string> lines{"threshold = " + detail::exact_text(threshold)};
        std::string names;
        for (const auto& g : groups) names += (names.empty() ? "'" : ", '") + g->name() + "'";
        lines.push_back("groups = [" + names + "]");
        lines.push_back("layers = " + std::to_string(layers.size()));
        for (size_t l = 0; l < layers.size(); ++l) {
          const QkClipLayer& y = layers[l];
          lines.push_back(c10::str("layer ", l, " = query '", y.query_weight(), "' from row ",
                                   y.query_row_offset(), ", key '", y.key_weight(), "' from row ",
                                   y.key_row_offset(), ", ", y.num_heads(), " heads, ",
                                   y.num_kv_heads(), " kv heads, head_dim ", y.head_dim(),
                                   ", biases '", y.query_bias(), "', '", y.key_bias(), "'"));
        }
        return lines;
      });

  // A maximum over ranks may drop a NaN (which value wins a comparison with NaN depends on the
  // order the values meet), so a last entry, 1 where this rank has a NaN, rides along.
  at::Tensor mine = max_logits.detach().to(at::kDouble).reshape({-1});
  mine = mine.is_cpu() ? comm.to_device(mine) : mine.to(comm.device());
  at::Tensor reduced = at::cat({mine, mine.isnan().any().to(at::kDouble).reshape({1})});
  comm.all_reduce(reduced, ReduceOp::kMax);
  reduced = comm.to_host(reduced);
  const bool some_nan = reduced[-1].item<double>() > 0;
  reduced = reduced.narrow(0, 0, mine.numel()).reshape(max_logits.sizes());
  FSDP_MUON_CHECK(!some_nan && at::isfinite(reduced).all().item<bool>(),
                  "a maximum logit is NaN or Inf on some rank; nothing was clipped");

  QkClipResult result;
  result.max_logits = reduced;
  result.factors = at::ones_like(reduced);
  std::set<FsdpParameterGroup*> touched;
  for (size_t l = 0; l < layers.size(); ++l) {
    const QkClipLayer& layer = layers[l];
    const int64_t dh = layer.head_dim();
    const int64_t kv = layer.num_kv_heads() == 0 ? layer.num_heads() : layer.num_kv_heads();
    const bool own_key = kv == layer.num_heads();
    std::vector<double> query_rows(static_cast<size_t>(heads * dh), 1.0);
    std::vector<double> key_rows(static_cast<size_t>(kv * dh), 1.0);
    bool any = false;
    for (int64_t h = 0; h < heads; ++h) {
      const double s = reduced[l][h].item<double>();
      if (s <= threshold) continue;
      const double gamma = threshold / s;
      result.factors[l][h] = gamma;
      ++result.clipped_heads;
      any = true;
      const double q = own_key ? std::sqrt(gamma) : gamma;
      for (int64_t i = 0; i < dh; ++i) query_rows[h * dh + i] = q;
      if (own_key) {
        for (int64_t i = 0; i < dh; ++i) key_rows[h * dh + i] = std::sqrt(gamma);
      }
    }
    if (!any) continue;
    const Resolved& r = resolved[l];
    scale_rows(r.query, layer.query_row_offset(), query_rows);
    scale_rows(r.key, layer.key_row_offset(), key_rows);
    touched.insert(r.query.group);
    touched.insert(r.key.group);
    if (r.query_bias.group != nullptr) {
      scale_rows(r.query_bias, layer.query_row_offset(), query_rows);
      touched.insert(r.query_bias.group);
    }
    if (r.key_bias.group != nullptr) {
      scale_rows(r.key_bias, layer.key_row_offset(), key_rows);
      touched.insert(r.key_bias.group);
    }
  }
  // The same set on every rank (it depends only on the reduced maxima), refreshed in the order
  // the groups were given, so the collectives match.
  for (const auto& g : groups) {
    if (touched.count(g.get()) != 0) g->refresh_model_weights();
  }
  return result;
}

}  // namespace fsdp_muon
