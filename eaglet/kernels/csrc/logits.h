// Reading rows of logits: torch's argmax of a row, and running a kernel on bfloat16 or float32
// logits (sampling.cpp, spec_verify.cpp).
#pragma once

#include "common.h"
#include "vec.h"

namespace eaglet {

// argmax of a row as torch computes it: the first index of the maximum, a NaN counting as larger
// than any number (so the first NaN wins). One pass for the maximum and whether a NaN occurs, a
// second that stops at the first element equal to it (or at the first NaN).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan_lanes = 0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = load16(x + i, m);
    nan_lanes |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    best = _mm512_mask_max_ps(best, m, best, v);
  }
  const bool has_nan = nan_lanes != 0;
  const __m512 target = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = load16(x + i, m);
    const __mmask16 hit = has_nan ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q) : _mm512_mask_cmp_ps_mask(m, v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;
#else
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = to_float(x[i]), b = to_float(x[best]);
    if (std::isnan(b)) break;
    if (std::isnan(v) || v > b) best = i;
  }
  return best;
#endif
}

// Runs run(const T*) on the data of bfloat16 or float32 logits.
template <typename Run>
void with_logits(const at::Tensor& x, const char* op, const Run& run) {
  if (x.scalar_type() == at::kBFloat16) {
    run(x.data_ptr<at::BFloat16>());
    return;
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": bfloat16 or float32 logits");
  run(x.data_ptr<float>());
}

}  // namespace eaglet
