// Fused CPU kernels for the decode path: RMSNorm, DeepSeek-V3 routing, and absorbed MLA attention
// over the paged latent cache. Each replaces a chain of small PyTorch ops whose per-op dispatch
// (not arithmetic) dominates a decode step of a small model.
//
// Every kernel computes a row (a token, or a token's head) with the same arithmetic whatever else
// is in the batch: loops over a row's elements run in a fixed order with fixed-width partial sums,
// and no work is split inside a row. So a token's result does not depend on how many tokens share
// the call, which is what lossless greedy speculation needs (a verify pass must reproduce decoding).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __mmask16 tail_mask(int64_t left) { return left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }
#endif

// dot(rows[r], key) for NR rows at once (independent sums the CPU overlaps). A row's sum is
// computed the same way whatever NR is: kLanes partial sums in element order, then one reduction.
template <int NR, typename K>
inline void dot_rows(const float* const* rows, const K* key, int64_t n, float* out) {
#if defined(__AVX512F__)
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 k = load16(key + i, m);
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_fmadd_ps(load16(rows[r] + i, m), k, acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
#else
  for (int r = 0; r < NR; ++r) {
    float acc[kLanes] = {0};
    for (int64_t i = 0; i < n; ++i) acc[i % kLanes] += rows[r][i] * to_float(key[i]);
    float total = 0.0f;
    for (int j = 0; j < kLanes; ++j) total += acc[j];
    out[r] = total;
  }
#endif
}

// out[i] += scale * x[i]
template <typename X>
inline void axpy(float* out, float scale, const X* x, int64_t n) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(a, load16(x + i, m), load16(out + i, m)));
  }
#else
  for (int64_t i = 0; i < n; ++i) out[i] += scale * to_float(x[i]);
#endif
}

// The float32 values of a row of x.
template <typename X>
inline void load_row(float* out, const X* x, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, load16(x + i, m));
  }
#else
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(x[i]);
#endif
}

// exp(x) to about 2 ulp for the softmax (Cephes' expf polynomial), written so that compilers
// vectorize a loop of it; 0 below -87 (where float32 exp leaves the normal range).
inline float exp_approx(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// Below this many multiply-adds a kernel runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelWork = 1 << 15;

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t dim = x.size(-1);
  const int64_t rows = x.numel() / dim;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kParallelWork / dim);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    const float* row_ptr = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * dim;
      T* orow = op + r * dim;
      load_row(row.data(), xr, dim);
      float sum_square;
      dot_rows<1>(&row_ptr, row.data(), dim, &sum_square);
      const float mean_square = sum_square / static_cast<float>(dim);
      const float inv_rms = 1.0f / std::sqrt(mean_square + static_cast<float>(eps));
      for (int64_t i = 0; i < dim; ++i) {
        // normalized in float32, rounded to the input dtype, then scaled by the weight in that dtype
        const float normed = to_float(from_float<T>(to_float(xr[i]) * inv_rms));
        orow[i] = from_float<T>(to_float(wp[i]) * normed);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [hidden]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  if (xc.scalar_type() == at::kBFloat16) {
    rms_norm_impl<at::BFloat16>(xc, wc, eps, out);
  } else {
    TORCH_CHECK(xc.scalar_type() == at::kFloat, "rms_norm: bfloat16 or float32 input");
    rms_norm_impl<float>(xc, wc, eps, out);
  }
  return out;
}

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

