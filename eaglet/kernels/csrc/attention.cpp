// Absorbed MLA attention over the paged latent cache (mla_absorbed_attention): per head the query's
// latent q_nope W_UK, scores against each request's cached [c_kv | k_pe] rows, softmax, the
// probabilities' sum of c_kv, then W_UV. With tile copies of W_UK / W_UV (bfloat16 models) the
// products run on the tile-layout GEMM (attention_tiles.cpp), else on float32 vector loops.
#include "attention_tiles.h"
#include "gemm.h"
#include "ops.h"
#include "vec.h"

#include <type_traits>

namespace eaglet {

namespace {

// Cache rows are read in slot order, which the hardware prefetcher cannot follow across pages.
constexpr int64_t kPrefetchKeys = 4;
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

// p[s] = raw[s] * scale where visible[s] (visible == nullptr: every s), -inf elsewhere, for s < n;
// returns the largest p[s] (-inf for n = 0 or nothing visible). A maximum is exact in any order.
inline float scale_mask_max(float* p, const float* raw, const bool* visible, int64_t n, float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512 scale_v = _mm512_set1_ps(scale), neg_inf_v = _mm512_set1_ps(neg_inf);
  __m512 best = neg_inf_v;
  for (int64_t s = 0; s < n; s += kLanes) {
    const __mmask16 m = tail_mask(n - s);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, raw + s), scale_v);
    if (visible) {
      const __m128i bytes = _mm_maskz_loadu_epi8(m, visible + s);
      v = _mm512_mask_blend_ps(_mm_test_epi8_mask(bytes, bytes), neg_inf_v, v);
    }
    _mm512_mask_storeu_ps(p + s, m, v);
    best = _mm512_mask_max_ps(best, m, best, v);
  }
  return _mm512_reduce_max_ps(best);
#else
  float best = neg_inf;
  for (int64_t s = 0; s < n; ++s) {
    p[s] = !visible || visible[s] ? raw[s] * scale : neg_inf;
    best = std::max(best, p[s]);
  }
  return best;
#endif
}

