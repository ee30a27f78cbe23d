// DeepSeek-V3's MoE routing (noaux_route: NoAuxRouter.forward in one call).
#include "ops.h"
#include "vec.h"

namespace eaglet {

// Indices of the k largest values, largest first, the lower index first among equal values.
void top_indices(const float* values, int64_t n, int64_t k, int64_t* out) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
      bool taken = false;
      for (int64_t q = 0; q < j; ++q) taken |= out[q] == i;
      if (!taken && (best < 0 || values[i] > values[best])) best = i;
    }
    out[j] = best;
  }
}

namespace {

template <typename T>
void route_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
                int64_t n_group, int64_t topk_group, bool norm_topk_prob, double scaling,
                at::Tensor& out_weights, at::Tensor& out_ids) {
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = weight.size(0);
  const int64_t group_size = experts / n_group;
  const T* xp = x.data_ptr<T>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* owp = out_weights.data_ptr<float>();
  int64_t* oip = out_ids.data_ptr<int64_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t grain = std::max<int64_t>(1, kParallelWork / (experts * hidden));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(experts), biased(experts), group_scores(n_group);
    std::vector<int64_t> picked(std::max(top_k, topk_group)), pair(2);
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = xp + t * hidden;  // the key of dot_rows: the expert rows share it
      int64_t e = 0;
      for (; e + 4 <= experts; e += 4) {
        const float* rows[4] = {wp + e * hidden, wp + (e + 1) * hidden, wp + (e + 2) * hidden, wp + (e + 3) * hidden};
        dot_rows<4>(rows, xt, hidden, scores.data() + e);
      }
      for (; e < experts; ++e) {
        const float* row = wp + e * hidden;
        dot_rows<1>(&row, xt, hidden, scores.data() + e);
      }
      for (e = 0; e < experts; ++e) {
        scores[e] = 1.0f / (1.0f + std::exp(-scores[e]));
        biased[e] = scores[e] + bp[e];
      }
      if (topk_group < n_group) {
        for (int64_t g = 0; g < n_group; ++g) {
          const int64_t best = std::min<int64_t>(2, group_size);
          top_indices(biased.data() + g * group_size, group_size, best, pair.data());
          float sum = 0.0f;
          for (int64_t j = 0; j < best; ++j) sum += biased[g * group_size + pair[j]];
          group_scores[g] = sum;
        }
        top_indices(group_scores.data(), n_group, topk_group, picked.data());
        for (int64_t g = 0; g < n_group; ++g) {
          bool kept = false;
          for (int64_t j = 0; j < topk_group; ++j) kept |= picked[j] == g;
          if (!kept) std::fill(biased.begin() + g * group_size, biased.begin() + (g + 1) * group_size, neg_inf);
        }
      }
      top_indices(biased.data(), experts, top_k, picked.data());
      float total = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) total += scores[picked[j]];
      const float denominator = norm_topk_prob ? total + 1e-20f : 1.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        oip[t * top_k + j] = picked[j];
        const float w = norm_topk_prob ? scores[picked[j]] / denominator : scores[picked[j]];
        owp[t * top_k + j] = w * static_cast<float>(scaling);
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> noaux_route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                               const RouterConfig& router) {
  const int64_t top_k = router.top_k, n_group = router.n_group, topk_group = router.topk_group;
  const bool norm_topk_prob = router.norm_topk_prob;
  const double scaling = router.scaling;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "noaux_route: x [T, D], weight [E, D]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat, "noaux_route: float32 router");
  TORCH_CHECK(n_group >= 1 && weight.size(0) % n_group == 0, "noaux_route: experts not divisible into groups");
  TORCH_CHECK(topk_group >= 1 && topk_group <= n_group, "noaux_route: topk_group out of range");
  const int64_t kept_experts = topk_group < n_group ? topk_group * (weight.size(0) / n_group) : weight.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= kept_experts, "noaux_route: top_k out of range");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias.contiguous();
  at::Tensor out_weights = at::empty({x.size(0), top_k}, x.options().dtype(at::kFloat));
  at::Tensor out_ids = at::empty({x.size(0), top_k}, x.options().dtype(at::kLong));
  if (xc.scalar_type() == at::kBFloat16) {
    route_impl<at::BFloat16>(xc, wc, bc, top_k, n_group, topk_group, norm_topk_prob, scaling, out_weights, out_ids);
  } else {
    TORCH_CHECK(xc.scalar_type() == at::kFloat, "noaux_route: bfloat16 or float32 input");
    route_impl<float>(xc, wc, bc, top_k, n_group, topk_group, norm_topk_prob, scaling, out_weights, out_ids);
  }
  return {out_weights, out_ids};
}

}  // namespace eaglet