std::tuple<at::Tensor, at::Tensor> noaux_route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                               int64_t top_k, int64_t n_group, int64_t topk_group,
                                               bool norm_topk_prob, double scaling) {
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

// out[r][0:n] = sum over j of coef[r][j] * terms[j][0:n], for NR rows at once: the sum runs over
// j in order with one fused multiply-add per term, so a row's result does not depend on NR.
template <int NR, typename C, typename B>
inline void combine_rows(float* const* out, const C* const* coef, const B* const* terms, int64_t num_terms, int64_t n) {
#if defined(__AVX512F__)
  constexpr int kChunk = 16 / NR;  // vectors per row held in registers: 16 accumulators
  for (int64_t c0 = 0; c0 < n; c0 += kChunk * kLanes) {
    __m512 acc[NR][kChunk];
    __mmask16 masks[kChunk];
    for (int v = 0; v < kChunk; ++v) {
      const int64_t left = n - c0 - v * kLanes;
      masks[v] = left <= 0 ? 0 : tail_mask(left);
      for (int r = 0; r < NR; ++r) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < num_terms; ++j) {
      const B* term = terms[j] + c0;
      __m512 a[NR];
      for (int r = 0; r < NR; ++r) a[r] = _mm512_set1_ps(to_float(coef[r][j]));
      for (int v = 0; v < kChunk; ++v) {
        if (!masks[v]) break;
        const __m512 t = load16(term + v * kLanes, masks[v]);
        for (int r = 0; r < NR; ++r) acc[r][v] = _mm512_fmadd_ps(a[r], t, acc[r][v]);
      }
    }
    for (int v = 0; v < kChunk && masks[v]; ++v) {
      for (int r = 0; r < NR; ++r) _mm512_mask_storeu_ps(out[r] + c0 + v * kLanes, masks[v], acc[r][v]);
    }
  }
#else
  for (int r = 0; r < NR; ++r) {
    std::fill(out[r], out[r] + n, 0.0f);
    for (int64_t j = 0; j < num_terms; ++j) {
      const float a = to_float(coef[r][j]);
      for (int64_t i = 0; i < n; ++i) out[r][i] += a * to_float(terms[j][i]);
    }
  }
#endif
}

template <typename C, typename B>
void combine_all_rows(float* const* out, const C* const* coef, const B* const* terms, int64_t rows, int64_t num_terms,
                      int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) combine_rows<4>(out + r, coef + r, terms, num_terms, n);
  for (; r + 2 <= rows; r += 2) combine_rows<2>(out + r, coef + r, terms, num_terms, n);
  for (; r < rows; ++r) combine_rows<1>(out + r, coef + r, terms, num_terms, n);
}

template <typename K>
void dot_all_rows(const float* const* rows, int64_t num_rows, const K* key, int64_t n, float* out) {
  int64_t r = 0;
  for (; r + 4 <= num_rows; r += 4) dot_rows<4>(rows + r, key, n, out + r);
  for (; r < num_rows; ++r) dot_rows<1>(rows + r, key, n, out + r);
}