// out[r][0:n] = sum over j of coef[r][j] * terms[j][0:n], for NR rows at once: the sum runs over
// j in order with one fused multiply-add per term (AVX-512 or AVX2; a multiply and an add
// portably), so a row's result does not depend on NR.
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
#elif defined(EAGLET_VEC_AVX2)
  constexpr int kChunk = 8 / NR, kWidth = 8;  // vectors of 8 per row held in registers: 8 accumulators
  for (int64_t c0 = 0; c0 < n; c0 += kChunk * kWidth) {
    const int vectors = static_cast<int>(std::min<int64_t>(kChunk, (n - c0 + kWidth - 1) / kWidth));
    __m256 acc[NR][kChunk];
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < kChunk; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t j = 0; j < num_terms; ++j) {
      const B* term = terms[j] + c0;
      __m256 a[NR];
      for (int r = 0; r < NR; ++r) a[r] = _mm256_set1_ps(to_float(coef[r][j]));
      for (int v = 0; v < vectors; ++v) {
        const __m256 t = load8(term + v * kWidth, n - c0 - v * kWidth);
        for (int r = 0; r < NR; ++r) acc[r][v] = _mm256_fmadd_ps(a[r], t, acc[r][v]);
      }
    }
    for (int v = 0; v < vectors; ++v) {
      const int64_t left = n - c0 - v * kWidth;
      for (int r = 0; r < NR; ++r) {
        if (left >= kWidth) {
          _mm256_storeu_ps(out[r] + c0 + v * kWidth, acc[r][v]);
        } else {
          _mm256_maskstore_ps(out[r] + c0 + v * kWidth, store_mask(left), acc[r][v]);
        }
      }
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
              const c10::optional<at::Tensor>& uk_packed, const c10::optional<at::Tensor>& uv_packed, at::Tensor& out) {
  const int64_t tokens = q_nope.size(0), heads = q_nope.size(1), nope = q_nope.size(2);
  const int64_t requests = kv_lens.size(0), rope = q_pe.size(2), latent = w_uk.size(2), value = w_uv_t.size(2);
  const int64_t qdim = latent + rope, q_stride = q_nope.stride(1);  // row (t, h) of q_nope at (t * heads + h) * q_stride
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

  // Scratch of this thread, kept between calls: every element is written before it is read, and
  // fresh megabyte vectors would cost their zeroing and page faults on every call.
  // (References, so that the worker threads' lambdas reach the caller's buffers.)
  thread_local std::vector<float> query_buffer, o_latent_buffer, o_value_buffer;
  std::vector<float>& query = query_buffer;
  std::vector<float>& o_latent = o_latent_buffer;
  std::vector<float>& o_value = o_value_buffer;
  // With tile copies of W_UK^T / W_UV per head (bfloat16 models), passes 1 and 3 run on tiles; their
  // bfloat16 weights are the checkpoint's kv_b_proj values exactly, and pass 3 rounds o to bfloat16
  // first, as the decompressed form's probs @ V does.
  const bool amx_projections = uk_packed.has_value() && uv_packed.has_value();
  // Row strides of the scratch: on tiles a query row is whole k blocks (zero past qdim) and an
  // output row whole 16-column blocks.
  const int64_t qstride = amx_projections ? (qdim + kTileK - 1) / kTileK * kTileK : qdim;
  const int64_t vstride = amx_projections ? (value + kTileN - 1) / kTileN * kTileN : value;
  query.resize(tokens * heads * qstride);
  o_latent.resize(tokens * heads * latent);
  o_value.resize(tokens * heads * vstride);
  const bool parallel_heads = tokens * (nope + value) * latent * heads >= kParallelWork;
  // Per head h on tiles: rows (t, h) of out (row width out_width, n used) = x(t, h) @ packed[h]^T,
  // x(t, h) being what fill_row(t, h, row) writes into a zeroed row of k_blocks * 32 bfloat16.
  // after_head(h) runs once head h's rows are all written, on the same thread.
  auto amx_per_head = [&](const at::Tensor& packed, int64_t n, float* out, int64_t out_width, auto fill_row, auto after_head) {
    const int64_t kb = packed.size(2), kp = kb * kTileK, head_stride = packed.stride(0);
    const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
    at::parallel_for(0, heads, parallel_heads ? 1 : heads, [&](int64_t begin, int64_t end) {
      configure_tiles();
      // Zeroed once: each head's fill_row rewrites the same values of the real rows.
      thread_local std::vector<at::BFloat16> x_pad;
      assign_zeros(x_pad, (tokens + kTileRows - 1) / kTileRows * kTileRows * kp);
      for (int64_t h = begin; h < end; ++h) {
        for (int64_t t = 0; t < tokens; ++t) fill_row(t, h, x_pad.data() + t * kp);
        for (int64_t g = 0; g * kGroupN < n; ++g) {
          const int64_t n_blocks = std::min<int64_t>(4, (n - g * kGroupN + kTileN - 1) / kTileN);
          amx_group(x_pad.data(), tokens, kp, wp + h * head_stride + g * 4 * kb * kTileK * kTileN, kb,
                    out + h * out_width + g * kGroupN, heads * out_width, n_blocks);
        }
        after_head(h);
      }
      release_tiles();
    });
  };
  if (amx_projections) {
    amx_per_head(*uk_packed, latent, query.data(), qstride, [&](int64_t t, int64_t h, at::BFloat16* row) {
      const Q* src = qn + (t * heads + h) * q_stride;
      for (int64_t p = 0; p < nope; ++p) row[p] = at::BFloat16(to_float(src[p]));
    }, [&](int64_t h) {
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t i = t * heads + h;
        load_row(query.data() + i * qstride + latent, qp + i * rope, rope);
        std::fill(query.data() + i * qstride + qdim, query.data() + (i + 1) * qstride, 0.0f);
      }
    });
  } else {
  at::parallel_for(0, heads, parallel_heads ? 1 : heads, [&](int64_t begin, int64_t end) {
    std::vector<float*> out_rows(tokens);
    std::vector<const Q*> coef(tokens);
    std::vector<const float*> terms(nope);
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        out_rows[t] = query.data() + (t * heads + h) * qstride;
        coef[t] = qn + (t * heads + h) * q_stride;
        load_row(out_rows[t] + latent, qp + (t * heads + h) * rope, rope);
      }
      for (int64_t p = 0; p < nope; ++p) terms[p] = wuk + (h * nope + p) * latent;
      combine_all_rows(out_rows.data(), coef.data(), terms.data(), tokens, nope, latent);
    }
  });
  }

  // Pass 2 work items: requests, each split into head groups when there are fewer requests than threads.
  const int64_t groups = std::min<int64_t>(heads, std::max<int64_t>(1, (at::get_num_threads() + requests - 1) / requests));
  const int64_t group_heads = (heads + groups - 1) / groups;
  int64_t total_keys = 0;
  for (int64_t b = 0; b < requests; ++b) total_keys += lens[b] * (starts[b + 1] - starts[b]);
  const bool parallel_requests = total_keys * heads * 2 * qdim >= kParallelWork;
  // With the tile projections and a bfloat16 cache, q @ k^T and p @ c_kv run on tiles too, from
  // queries and probabilities rounded to bfloat16 (as the decompressed form's matmuls take them).
  const bool amx_attention = amx_projections && std::is_same_v<KV, at::BFloat16>;
  at::parallel_for(0, requests * groups, parallel_requests ? 1 : requests * groups, [&](int64_t begin, int64_t end) {
    if (amx_attention) configure_tiles();
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
          rows[r] = query.data() + ((first + i) * heads + h) * qstride;
          out_rows[r] = o_latent.data() + ((first + i) * heads + h) * latent;
          prob_rows[r] = scores.data() + r * keys;
        }
      }
