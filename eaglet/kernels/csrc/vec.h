// Vector helpers of the kernels: 16-lane float32 loads of float32 and bfloat16 rows with masked
// tails, dot products, exponentials and bfloat16 rounding. Each helper has its AVX-512 body and a
// portable body (under #else), the dot products and axpy an AVX2 body as well (the AVX-512 one's
// 16 lanes as two vectors of 8, the same operations); each sums a row in an order fixed by its
// length alone.
#pragma once

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace eaglet {

constexpr int kLanes = 16;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
// 16 bfloat16 values (as bits) widened to float32, exactly.
inline __m512 widen_bf16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
inline __mmask16 tail_mask(int64_t left) { return left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }
#elif defined(__AVX2__) && defined(__FMA__)
#define EAGLET_VEC_AVX2 1
// The float32 values of p[0:8], zero past `left` (AVX2 has no masked 16-bit loads: a tail goes
// through a zeroed buffer).
inline __m256 load8(const float* p, int64_t left) {
  if (left >= 8) return _mm256_loadu_ps(p);
  alignas(32) float tail[8] = {};
  for (int64_t i = 0; i < left; ++i) tail[i] = p[i];
  return _mm256_load_ps(tail);
}
inline __m256 load8(const at::BFloat16* p, int64_t left) {
  if (left >= 8) {
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
  }
  alignas(32) float tail[8] = {};
  for (int64_t i = 0; i < left; ++i) tail[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(tail);
}
// Lanes < left of 8, as a maskstore mask.
inline __m256i store_mask(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(left, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// The sum of 16 lanes (lo: 0-7, hi: 8-15) in _mm512_reduce_add_ps's order: halves, quarters, pairs.
inline float reduce_add16(__m256 lo, __m256 hi) {
  const __m256 eight = _mm256_add_ps(hi, lo);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, _MM_SHUFFLE(1, 1, 1, 1)));
}
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
#elif defined(EAGLET_VEC_AVX2)
  __m256 lo[NR], hi[NR];
  for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m256 k_lo = load8(key + i, n - i), k_hi = load8(key + i + 8, n - i - 8);
    for (int r = 0; r < NR; ++r) {
      lo[r] = _mm256_fmadd_ps(load8(rows[r] + i, n - i), k_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(load8(rows[r] + i + 8, n - i - 8), k_hi, hi[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = reduce_add16(lo[r], hi[r]);
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
#elif defined(EAGLET_VEC_AVX2)
  const __m256 a = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_fmadd_ps(a, load8(x + i, n - i), load8(out + i, n - i));
    if (n - i >= 8) {
      _mm256_storeu_ps(out + i, v);
    } else {
      _mm256_maskstore_ps(out + i, store_mask(n - i), v);
    }
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

#if defined(__AVX512F__)
// exp_approx for 16 lanes.
inline __m512 exp16(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(normal, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}
#endif

// x[i] = exp_approx(x[i] - shift) for a row.
inline void exp_shifted_row(float* x, float shift, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_set1_ps(shift))));
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] = exp_approx(x[i] - shift);
#endif
}

// dst[i] = bfloat16(src[i] (+ bias[i])), rounding to nearest even.
inline void store_bf16(at::BFloat16* dst, const float* src, const at::BFloat16* bias, int64_t n) {
#if defined(__AVX512BF16__)
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = _mm512_maskz_loadu_ps(m, src + i);
    if (bias) v = _mm512_add_ps(v, load16(bias + i, m));
    _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(bias ? src[i] + static_cast<float>(bias[i]) : src[i]);
#endif
}

#if defined(__AVX512BF16__)
// The float32 value of bfloat16(v), rounding to nearest even as at::BFloat16(float) does.
inline __m512 round_bf16(__m512 v) { return widen_bf16((__m256i)_mm512_cvtneps_pbh(v)); }

inline void store16_bf16(at::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
#endif

// dst[i] = float(bfloat16(src[i] (+ bias[i]))): store_bf16's values widened, as .float() of a
// bfloat16 GEMM's output gives them, without the bfloat16 tensor in between.
inline void store_bf16_widened(float* dst, const float* src, const at::BFloat16* bias, int64_t n) {
#if defined(__AVX512BF16__)
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = _mm512_maskz_loadu_ps(m, src + i);
    if (bias) v = _mm512_add_ps(v, load16(bias + i, m));
    _mm512_mask_storeu_ps(dst + i, m, round_bf16(v));
  }
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(at::BFloat16(bias ? src[i] + static_cast<float>(bias[i]) : src[i]));
#endif
}

}  // namespace eaglet