// Absorbed MLA attention in three passes, each split over threads by its own work items:
//   1. per head: q_latent = q_nope W_UK[h] for every token;
//   2. per (request, group of heads): scores of [q_latent | q_pe] against the request's cached
//      [c_kv | k_pe] rows over the visible keys, softmax, o = sum of p * c_kv;
//   3. per head: out = o W_UV[h].
// Every (token, head) row is summed in an order fixed by the shapes alone.
template <typename Q, typename KV>
void mla_impl(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv, const at::Tensor& w_uk,
              const at::Tensor& w_uv_t, const at::Tensor& slots, const at::Tensor& kv_lens,
              const at::Tensor& token_starts, const c10::optional<at::Tensor>& custom_mask, double scale,
              at::Tensor& out) {
  const int64_t tokens = q_nope.size(0), heads = q_nope.size(1), nope = q_nope.size(2);
  const int64_t requests = kv_lens.size(0), rope = q_pe.size(2), latent = w_uk.size(2), value = w_uv_t.size(2);
  const int64_t qdim = latent + rope;
  const Q* qn = q_nope.data_ptr<Q>();
  const Q* qp = q_pe.data_ptr<Q>();
  const KV* kvp = kv.data_ptr<KV>();
  const float* wuk = w_uk.data_ptr<float>();
  const float* wuv = w_uv_t.data_ptr<float>();
  const int64_t* slot_rows = slots.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t* starts = token_starts.data_ptr<int64_t>();
  const bool* mask = custom_mask ? custom_mask->data_ptr<bool>() : nullptr;
  const int64_t mask_stride = custom_mask ? custom_mask->size(1) : 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  Q* op = out.data_ptr<Q>();

  std::vector<float> query(tokens * heads * qdim), o_latent(tokens * heads * latent), o_value(tokens * heads * value);
  const bool parallel_heads = tokens * (nope + value) * latent * heads >= kParallelWork;
  at::parallel_for(0, heads, parallel_heads ? 1 : heads, [&](int64_t begin, int64_t end) {
    std::vector<float*> out_rows(tokens);
    std::vector<const Q*> coef(tokens);
    std::vector<const float*> terms(nope);
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        out_rows[t] = query.data() + (t * heads + h) * qdim;
        coef[t] = qn + (t * heads + h) * nope;
        load_row(out_rows[t] + latent, qp + (t * heads + h) * rope, rope);
      }
      for (int64_t p = 0; p < nope; ++p) terms[p] = wuk + (h * nope + p) * latent;
      combine_all_rows(out_rows.data(), coef.data(), terms.data(), tokens, nope, latent);
    }
  });

  // Pass 2 work items: requests, each split into head groups when there are fewer requests than threads.
  const int64_t groups = std::min<int64_t>(heads, std::max<int64_t>(1, (at::get_num_threads() + requests - 1) / requests));
  const int64_t group_heads = (heads + groups - 1) / groups;
  int64_t total_keys = 0;
  for (int64_t b = 0; b < requests; ++b) total_keys += lens[b] * (starts[b + 1] - starts[b]);
  const bool parallel_requests = total_keys * heads * 2 * qdim >= kParallelWork;
  at::parallel_for(0, requests * groups, parallel_requests ? 1 : requests * groups, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row_scores;
    std::vector<const float*> rows, prob_rows;
    std::vector<float*> out_rows;
    std::vector<const KV*> keys_of;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / groups, h0 = (item % groups) * group_heads, h1 = std::min(heads, h0 + group_heads);
      if (h0 >= h1) continue;
      const int64_t first = starts[b], n = starts[b + 1] - first, keys = lens[b], hg = h1 - h0;
      const int64_t num_rows = n * hg;  // row i * hg + (h - h0): token first + i, head h
      rows.resize(num_rows);
      out_rows.resize(num_rows);
      prob_rows.resize(num_rows);
      row_scores.resize(num_rows * keys);
      scores.assign(num_rows * keys, neg_inf);
      keys_of.resize(keys);
      const int64_t* row_slots = slot_rows + b * slots.size(1);
      for (int64_t s = 0; s < keys; ++s) keys_of[s] = kvp + row_slots[s] * qdim;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t r = i * hg + h - h0;
          rows[r] = query.data() + ((first + i) * heads + h) * qdim;
          out_rows[r] = o_latent.data() + ((first + i) * heads + h) * latent;
          prob_rows[r] = scores.data() + r * keys;
        }
      }
      // Rows in blocks of eight against every key: a block's queries stay in L1 while keys stream.
      for (int64_t r0 = 0; r0 < num_rows; r0 += 8) {
        const int64_t block = std::min<int64_t>(8, num_rows - r0);
        for (int64_t s = 0; s < keys; ++s) {
          float dots[8];
          if (block == 8) {
            dot_rows<8>(rows.data() + r0, keys_of[s], qdim, dots);
          } else {
            for (int64_t r = 0; r < block; ++r) dot_rows<1>(rows.data() + r0 + r, keys_of[s], qdim, dots + r);
          }
          for (int64_t r = 0; r < block; ++r) row_scores[(r0 + r) * keys + s] = dots[r];
        }
      }
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t i = r / hg;
        float* p = scores.data() + r * keys;
        const float* raw = row_scores.data() + r * keys;
        const bool* visible = mask ? mask + (first + i) * mask_stride : nullptr;
        const int64_t causal_keys = keys - n + i + 1;
        float max_score = neg_inf;
        for (int64_t s = 0; s < keys; ++s) {
          if (visible ? visible[s] : s < causal_keys) p[s] = raw[s] * static_cast<float>(scale);
          max_score = std::max(max_score, p[s]);
        }
        if (max_score == neg_inf) {  // sees no key: zeros, as a fully masked softmax row is not defined
          std::fill(p, p + keys, 0.0f);
          continue;
        }
        float total = 0.0f;
        for (int64_t s = 0; s < keys; ++s) {
          p[s] = exp_approx(p[s] - max_score);
          total += p[s];
        }
        const float inv_total = 1.0f / total;
        for (int64_t s = 0; s < keys; ++s) p[s] *= inv_total;
      }
      combine_all_rows(out_rows.data(), prob_rows.data(), keys_of.data(), num_rows, keys, latent);
    }
  });

  at::parallel_for(0, heads, parallel_heads ? 1 : heads, [&](int64_t begin, int64_t end) {
    std::vector<float*> out_rows(tokens);
    std::vector<const float*> coef(tokens), terms(latent);
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        out_rows[t] = o_value.data() + (t * heads + h) * value;
        coef[t] = o_latent.data() + (t * heads + h) * latent;
      }
      for (int64_t l = 0; l < latent; ++l) terms[l] = wuv + (h * latent + l) * value;
      combine_all_rows(out_rows.data(), coef.data(), terms.data(), tokens, latent, value);
    }
  });
  for (int64_t i = 0; i < tokens * heads * value; ++i) op[i] = from_float<Q>(o_value[i]);
}