#if defined(EAGLET_TILES)  // without it there are no tile copies, and amx_attention is false
      if constexpr (std::is_same_v<KV, at::BFloat16>) {
        if (amx_attention) amx_key_scores(rows.data(), num_rows, keys_of.data(), keys, qdim, qstride, row_scores.data());
      }
#endif
      // Rows in blocks of eight against every key: a block's queries stay in L1 while keys stream.
      for (int64_t r0 = 0; !amx_attention && r0 < num_rows; r0 += 8) {
        const int64_t block = std::min<int64_t>(8, num_rows - r0);
        for (int64_t s = 0; s < keys; ++s) {
          if (r0 == 0 && s + kPrefetchKeys < keys) prefetch_row(keys_of[s + kPrefetchKeys], qdim * sizeof(KV));
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
        const float scale_f = static_cast<float>(scale);
        // Causal: row index i sees keys < keys - n + i + 1, and p past them stays -inf.
        const bool* visible = mask ? mask + (first + i) * mask_stride : nullptr;
        const float max_score = scale_mask_max(p, raw, visible, mask ? keys : keys - n + i + 1, scale_f);
        if (max_score == neg_inf) {  // sees no key: zeros, as a fully masked softmax row is not defined
          std::fill(p, p + keys, 0.0f);
          continue;
        }
        exp_shifted_row(p, max_score, keys);
      }
      // One running sum per row in key order: keys a token does not see add exact zeros, so a tree
      // node sums its path's keys as plain decoding sums the same keys laid out one after another.
      // Eight rows' sums advance together, eight independent chains.
      for (int64_t r0 = 0; r0 < num_rows; r0 += 8) {
        const int64_t block = std::min<int64_t>(8, num_rows - r0);
        float totals[8] = {};
        float* p0 = scores.data() + r0 * keys;
        for (int64_t s = 0; s < keys; ++s) {
          for (int64_t j = 0; j < block; ++j) totals[j] += p0[j * keys + s];
        }
        for (int64_t j = 0; j < block; ++j) {
          if (totals[j] == 0.0f) continue;  // a row that sees no key: its zeros stay
          const float inv_total = 1.0f / totals[j];
          for (int64_t s = 0; s < keys; ++s) p0[j * keys + s] *= inv_total;
        }
      }
#if defined(EAGLET_TILES)
      if constexpr (std::is_same_v<KV, at::BFloat16>) {
        if (amx_attention) amx_value_sums(scores.data(), num_rows, keys_of.data(), keys, latent, out_rows.data());
      }
#endif  // EAGLET_TILES
      if (!amx_attention) combine_all_rows(out_rows.data(), prob_rows.data(), keys_of.data(), num_rows, keys, latent);
    }
    if (amx_attention) release_tiles();
  });

  if (amx_projections) {
    amx_per_head(*uv_packed, value, o_value.data(), vstride, [&](int64_t t, int64_t h, at::BFloat16* row) {
      store_bf16(row, o_latent.data() + (t * heads + h) * latent, nullptr, latent);
    }, [&](int64_t h) {
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t i = t * heads + h;
        for (int64_t v = 0; v < value; ++v) op[i * value + v] = from_float<Q>(o_value[i * vstride + v]);
      }
    });
  } else {
  at::parallel_for(0, heads, parallel_heads ? 1 : heads, [&](int64_t begin, int64_t end) {
    std::vector<float*> out_rows(tokens);
    std::vector<const float*> coef(tokens), terms(latent);
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        out_rows[t] = o_value.data() + (t * heads + h) * vstride;
        coef[t] = o_latent.data() + (t * heads + h) * latent;
      }
      for (int64_t l = 0; l < latent; ++l) terms[l] = wuv + (h * latent + l) * value;
      combine_all_rows(out_rows.data(), coef.data(), terms.data(), tokens, latent, value);
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t i = t * heads + h;
        for (int64_t v = 0; v < value; ++v) op[i * value + v] = from_float<Q>(o_value[i * vstride + v]);
      }
    }
  });
  }
}

}  // namespace

