// Rotary embeddings of MLA's query and key (rope_query_key).
#include "ops.h"
#include "vec.h"

#include <type_traits>

namespace eaglet {

namespace {

// RotaryEmbedding.forward on MLA's per-head q_pe [T, H, R] and shared k_pe [T, R] in one call,
// with the same roundings: x1 * cos, x2 * sin and their difference each rounded to x's dtype.
// interleave: pairs (x0, x1), (x2, x3), ... rotate, and the output is [rotated evens | rotated odds].
template <typename T>
void rope_row(const T* x, int64_t stride, const T* cos, const T* sin, int64_t half, bool interleave, T* out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // the loop below, 16 pairs at a time
    if (stride == 1) {
      // evens of 32 values to the low 16 lanes, odds to the high 16
      const __m512i deinterleave = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                                    30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
      for (int64_t i = 0; i < half; i += kLanes) {
        const __mmask16 m = tail_mask(half - i);
        __m512 x1, x2;
        if (interleave) {
          const __mmask32 m2 = half - i >= kLanes ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << (2 * (half - i))) - 1);
          const __m512i both = _mm512_permutexvar_epi16(deinterleave, _mm512_maskz_loadu_epi16(m2, x + 2 * i));
          x1 = widen_bf16(_mm512_castsi512_si256(both));
          x2 = widen_bf16(_mm512_extracti64x4_epi64(both, 1));
        } else {
          x1 = load16(x + i, m);
          x2 = load16(x + half + i, m);
        }
        const __m512 c = load16(cos + i, m), s = load16(sin + i, m);
        const __m512 a = round_bf16(_mm512_mul_ps(x1, c)), b = round_bf16(_mm512_mul_ps(x2, s));
        const __m512 d = round_bf16(_mm512_mul_ps(x2, c)), e = round_bf16(_mm512_mul_ps(x1, s));
        store16_bf16(out + i, _mm512_sub_ps(a, b), m);
        store16_bf16(out + half + i, _mm512_add_ps(d, e), m);
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[(interleave ? 2 * i : i) * stride]);
    const float x2 = to_float(x[(interleave ? 2 * i + 1 : i + half) * stride]);
    const float c = to_float(cos[i]), s = to_float(sin[i]);
    const float a = to_float(from_float<T>(x1 * c)), b = to_float(from_float<T>(x2 * s));
    const float d = to_float(from_float<T>(x2 * c)), e = to_float(from_float<T>(x1 * s));
    out[i] = from_float<T>(a - b);
    out[half + i] = from_float<T>(d + e);
  }
}

template <typename T>
void rope_impl(const at::Tensor& q_pe, const at::Tensor& k_pe, const at::Tensor& cos, const at::Tensor& sin, bool interleave,
               at::Tensor& q_out, at::Tensor& k_out) {
  const int64_t tokens = q_pe.size(0), heads = q_pe.size(1), dim = q_pe.size(2), half = dim / 2;
  const T* qp = q_pe.data_ptr<T>();
  const T* kp = k_pe.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  T* ko = k_out.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cp + t * cos.stride(0);
    const T* s = sp + t * sin.stride(0);
    for (int64_t h = 0; h < heads; ++h) {
      rope_row(qp + t * q_pe.stride(0) + h * q_pe.stride(1), q_pe.stride(2), c, s, half, interleave, qo + (t * heads + h) * dim);
    }
    rope_row(kp + t * k_pe.stride(0), k_pe.stride(1), c, s, half, interleave, ko + t * dim);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope_query_key(const at::Tensor& q_pe, const at::Tensor& k_pe, const at::Tensor& cos,
                                                  const at::Tensor& sin, bool interleave) {
  TORCH_CHECK(q_pe.dim() == 3 && k_pe.dim() == 2 && k_pe.size(0) == q_pe.size(0) && k_pe.size(1) == q_pe.size(2) &&
                  q_pe.size(2) % 2 == 0,
              "rope_query_key: q_pe [T, H, R], k_pe [T, R], R even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == q_pe.size(0) && cos.size(1) == q_pe.size(2) / 2 &&
                  cos.stride(1) == 1 && sin.stride(1) == 1,
              "rope_query_key: cos / sin [T, R / 2]");
  TORCH_CHECK(q_pe.scalar_type() == k_pe.scalar_type() && cos.scalar_type() == q_pe.scalar_type() && sin.scalar_type() == q_pe.scalar_type(),
              "rope_query_key: q_pe, k_pe, cos and sin in one dtype");
  at::Tensor q_out = at::empty(q_pe.sizes(), q_pe.options()), k_out = at::empty(k_pe.sizes(), k_pe.options());
  if (q_pe.scalar_type() == at::kBFloat16) {
    rope_impl<at::BFloat16>(q_pe, k_pe, cos, sin, interleave, q_out, k_out);
  } else {
    TORCH_CHECK(q_pe.scalar_type() == at::kFloat, "rope_query_key: bfloat16 or float32");
    rope_impl<float>(q_pe, k_pe, cos, sin, interleave, q_out, k_out);
  }
  return {q_out, k_out};
}

}  // namespace eaglet