at::Tensor mla_absorbed_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv,
                                  const at::Tensor& w_uk, const at::Tensor& w_uv_t, const at::Tensor& slots,
                                  const at::Tensor& kv_lens, const at::Tensor& token_starts,
                                  const c10::optional<at::Tensor>& custom_mask, double scale) {
  TORCH_CHECK(q_nope.dim() == 3 && q_pe.dim() == 3 && q_nope.size(0) == q_pe.size(0) && q_nope.size(1) == q_pe.size(1),
              "mla_absorbed_attention: q_nope [T, H, P] and q_pe [T, H, R]");
  TORCH_CHECK(q_nope.scalar_type() == q_pe.scalar_type(), "mla_absorbed_attention: q_nope and q_pe dtypes differ");
  TORCH_CHECK(w_uk.scalar_type() == at::kFloat && w_uv_t.scalar_type() == at::kFloat, "mla_absorbed_attention: float32 W_UK / W_UV");
  TORCH_CHECK(w_uk.size(0) == q_nope.size(1) && w_uk.size(1) == q_nope.size(2), "mla_absorbed_attention: W_UK is [H, P, L]");
  TORCH_CHECK(w_uv_t.size(0) == q_nope.size(1) && w_uv_t.size(1) == w_uk.size(2), "mla_absorbed_attention: W_UV^T is [H, L, V]");
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == w_uk.size(2) + q_pe.size(2), "mla_absorbed_attention: cache rows are [L + R]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong && token_starts.scalar_type() == at::kLong,
              "mla_absorbed_attention: int64 slots, kv_lens and token_starts");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == kv_lens.size(0) && token_starts.size(0) == kv_lens.size(0) + 1,
              "mla_absorbed_attention: slots [B, S], kv_lens [B], token_starts [B + 1]");
  const at::Tensor qn = q_nope.contiguous(), qp = q_pe.contiguous(), wuk = w_uk.contiguous(), wuv = w_uv_t.contiguous();
  const at::Tensor sl = slots.contiguous(), lens = kv_lens.contiguous(), starts = token_starts.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* stp = starts.data_ptr<int64_t>();
  const int64_t max_keys = custom_mask ? custom_mask->size(1) : slots.size(1);
  TORCH_CHECK(stp[0] == 0 && stp[lens.size(0)] == q_nope.size(0), "mla_absorbed_attention: token_starts do not cover the tokens");
  for (int64_t b = 0; b < lens.size(0); ++b) {
    const int64_t n = stp[b + 1] - stp[b];
    TORCH_CHECK(n >= 1 && lp[b] >= n && lp[b] <= std::min(max_keys, slots.size(1)),
                "mla_absorbed_attention: request ", b, " has ", n, " tokens and ", lp[b], " keys");
    const int64_t* row = sl.data_ptr<int64_t>() + b * slots.size(1);
    for (int64_t s = 0; s < lp[b]; ++s) {
      TORCH_CHECK(row[s] >= 0 && row[s] < kv.size(0), "mla_absorbed_attention: cache slot ", row[s], " out of range");
    }
  }
  if (custom_mask) {
    TORCH_CHECK(custom_mask->scalar_type() == at::kBool && custom_mask->dim() == 2 && custom_mask->size(0) == q_nope.size(0),
                "mla_absorbed_attention: custom_mask is [T, S] bool");
  }
  c10::optional<at::Tensor> mask;
  if (custom_mask) mask = custom_mask->contiguous();
  at::Tensor out = at::empty({q_nope.size(0), q_nope.size(1), w_uv_t.size(2)}, qn.options());
  TORCH_CHECK(kv.is_contiguous(), "mla_absorbed_attention: contiguous cache");
  const bool q_bf16 = qn.scalar_type() == at::kBFloat16, kv_bf16 = kv.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q_bf16 || qn.scalar_type() == at::kFloat, "mla_absorbed_attention: bfloat16 or float32 queries");
  TORCH_CHECK(kv_bf16 || kv.scalar_type() == at::kFloat, "mla_absorbed_attention: bfloat16 or float32 cache");
  if (q_bf16 && kv_bf16) {
    mla_impl<at::BFloat16, at::BFloat16>(qn, qp, kv, wuk, wuv, sl, lens, starts, mask, scale, out);
  } else if (q_bf16) {
    mla_impl<at::BFloat16, float>(qn, qp, kv, wuk, wuv, sl, lens, starts, mask, scale, out);
  } else if (kv_bf16) {
    mla_impl<float, at::BFloat16>(qn, qp, kv, wuk, wuv, sl, lens, starts, mask, scale, out);
  } else {
    mla_impl<float, float>(qn, qp, kv, wuk, wuv, sl, lens, starts, mask, scale, out);
  }
  return out;
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Experts = true;