at::Tensor mla_absorbed_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv,
                                  const AbsorbedLayer& layer, const AttentionMetadata& metadata) {
  const at::Tensor &w_uk = layer.w_uk, &w_uv_t = layer.w_uv_t;
  const c10::optional<at::Tensor> &w_uk_packed = layer.w_uk_packed, &w_uv_packed = layer.w_uv_packed;
  const at::Tensor &slots = metadata.slots, &kv_lens = metadata.kv_lens, &token_starts = metadata.token_starts;
  const c10::optional<at::Tensor>& custom_mask = metadata.custom_mask;
  const double scale = layer.scale;
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
  // q_nope may be a slice of the query projection: rows (t, h) a fixed stride apart, read in place.
  const bool q_rows = q_nope.stride(2) == 1 && q_nope.stride(0) == q_nope.size(1) * q_nope.stride(1);
  const at::Tensor qn = q_rows ? q_nope : q_nope.contiguous();
  const at::Tensor qp = q_pe.contiguous(), wuk = w_uk.contiguous(), wuv = w_uv_t.contiguous();
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
  c10::optional<at::Tensor> uk, uv;
  if (w_uk_packed.has_value() != w_uv_packed.has_value()) TORCH_CHECK(false, "mla_absorbed_attention: both tile copies or neither");
  if (w_uk_packed) {
    const int64_t heads = q_nope.size(1), nope = q_nope.size(2), latent = w_uk.size(2), value = w_uv_t.size(2);
    TORCH_CHECK(tile_kernels_supported() && q_bf16,
                "mla_absorbed_attention: tile-layout projections need the tile GEMM and bfloat16 queries");
    TORCH_CHECK(latent % kTileN == 0, "mla_absorbed_attention: tile projections need L a multiple of 16");
    TORCH_CHECK(w_uk_packed->dim() == 6 && w_uk_packed->size(0) == heads && w_uv_packed->dim() == 6 && w_uv_packed->size(0) == heads &&
                    w_uk_packed->is_contiguous() && w_uv_packed->is_contiguous(),
                "mla_absorbed_attention: tile copies are [H, ...] stacks of amx_pack_weight");
    check_packed((*w_uk_packed)[0], nope, latent, "mla_absorbed_attention W_UK^T");
    check_packed((*w_uv_packed)[0], latent, value, "mla_absorbed_attention W_UV");
    uk = w_uk_packed;
    uv = w_uv_packed;
  }
  if (q_bf16 && kv_bf16) {
    mla_impl<at::BFloat16, at::BFloat16>(qn, qp, kv, wuk, wuv, sl, lens, starts, mask, scale, uk, uv, out);
  } else if (q_bf16) {
    mla_impl<at::BFloat16, float>(qn, qp, kv, wuk, wuv, sl, lens, starts, mask, scale, uk, uv, out);
  } else if (kv_bf16) {
    mla_impl<float, at::BFloat16>(qn, qp, kv, wuk, wuv, sl, lens, starts, mask, scale, uk, uv, out);
  } else {
    mla_impl<float, float>(qn, qp, kv, wuk, wuv, sl, lens, starts, mask, scale, uk, uv, out);
  }
  return out;
}

}  // namespace eaglet