// out[x][w] = dot(x_rows[x], w_rows[w]) over n bfloat16 values, for NX x NW pairs at once;
// each pair is summed the same way whatever NX and NW are (pairs of products per lane, lanes in order).
template <int NX, int NW>
inline void dot_bf16(const at::BFloat16* const* x_rows, const at::BFloat16* const* w_rows, int64_t n, float* out,
                     int64_t out_stride) {
  __m512 acc[NX][NW];
  for (int x = 0; x < NX; ++x)
    for (int w = 0; w < NW; ++w) acc[x][w] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 32) {
    const int64_t left = n - i;
    const __mmask32 m = left >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << left) - 1);
    __m512bh wv[NW];
    for (int w = 0; w < NW; ++w) wv[w] = (__m512bh)_mm512_maskz_loadu_epi16(m, w_rows[w] + i);
    for (int x = 0; x < NX; ++x) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x_rows[x] + i);
      for (int w = 0; w < NW; ++w) acc[x][w] = _mm512_dpbf16_ps(acc[x][w], xv, wv[w]);
    }
  }
  for (int x = 0; x < NX; ++x)
    for (int w = 0; w < NW; ++w) out[x * out_stride + w] = _mm512_reduce_add_ps(acc[x][w]);
}

// out[x * out_stride + w] = dot(x_rows[x], w_rows[w]) for every x < num_x, w < num_w.
void dot_bf16_all(const at::BFloat16* const* x_rows, int64_t num_x, const at::BFloat16* const* w_rows, int64_t num_w,
                  int64_t n, float* out, int64_t out_stride) {
  for (int64_t w = 0; w < num_w; w += 4) {
    const int64_t nw = std::min<int64_t>(4, num_w - w);
    for (int64_t x = 0; x < num_x; x += 4) {
      const int64_t nx = std::min<int64_t>(4, num_x - x);
      float* o = out + x * out_stride + w;
      if (nx == 4 && nw == 4) {
        dot_bf16<4, 4>(x_rows + x, w_rows + w, n, o, out_stride);
      } else {
        for (int64_t xi = 0; xi < nx; ++xi)
          for (int64_t wi = 0; wi < nw; ++wi) dot_bf16<1, 1>(x_rows + x + xi, w_rows + w + wi, n, o + xi * out_stride + wi, 1);
      }
    }
  }
}
#else
constexpr bool kBf16Experts = false;
#endif

bool bf16_experts_supported() { return kBf16Experts; }

// Routed SwiGLU experts of a bfloat16 model for a small batch, in one call: tokens grouped by
// expert, gate/up and down products as bfloat16 dot products (AVX512-BF16), silu(gate) * up rounded
// to bfloat16 between them as the PyTorch path rounds, and each token's expert outputs weighted
// and summed in float32 in ascending expert id. Every (token, expert) row is computed alone.
at::Tensor moe_routed_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& weights,
                              const at::Tensor& ids) {
  TORCH_CHECK(kBf16Experts, "moe_routed_experts: this CPU build has no AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w13.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16,
              "moe_routed_experts: bfloat16 x and expert weights");
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && w13.size(2) == x.size(1) && w2.size(1) == x.size(1) &&
                  w13.size(1) == 2 * w2.size(2) && w13.size(0) == w2.size(0),
              "moe_routed_experts: x [T, D], w13 [E, 2I, D], w2 [E, D, I]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong && weights.sizes() == ids.sizes() &&
                  ids.dim() == 2 && ids.size(0) == x.size(0),
              "moe_routed_experts: float32 weights and int64 ids, both [T, k]");
#if defined(__AVX512BF16__)
  const at::Tensor xc = x.contiguous(), w13c = w13.contiguous(), w2c = w2.contiguous();
  const at::Tensor wc = weights.contiguous(), ic = ids.contiguous();
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = w13.size(0), inter = w2.size(2), top_k = ids.size(1);
  const int64_t* idp = ic.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* w13p = w13c.data_ptr<at::BFloat16>();
  const at::BFloat16* w2p = w2c.data_ptr<at::BFloat16>();
  // Assignments grouped by expert, tokens in order within each (a counting sort).
  std::vector<int64_t> offsets(experts + 1, 0), order(tokens * top_k);
  for (int64_t a = 0; a < tokens * top_k; ++a) {
    TORCH_CHECK(idp[a] >= 0 && idp[a] < experts, "moe_routed_experts: expert id ", idp[a], " out of range");
    ++offsets[idp[a] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  {
    std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
    for (int64_t a = 0; a < tokens * top_k; ++a) order[fill[idp[a]]++] = a;
  }
  const int64_t assigned = tokens * top_k;
  std::vector<const at::BFloat16*> x_rows(assigned);
  for (int64_t a = 0; a < assigned; ++a) x_rows[a] = xp + (order[a] / top_k) * hidden;
  std::vector<at::BFloat16> act(assigned * inter);
  std::vector<float> expert_out(assigned * hidden);
  constexpr int64_t kBlock = 16;  // output columns per work item
  const int64_t inter_blocks = (inter + kBlock - 1) / kBlock, hidden_blocks = (hidden + kBlock - 1) / kBlock;
  const int64_t grain_up = std::max<int64_t>(1, kParallelWork / (std::max<int64_t>(1, assigned / experts) * 2 * kBlock * hidden));
  at::parallel_for(0, experts * inter_blocks, grain_up, [&](int64_t begin, int64_t end) {
    std::vector<const at::BFloat16*> w_rows(2 * kBlock);
    std::vector<float> gate_up;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = item / inter_blocks, j0 = (item % inter_blocks) * kBlock, nj = std::min(kBlock, inter - j0);
      const int64_t first = offsets[e], rows = offsets[e + 1] - first;
      if (rows == 0) continue;
      for (int64_t j = 0; j < nj; ++j) {
        w_rows[j] = w13p + (e * 2 * inter + j0 + j) * hidden;
        w_rows[nj + j] = w13p + (e * 2 * inter + inter + j0 + j) * hidden;
      }
      gate_up.resize(rows * 2 * nj);
      dot_bf16_all(x_rows.data() + first, rows, w_rows.data(), 2 * nj, hidden, gate_up.data(), 2 * nj);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < nj; ++j) {
          const float gate = static_cast<float>(at::BFloat16(gate_up[r * 2 * nj + j]));
          const float up = static_cast<float>(at::BFloat16(gate_up[r * 2 * nj + nj + j]));
          const float silu = static_cast<float>(at::BFloat16(gate / (1.0f + std::exp(-gate))));
          act[(first + r) * inter + j0 + j] = at::BFloat16(silu * up);
        }
      }
    }
  });
  std::vector<const at::BFloat16*> act_rows(assigned);
  for (int64_t a = 0; a < assigned; ++a) act_rows[a] = act.data() + a * inter;
  const int64_t grain_down = std::max<int64_t>(1, kParallelWork / (std::max<int64_t>(1, assigned / experts) * kBlock * inter));
  at::parallel_for(0, experts * hidden_blocks, grain_down, [&](int64_t begin, int64_t end) {
    std::vector<const at::BFloat16*> w_rows(kBlock);
    std::vector<float> block_out;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = item / hidden_blocks, d0 = (item % hidden_blocks) * kBlock, nd = std::min(kBlock, hidden - d0);
      const int64_t first = offsets[e], rows = offsets[e + 1] - first;
      if (rows == 0) continue;
      for (int64_t d = 0; d < nd; ++d) w_rows[d] = w2p + (e * hidden + d0 + d) * inter;
      block_out.resize(rows * nd);
      dot_bf16_all(act_rows.data() + first, rows, w_rows.data(), nd, inter, block_out.data(), nd);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < nd; ++d) expert_out[(first + r) * hidden + d0 + d] = static_cast<float>(at::BFloat16(block_out[r * nd + d]));
      }
    }
  });
  // position of each assignment in the grouped order
  std::vector<int64_t> slot_of(assigned);
  for (int64_t a = 0; a < assigned; ++a) slot_of[order[a]] = a;
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  std::vector<float> acc(hidden);
  std::vector<int64_t> by_id(top_k);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) by_id[k] = k;
    std::sort(by_id.begin(), by_id.end(), [&](int64_t a, int64_t b) { return idp[t * top_k + a] < idp[t * top_k + b]; });
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k : by_id) {
      const float w = static_cast<float>(at::BFloat16(wp[t * top_k + k]));
      axpy(acc.data(), w, expert_out.data() + slot_of[t * top_k + k] * hidden, hidden);
    }
    for (int64_t d = 0; d < hidden; ++d) op[t * hidden + d] = at::BFloat16(acc[d]);
  }
  return out;
#else
  return x;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglet_info, m) { m.def("bf16_experts_supported", bf16_experts_supported); }

TORCH_LIBRARY(eaglet, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("noaux_route(Tensor x, Tensor weight, Tensor bias, int top_k, int n_group, int topk_group, bool norm_topk_prob, float scaling) -> (Tensor, Tensor)");
  m.def("moe_routed_experts(Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids) -> Tensor");
  m.def("mla_absorbed_attention(Tensor q_nope, Tensor q_pe, Tensor kv, Tensor w_uk, Tensor w_uv_t, Tensor slots, Tensor kv_lens, Tensor token_starts, Tensor? custom_mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eaglet, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("noaux_route", noaux_route);
  m.impl("mla_absorbed_attention", mla_absorbed_attention);
  m.impl("moe_routed_experts", moe_routed_experts);
}
