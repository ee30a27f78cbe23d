// Fused CPU kernels for the decode path: RMSNorm, rotary, DeepSeek-V3 routing, the latent cache
// write and absorbed MLA attention over the paged cache; bfloat16 GEMMs, SwiGLU and the routed
// experts on weights in AMX tile layout, multiplied on AMX tiles or, on CPUs without AMX, with
// AVX512-BF16 dot products (tile_backend()). Each replaces a chain of small PyTorch ops whose
// per-op dispatch (not arithmetic) dominates a decode step of a small model.
//
// Every kernel computes a row (a token, or a token's head) with the same arithmetic whatever else
// is in the batch: loops over a row's elements run in a fixed order with fixed-width partial sums,
// and no work is split inside a row. So a token's result does not depend on how many tokens share
// the call, which is what lossless greedy speculation needs (a verify pass must reproduce decoding).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int kLanes = 16;
// AMX tile geometry: 16 rows x 32 bfloat16 of k per A tile, 16 output columns per B tile, and
// the 4 accumulator tiles of one pass cover a group of 64 output columns.
constexpr int64_t kTileRows = 16, kTileK = 32, kTileN = 16, kGroupN = 4 * kTileN;

bool tile_kernels_supported();
void check_packed(const at::Tensor& packed, int64_t k, int64_t n, const char* what);
void configure_tiles();
void release_tiles();
void amx_group(const at::BFloat16* x_pad, int64_t m, int64_t kp, const at::BFloat16* w_group, int64_t k_blocks,
               float* out, int64_t out_stride, int64_t n_blocks = 4);
void amx_blocks_by_group(const at::BFloat16* const* a, const int64_t* a_rows, int64_t num_a, int64_t lda,
                         const at::BFloat16* b_block, int64_t k_blocks, float* out);
void amx_key_scores(const float* const* rows, int64_t num_rows, const at::BFloat16* const* keys_of, int64_t keys,
                    int64_t qdim, int64_t kp, float* row_scores);
void amx_value_sums(const float* probs, int64_t num_rows, const at::BFloat16* const* keys_of, int64_t keys,
                    int64_t latent, float* const* out_rows);

// v = n zero bfloat16 values, by memset (vector::assign fills BFloat16 element by element, several
// times slower, which shows in a decode step's small buffers).
inline void assign_zeros(std::vector<at::BFloat16>& v, int64_t n) {
  v.resize(n);
  std::memset(v.data(), 0, n * sizeof(at::BFloat16));
}

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

// Cache rows are read in slot order, which the hardware prefetcher cannot follow across pages.
constexpr int64_t kPrefetchKeys = 4;
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
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

// The largest of x[0:n] (-inf for n = 0).
inline float row_max(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  if (n >= kLanes) {
    __m512 acc = _mm512_set1_ps(best);
    for (int64_t i = 0; i < n; i += kLanes) acc = _mm512_max_ps(acc, _mm512_mask_loadu_ps(acc, tail_mask(n - i), x + i));
    return _mm512_reduce_max_ps(acc);
  }
#endif
  for (int64_t i = 0; i < n; ++i) best = std::max(best, x[i]);
  return best;
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

// Below this many multiply-adds a kernel runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelWork = 1 << 15;

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t dim = x.size(-1);
  const int64_t rows = x.numel() / dim;
  const int64_t row_stride = x.dim() == 2 ? x.stride(0) : dim;  // rows of a 2-d x may be apart (a narrow)
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kParallelWork / dim);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    const float* row_ptr = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * row_stride;
      T* orow = op + r * dim;
      load_row(row.data(), xr, dim);
      float sum_square;
      dot_rows<1>(&row_ptr, row.data(), dim, &sum_square);
      const float mean_square = sum_square / static_cast<float>(dim);
      const float inv_rms = 1.0f / std::sqrt(mean_square + static_cast<float>(eps));
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {  // the loop below, 16 lanes at a time
        const __m512 inv = _mm512_set1_ps(inv_rms);
        for (int64_t i = 0; i < dim; i += kLanes) {
          const __mmask16 m = tail_mask(dim - i);
          const __m512 normed = round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row.data() + i), inv));
          store16_bf16(orow + i, _mm512_mul_ps(load16(wp + i, m), normed), m);
        }
        continue;
      }
#endif
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
  // A 2-d x whose rows are contiguous is read in place (the stack normalises column slices).
  const at::Tensor xc = x.dim() == 2 && x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  if (xc.scalar_type() == at::kBFloat16) {
    rms_norm_impl<at::BFloat16>(xc, wc, eps, out);
  } else {
    TORCH_CHECK(xc.scalar_type() == at::kFloat, "rms_norm: bfloat16 or float32 input");
    rms_norm_impl<float>(xc, wc, eps, out);
  }
  return out;
}

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

// The contiguous int64 offsets, one per column (an EAGLE-3 draft's d2t), or an undefined tensor.
at::Tensor column_offsets(const c10::optional<at::Tensor>& offsets, int64_t columns, const char* op) {
  if (!offsets.has_value()) return at::Tensor();
  TORCH_CHECK(offsets->dim() == 1 && offsets->size(0) == columns && offsets->scalar_type() == at::kLong, op,
              ": int64 offsets, one per column");
  return offsets->contiguous();
}

// The argmax i of each row, or i + offsets[i] with ``offsets`` (an EAGLE-3 draft's d2t: draft ids to target ids).
at::Tensor argmax_last_dim(const at::Tensor& logits, const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, "argmax_last_dim: a non-empty last dimension");
  const at::Tensor x = logits.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  const at::Tensor offsets_c = column_offsets(offsets, n, "argmax_last_dim");
  const int64_t* offp = offsets_c.defined() ? offsets_c.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (kParallelWork * 8) / n);
  const auto run = [&](const auto* xp) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t i = argmax_row(xp + r * n, n);
        op[r] = offp ? i + offp[i] : i;
      }
    });
  };
  with_logits(x, "argmax_last_dim", run);
  return out;
}

// The k largest log-probabilities (log_softmax) of each row of [R, V] logits, largest first and the
// lower index first among equal values: float32 values and int64 ids, i + offsets[i] with
// ``offsets`` (an EAGLE-3 draft's d2t). One pass keeps the top k, one sums the exponentials.
std::vector<at::Tensor> topk_logprobs(const at::Tensor& logits, int64_t k, const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && k >= 1 && k <= logits.size(1),
              "topk_logprobs: logits [R, V] and 1 <= k <= V");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  const at::Tensor offsets_c = column_offsets(offsets, vocab, "topk_logprobs");
  const int64_t* offp = offsets_c.defined() ? offsets_c.data_ptr<int64_t>() : nullptr;
  at::Tensor values = at::empty({rows, k}, x.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (kParallelWork * 8) / vocab);
  const auto run = [&](const auto* xp) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(vocab);
      for (int64_t r = begin; r < end; ++r) {
        load_row(row.data(), xp + r * vocab, vocab);
        float* best = vp + r * k;
        int64_t* best_ids = ip + r * k;
        int64_t count = 0;
        const auto offer = [&](int64_t i) {
          const float v = row[i];
          if (count == k && !(v > best[k - 1])) return;
          int64_t at = count < k ? count++ : k - 1;
          for (; at > 0 && v > best[at - 1]; --at) {  // after the equal ones: the lower index stays first
            best[at] = best[at - 1];
            best_ids[at] = best_ids[at - 1];
          }
          best[at] = v;
          best_ids[at] = i;
        };
        int64_t i = 0;
        for (; i < vocab && count < k; ++i) offer(i);
#if defined(__AVX512F__)
        // 16 at a time, offering only the lanes above the current k-th value (few, past the start).
        for (; i < vocab; i += kLanes) {
          const __mmask16 m = tail_mask(vocab - i);
          __mmask16 above = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, row.data() + i), _mm512_set1_ps(best[k - 1]), _CMP_GT_OQ);
          for (; above; above &= above - 1) offer(i + __builtin_ctz(above));
        }
#else
        for (; i < vocab; ++i) offer(i);
#endif
        const float row_max = best[0];
        float sum = 0.0f;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < vocab; i += kLanes) {
          const __mmask16 m = tail_mask(vocab - i);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row.data() + i), _mm512_set1_ps(row_max)));
          acc = _mm512_mask_add_ps(acc, m, acc, e);
        }
        sum = _mm512_reduce_add_ps(acc);
#else
        // kLanes partial sums, as the vector path: one serial sum over a vocabulary loses digits.
        exp_shifted_row(row.data(), row_max, vocab);
        float partial[kLanes] = {0};
        for (int64_t i = 0; i < vocab; ++i) partial[i % kLanes] += row[i];
        for (int j = 0; j < kLanes; ++j) sum += partial[j];
#endif
        const float log_normalizer = row_max + std::log(sum);
        for (int64_t j = 0; j < k; ++j) {
          best[j] -= log_normalizer;
          if (offp) best_ids[j] += offp[best_ids[j]];
        }
      }
    });
  };
  with_logits(x, "topk_logprobs", run);
  return {values, ids};
}

// Greedy verification of trees, chains included (verify.py's _verify_greedy_tree): node j > 0 with parent -1 is
// padding, every other parent is an earlier node that is not padding. The accepted path is the
// deepest one whose every node's token is the target's pick after its parent, the lowest end node
// among equally deep ones; the table's rows are [num_accepted, bonus, path nodes, -1 ...], D + 2
// wide for the deepest tree D of the batch. A node's logits are reduced only if it is on a
// matching path.
// The greedy walk of verify_tree_greedy over [B, N] int64 trees: pick(b, j) is the target's token
// after node j of request b, asked only for nodes on matching paths (a chain's only up to its first
// rejection) and from the thread that walks request b; pick_at keeps each node's answer. Requests
// are split over threads in chunks of ``grain`` (the batch size: all on the calling thread).
template <typename Pick>
at::Tensor greedy_walk(const at::Tensor& tokens, const at::Tensor& parents, const char* op, int64_t grain, const Pick& pick) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.size(1) > 0 && parents.sizes() == tokens.sizes() &&
                  parents.scalar_type() == at::kLong,
              op, ": int64 tokens and parents [B, N] with N >= 1");
  const at::Tensor t = tokens.contiguous(), par = parents.contiguous();
  const int64_t batch = t.size(0), n = t.size(1);
  const int64_t* tp = t.data_ptr<int64_t>();
  const int64_t* pp = par.data_ptr<int64_t>();
  std::vector<int64_t> depth(batch * n, -1);  // -1: padding
  int64_t max_depth = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* row = pp + b * n;
    int64_t* d = depth.data() + b * n;
    TORCH_CHECK(row[0] == -1, op, ": node 0 must be the root (parent -1)");
    d[0] = 0;
    for (int64_t j = 1; j < n; ++j) {
      TORCH_CHECK(row[j] >= -1 && row[j] < j, op, ": every node's parent must be -1 or an earlier node");
      if (row[j] < 0) continue;
      TORCH_CHECK(d[row[j]] >= 0, op, ": a node's parent is a padding node");
      d[j] = d[row[j]] + 1;
      max_depth = std::max(max_depth, d[j]);
    }
  }
  at::Tensor out = at::full({batch, max_depth + 2}, -1, t.options());
  int64_t* op_out = out.data_ptr<int64_t>();
  at::parallel_for(0, batch, std::max<int64_t>(grain, 1), [&](int64_t begin, int64_t end) {
    std::vector<int64_t> picked(n);
    std::vector<char> matched(n);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* row = pp + b * n;
      const int64_t* d = depth.data() + b * n;
      std::fill(picked.begin(), picked.end(), -1);
      const auto pick_at = [&](int64_t node) {
        if (picked[node] < 0) picked[node] = pick(b, node);
        return picked[node];
      };
      matched[0] = 1;
      int64_t best = 0;
      for (int64_t j = 1; j < n; ++j) {
        matched[j] = d[j] >= 0 && matched[row[j]] && tp[b * n + j] == pick_at(row[j]);
        if (matched[j] && d[j] > d[best]) best = j;
      }
      int64_t* out_row = op_out + b * (max_depth + 2);
      out_row[0] = d[best];
      out_row[1] = pick_at(best);
      for (int64_t node = best; node > 0; node = row[node]) out_row[1 + d[node]] = node;
    }
  });
  return out;
}

at::Tensor verify_tree_greedy(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 3 && tokens.dim() == 2 && logits.size(0) == tokens.size(0) && logits.size(1) == tokens.size(1) &&
                  logits.size(2) > 0,
              "verify_tree_greedy: logits [B, N, V] matching the tokens, V >= 1");
  const at::Tensor x = logits.contiguous();
  const int64_t n = tokens.size(1), vocab = x.size(2);
  at::Tensor out;
  with_logits(x, "verify_tree_greedy", [&](const auto* xp) {
    out = greedy_walk(tokens, parents, "verify_tree_greedy", 1,
                      [&](int64_t b, int64_t node) { return argmax_row(xp + (b * n + node) * vocab, vocab); });
  });
  return out;
}

// verify_tree_greedy given the target's greedy token after every node, [B, N] int64 (a fused
// lm_head + argmax's output) instead of its logits.
at::Tensor verify_tree_greedy_ids(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_ids) {
  TORCH_CHECK(target_ids.scalar_type() == at::kLong && target_ids.sizes() == tokens.sizes(),
              "verify_tree_greedy_ids: int64 target_ids [B, N] matching the tokens");
  const at::Tensor ids = target_ids.contiguous();
  const int64_t n = tokens.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  // A few integer compares per request: a thread pool's wake-up would cost more.
  return greedy_walk(tokens, parents, "verify_tree_greedy_ids", tokens.size(0),
                     [&](int64_t b, int64_t node) { return ip[b * n + node]; });
}

// LatentKVPool.copy_slots: every layer's entries of slots src[i] go to slots dst[i] (an accepted
// tree path's nodes moving to their row indices; dst holds distinct slots), as
// kv[:, dst] = kv[:, src]: each layer's sources are read before any is written. Entries already in
// place (src[i] == dst[i]) are skipped.
void copy_cache_slots(at::Tensor kv, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(kv.dim() == 3 && kv.is_contiguous(), "copy_cache_slots: a contiguous cache [layers, slots, dim]");
  TORCH_CHECK(src.dim() == 1 && src.sizes() == dst.sizes() && src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong,
              "copy_cache_slots: int64 src and dst [n]");
  const int64_t layers = kv.size(0), num_slots = kv.size(1), n = src.size(0);
  const at::Tensor src_c = src.contiguous(), dst_c = dst.contiguous();
  const int64_t *sp = src_c.data_ptr<int64_t>(), *dp = dst_c.data_ptr<int64_t>();
  std::vector<int64_t> moves;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots && dp[i] >= 0 && dp[i] < num_slots, "copy_cache_slots: slot ",
                sp[i] < 0 || sp[i] >= num_slots ? sp[i] : dp[i], " outside 0 .. ", num_slots - 1);
    if (sp[i] != dp[i]) moves.push_back(i);
  }
  std::vector<int64_t> sorted_dst(dp, dp + n);
  std::sort(sorted_dst.begin(), sorted_dst.end());
  TORCH_CHECK(std::adjacent_find(sorted_dst.begin(), sorted_dst.end()) == sorted_dst.end(),
              "copy_cache_slots: a destination slot appears twice");
  if (moves.empty()) return;
  const int64_t row_bytes = kv.size(2) * kv.element_size(), count = static_cast<int64_t>(moves.size());
  std::vector<char> staged(count * row_bytes);
  char* base = static_cast<char*>(kv.data_ptr());
  for (int64_t layer = 0; layer < layers; ++layer) {
    char* buf = base + layer * num_slots * row_bytes;
    for (int64_t m = 0; m < count; ++m) std::memcpy(staged.data() + m * row_bytes, buf + sp[moves[m]] * row_bytes, row_bytes);
    for (int64_t m = 0; m < count; ++m) std::memcpy(buf + dp[moves[m]] * row_bytes, staged.data() + m * row_bytes, row_bytes);
  }
}

// The drafting calls' prefix lengths [B]: each checked non-negative; returns the largest (0 for none).
int64_t largest_prefix(const int64_t* prefix, int64_t batch, const char* who) {
  TORCH_CHECK(batch == 0 || *std::min_element(prefix, prefix + batch) >= 0, who, ": a negative prefix");
  return batch ? *std::max_element(prefix, prefix + batch) : 0;
}

// Rows `rows` of the request-to-slots table, their first `width` entries (fewer where the table is
// narrower: callers check the width they got).
at::Tensor table_rows(const at::Tensor& req_to_token, const at::Tensor& rows, int64_t width) {
  return req_to_token.narrow(1, 0, std::min(req_to_token.size(1), width)).index_select(0, rows);
}

// KVCacheManager.scratch_slots: [B, scratch] the cache slots of row rows[b]'s row indices
// prefix[b] .. prefix[b] + scratch - 1 (a speculative round's draft scratch and verify tree).
at::Tensor scratch_slots(const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& prefix, int64_t scratch) {
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.is_contiguous() && req_to_token.scalar_type() == at::kLong,
              "scratch_slots: a contiguous int64 req_to_token [R, W]");
  TORCH_CHECK(rows.dim() == 1 && prefix.sizes() == rows.sizes() && rows.scalar_type() == at::kLong &&
                  prefix.scalar_type() == at::kLong && scratch >= 0,
              "scratch_slots: int64 rows [B] and prefix [B], scratch >= 0");
  const int64_t batch = rows.size(0), num_rows = req_to_token.size(0), width = req_to_token.size(1);
  const at::Tensor rows_c = rows.contiguous(), prefix_c = prefix.contiguous();
  const int64_t *rp = rows_c.data_ptr<int64_t>(), *pp = prefix_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(rp[b] >= 0 && rp[b] < num_rows && pp[b] >= 0 && pp[b] + scratch <= width, "scratch_slots: row ", rp[b],
                " at ", pp[b], " + ", scratch, " outside the table [", num_rows, ", ", width, "]");
  }
  at::Tensor out = at::empty({batch, scratch}, req_to_token.options());
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) std::copy_n(table + rp[b] * width + pp[b], scratch, op + b * scratch);
  return out;
}

// KVCacheManager's table entries of newly allocated cache blocks: per row of `blocks` [n, 3]
// (a request row, the block's index in that row, the cache block), the row's entries of that
// block's positions get the block's slots (block * block_size + j), up to the table's width.
void write_block_entries(at::Tensor req_to_token, const at::Tensor& blocks, int64_t block_size) {
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.is_contiguous() && req_to_token.scalar_type() == at::kLong,
              "write_block_entries: a contiguous int64 req_to_token [R, W]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 3 && blocks.scalar_type() == at::kLong && block_size >= 1,
              "write_block_entries: int64 blocks [n, 3] (row, block index, block) and block_size >= 1");
  const int64_t rows = req_to_token.size(0), width = req_to_token.size(1), n = blocks.size(0);
  const at::Tensor blocks_c = blocks.contiguous();
  const int64_t* entry = blocks_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = entry[3 * i], index = entry[3 * i + 1], block = entry[3 * i + 2];
    TORCH_CHECK(row >= 0 && row < rows && index >= 0 && index * block_size < width && block >= 0,
                "write_block_entries: block ", block, " at index ", index, " of row ", row, " outside the table");
  }
  int64_t* table = req_to_token.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = entry[3 * i], start = entry[3 * i + 1] * block_size, block = entry[3 * i + 2];
    const int64_t count = std::min(block_size, width - start);
    int64_t* out = table + row * width + start;
    for (int64_t j = 0; j < count; ++j) out[j] = block * block_size + j;
  }
}

// What a speculative round commits (eagle_worker._commit), from a verification's [B, D + 2] table
// (per request: num_accepted, bonus token, accepted nodes), for requests whose path is the root
// then their accepted nodes: T = sum(num_accepted + 1) entries, request after request, as the rows
// of a [5, T] int64 table: the slot that holds the path node's entries (slots[b, node]), the slot
// they belong in (slots[b, i] for the path's i-th entry), its position (prefix[b] + i), its row of
// the verify features (b * N + node), and the draft extend's id there (the path's next token, the
// bonus token after the last). Then the draft extend's per-request vectors: [3, B] (its new tokens
// num_accepted + 1, its sequence lengths prefix + num_accepted + 1, each request's last entry) and
// [B + 1] (each request's first entry, then T).
std::vector<at::Tensor> commit_table(const at::Tensor& verify_table, const at::Tensor& tokens, const at::Tensor& slots,
                                     const at::Tensor& prefix) {
  for (const at::Tensor* x : {&verify_table, &tokens, &slots, &prefix}) {
    TORCH_CHECK(x->scalar_type() == at::kLong, "commit_table: int64 tensors");
  }
  TORCH_CHECK(tokens.dim() == 2 && verify_table.dim() == 2 && slots.dim() == 2 && verify_table.size(1) >= 2,
              "commit_table: tokens [B, N], verify_table [B, D + 2], slots [B, S]");
  const int64_t batch = tokens.size(0), n = tokens.size(1), depth = verify_table.size(1) - 2, scratch = slots.size(1);
  TORCH_CHECK(verify_table.size(0) == batch && slots.size(0) == batch && prefix.numel() == batch,
              "commit_table: one row per request in every input");
  TORCH_CHECK(depth < n && n <= scratch, "commit_table: a path of at most N nodes, slots [B, S] with S >= N");
  const at::Tensor table_c = verify_table.contiguous(), tokens_c = tokens.contiguous();
  const at::Tensor slots_c = slots.contiguous(), prefix_c = prefix.contiguous();
  const int64_t* vp = table_c.data_ptr<int64_t>();
  const int64_t *tp = tokens_c.data_ptr<int64_t>(), *sp = slots_c.data_ptr<int64_t>(), *pp = prefix_c.data_ptr<int64_t>();
  const int64_t width = depth + 2;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t a = vp[b * width];
    TORCH_CHECK(a >= 0 && a <= depth, "commit_table: num_accepted ", a, " outside 0 .. ", depth);
    for (int64_t i = 0; i < a; ++i) {
      const int64_t node = vp[b * width + 2 + i];
      TORCH_CHECK(node >= 1 && node < n, "commit_table: accepted node ", node, " outside 1 .. ", n - 1);
    }
    total += a + 1;
  }
  at::Tensor out = at::empty({5, total}, tokens.options());
  at::Tensor per_request = at::empty({3, batch}, tokens.options()), starts = at::empty({batch + 1}, tokens.options());
  int64_t* src = out.data_ptr<int64_t>();
  int64_t *dst = src + total, *positions = dst + total, *feature_rows = positions + total, *ids = feature_rows + total;
  int64_t *extend_lens = per_request.data_ptr<int64_t>(), *seq_lens = extend_lens + batch, *last = seq_lens + batch;
  int64_t* entry_starts = starts.data_ptr<int64_t>();
  int64_t e = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* row = vp + b * width;  // num_accepted, bonus, nodes
    entry_starts[b] = e;
    extend_lens[b] = row[0] + 1;
    seq_lens[b] = pp[b] + row[0] + 1;
    last[b] = e + row[0];
    for (int64_t i = 0; i <= row[0]; ++i, ++e) {
      const int64_t node = i == 0 ? 0 : row[1 + i];
      src[e] = sp[b * scratch + node];
      dst[e] = sp[b * scratch + i];
      positions[e] = pp[b] + i;
      feature_rows[e] = b * n + node;
      ids[e] = i < row[0] ? tp[b * n + row[2 + i]] : row[1];
    }
  }
  entry_starts[batch] = total;
  return {out, per_request, starts};
}

// EAGLE-2 tree selection (tree.py's CandidateRecorder.build_tree). Per request, of its M candidates
// (target ids, cumulative draft log-probabilities, the parent's candidate index or -1 for the root,
// and depths [M] shared by all requests), the num_nodes - 1 ranked highest by score less 1e-12 per
// candidate index (in double, so equal scores go to the earlier candidate), in candidate order after
// the root. Returns [tokens, parents (node indices, -1 for the root), depths], each [B, num_nodes].
std::vector<at::Tensor> select_draft_tree(const at::Tensor& tokens, const at::Tensor& scores, const at::Tensor& parents,
                                          const at::Tensor& depths, const at::Tensor& roots, int64_t num_nodes) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && parents.sizes() == tokens.sizes() &&
                  parents.scalar_type() == at::kLong && scores.sizes() == tokens.sizes() && scores.scalar_type() == at::kFloat,
              "select_draft_tree: int64 tokens and parents, float32 scores, each [B, M]");
  const int64_t batch = tokens.size(0), candidates = tokens.size(1);
  TORCH_CHECK(depths.dim() == 1 && depths.size(0) == candidates && depths.scalar_type() == at::kLong && roots.dim() == 1 &&
                  roots.size(0) == batch && roots.scalar_type() == at::kLong,
              "select_draft_tree: int64 depths [M] and roots [B]");
  TORCH_CHECK(num_nodes >= 1 && num_nodes - 1 <= candidates, "select_draft_tree: ", num_nodes, " nodes from ", candidates,
              " candidates");
  const at::Tensor tc = tokens.contiguous(), sc = scores.contiguous(), pc = parents.contiguous(), dc = depths.contiguous();
  const at::Tensor rc = roots.contiguous();
  const int64_t *tp = tc.data_ptr<int64_t>(), *pp = pc.data_ptr<int64_t>(), *dp = dc.data_ptr<int64_t>();
  const int64_t* rp = rc.data_ptr<int64_t>();
  const float* sp = sc.data_ptr<float>();
  at::Tensor out_tokens = at::empty({batch, num_nodes}, tokens.options());
  at::Tensor out_parents = at::empty({batch, num_nodes}, tokens.options());
  at::Tensor out_depths = at::empty({batch, num_nodes}, tokens.options());
  int64_t *ot = out_tokens.data_ptr<int64_t>(), *op = out_parents.data_ptr<int64_t>(), *od = out_depths.data_ptr<int64_t>();
  std::vector<double> key(candidates);
  std::vector<int64_t> order(candidates), node_of(candidates);
  const int64_t kept = num_nodes - 1;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t c = 0; c < candidates; ++c) {
      key[c] = static_cast<double>(sp[b * candidates + c]) - static_cast<double>(c) * 1e-12;
      order[c] = c;
    }
    std::partial_sort(order.begin(), order.begin() + kept, order.end(),
                      [&](int64_t x, int64_t y) { return key[x] > key[y] || (key[x] == key[y] && x < y); });
    std::sort(order.begin(), order.begin() + kept);
    std::fill(node_of.begin(), node_of.end(), -1);
    for (int64_t i = 0; i < kept; ++i) node_of[order[i]] = i + 1;
    int64_t* row_tokens = ot + b * num_nodes;
    int64_t* row_parents = op + b * num_nodes;
    int64_t* row_depths = od + b * num_nodes;
    row_tokens[0] = rp[b], row_parents[0] = -1, row_depths[0] = 0;
    for (int64_t i = 0; i < kept; ++i) {
      const int64_t c = order[i], parent = pp[b * candidates + c];
      TORCH_CHECK(parent >= -1 && parent < candidates, "select_draft_tree: parent candidate ", parent, " out of range");
      const int64_t parent_node = parent < 0 ? 0 : node_of[parent];
      TORCH_CHECK(parent_node >= 0, "draft tree selection kept a node without its parent");
      row_tokens[i + 1] = tp[b * candidates + c];
      row_parents[i + 1] = parent_node;
      row_depths[i + 1] = dp[c];
    }
  }
  return {out_tokens, out_parents, out_depths};
}

// The verify pass's mask of trees placed at row indices prefix .. prefix + N - 1 (tree.py's
// tree_attention_mask): [B * N, num_keys] bool, node i of request b seeing row indices below
// prefix[b], its ancestors' and its own. Parents: -1 for the root, else an earlier node.
at::Tensor tree_attention_mask(const at::Tensor& parents, const at::Tensor& prefix, int64_t num_keys) {
  TORCH_CHECK(parents.dim() == 2 && parents.scalar_type() == at::kLong && prefix.dim() == 1 && prefix.size(0) == parents.size(0) &&
                  prefix.scalar_type() == at::kLong,
              "tree_attention_mask: int64 parents [B, N] and prefix [B]");
  const int64_t batch = parents.size(0), n = parents.size(1);
  const at::Tensor pc = parents.contiguous(), prefix_c = prefix.contiguous();
  const int64_t *pp = pc.data_ptr<int64_t>(), *xp = prefix_c.data_ptr<int64_t>();
  at::Tensor mask = at::zeros({batch * n, num_keys}, parents.options().dtype(at::kBool));
  bool* mp = mask.data_ptr<bool>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(xp[b] >= 0 && xp[b] + n <= num_keys, "tree_attention_mask: prefix ", xp[b], " + ", n, " nodes past ", num_keys, " keys");
    for (int64_t i = 0; i < n; ++i) {
      bool* row = mp + (b * n + i) * num_keys;
      std::fill(row, row + xp[b], true);
      for (int64_t j = i; j >= 0; j = pp[b * n + j]) {
        TORCH_CHECK((j == 0) == (pp[b * n + j] < 0) && pp[b * n + j] < j,
                    "tree_attention_mask: node 0 is the root (parent -1), every other node's parent an earlier node");
        row[xp[b] + j] = true;
      }
    }
  }
  return mask;
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
  // With AMX copies of W_UK^T / W_UV per head (bfloat16 models), passes 1 and 3 run on tiles; their
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
  // With the AMX projections and a bfloat16 cache, q @ k^T and p @ c_kv run on tiles too, from
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
      if constexpr (std::is_same_v<KV, at::BFloat16>) {
        if (amx_attention) amx_key_scores(rows.data(), num_rows, keys_of.data(), keys, qdim, qstride, row_scores.data());
      }
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
      if constexpr (std::is_same_v<KV, at::BFloat16>) {
        if (amx_attention) amx_value_sums(scores.data(), num_rows, keys_of.data(), keys, latent, out_rows.data());
      }
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

at::Tensor mla_absorbed_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv,
                                  const at::Tensor& w_uk, const at::Tensor& w_uv_t, const at::Tensor& slots,
                                  const at::Tensor& kv_lens, const at::Tensor& token_starts,
                                  const c10::optional<at::Tensor>& custom_mask, double scale,
                                  const c10::optional<at::Tensor>& w_uk_packed, const c10::optional<at::Tensor>& w_uv_packed) {
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
  if (w_uk_packed.has_value() != w_uv_packed.has_value()) TORCH_CHECK(false, "mla_absorbed_attention: both AMX copies or neither");
  if (w_uk_packed) {
    const int64_t heads = q_nope.size(1), nope = q_nope.size(2), latent = w_uk.size(2), value = w_uv_t.size(2);
    TORCH_CHECK(tile_kernels_supported() && q_bf16,
                "mla_absorbed_attention: AMX-layout projections need AMX or AVX512-BF16 and bfloat16 queries");
    TORCH_CHECK(latent % kTileN == 0, "mla_absorbed_attention: AMX projections need L a multiple of 16");
    TORCH_CHECK(w_uk_packed->dim() == 6 && w_uk_packed->size(0) == heads && w_uv_packed->dim() == 6 && w_uv_packed->size(0) == heads &&
                    w_uk_packed->is_contiguous() && w_uv_packed->is_contiguous(),
                "mla_absorbed_attention: AMX copies are [H, ...] stacks of amx_pack_weight");
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

// kv[slot] = [c_kv | k_pe] for each new token (LatentKVPool.write in one call), cast to the cache dtype.
template <typename KV, typename X>
void cache_write_impl(at::Tensor& kv, const int64_t* slots, const at::Tensor& c_kv, const at::Tensor& k_pe) {
  const int64_t tokens = c_kv.size(0), latent = c_kv.size(1), rope = k_pe.size(1), dim = kv.size(1);
  KV* dst = kv.data_ptr<KV>();
  const X* cp = c_kv.data_ptr<X>();
  const X* kp = k_pe.data_ptr<X>();
  const bool copy = std::is_same_v<KV, X> && c_kv.stride(1) == 1 && k_pe.stride(1) == 1;
  for (int64_t t = 0; t < tokens; ++t) {
    KV* row = dst + slots[t] * dim;
    if (copy) {
      std::memcpy(row, cp + t * c_kv.stride(0), latent * sizeof(KV));
      std::memcpy(row + latent, kp + t * k_pe.stride(0), rope * sizeof(KV));
      continue;
    }
    for (int64_t i = 0; i < latent; ++i) row[i] = from_float<KV>(to_float(cp[t * c_kv.stride(0) + i * c_kv.stride(1)]));
    for (int64_t i = 0; i < rope; ++i) row[latent + i] = from_float<KV>(to_float(kp[t * k_pe.stride(0) + i * k_pe.stride(1)]));
  }
}

void mla_cache_write(at::Tensor kv, const at::Tensor& out_cache_loc, const at::Tensor& c_kv, const at::Tensor& k_pe) {
  TORCH_CHECK(kv.dim() == 2 && kv.is_contiguous(), "mla_cache_write: contiguous cache [slots, L + R]");
  TORCH_CHECK(c_kv.dim() == 2 && k_pe.dim() == 2 && c_kv.size(0) == k_pe.size(0) && c_kv.size(1) + k_pe.size(1) == kv.size(1),
              "mla_cache_write: c_kv [T, L] and k_pe [T, R] with L + R the cache row");
  TORCH_CHECK(c_kv.scalar_type() == k_pe.scalar_type(), "mla_cache_write: c_kv and k_pe dtypes differ");
  TORCH_CHECK(out_cache_loc.scalar_type() == at::kLong && out_cache_loc.numel() == c_kv.size(0), "mla_cache_write: int64 slot per token");
  const at::Tensor loc = out_cache_loc.contiguous();
  const int64_t* slots = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < loc.numel(); ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < kv.size(0), "mla_cache_write: cache slot ", slots[t], " out of range");
  }
  const bool kv_bf16 = kv.scalar_type() == at::kBFloat16, x_bf16 = c_kv.scalar_type() == at::kBFloat16;
  TORCH_CHECK((kv_bf16 || kv.scalar_type() == at::kFloat) && (x_bf16 || c_kv.scalar_type() == at::kFloat),
              "mla_cache_write: bfloat16 or float32");
  if (kv_bf16 && x_bf16) cache_write_impl<at::BFloat16, at::BFloat16>(kv, slots, c_kv, k_pe);
  else if (kv_bf16) cache_write_impl<at::BFloat16, float>(kv, slots, c_kv, k_pe);
  else if (x_bf16) cache_write_impl<float, at::BFloat16>(kv, slots, c_kv, k_pe);
  else cache_write_impl<float, float>(kv, slots, c_kv, k_pe);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr const char* kTileBackend = "amx";
constexpr bool kProductsPerRow = false;

// AMX tiles: tmm0-3 accumulate 16 rows x 64 output columns in float32, tmm4 holds 16 rows x 32
// bfloat16 of x, tmm5-7 hold weight blocks of 32 (k) x 16 (n) in the pair-interleaved layout.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool tiles_permitted() {
  // Linux hands out AMX state per process on request (oneDNN asks too; asking twice is harmless).
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

void release_tiles() { _tile_release(); }

// out[r][0:16 * n_blocks] (row stride out_stride) = x_pad rows r < m against the first n_blocks
// (1-4) of one group of four 16-column weight blocks, in float32. x_pad holds whole tiles:
// ceil(m / 16) * 16 rows of kp = k_blocks * 32 values, zero beyond the real ones. Tiles must be
// configured on this thread. Each output is one tile-product chain in k order, the same for any m.
void amx_group(const at::BFloat16* x_pad, int64_t m, int64_t kp, const at::BFloat16* w_group, int64_t k_blocks,
               float* out, int64_t out_stride, int64_t n_blocks) {
  const int64_t block_elems = kTileK * kTileN, w_step = k_blocks * block_elems;
  alignas(64) float c[kTileRows][kGroupN];
  for (int64_t mb = 0; mb * kTileRows < m; ++mb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const at::BFloat16* xrow = x_pad + mb * kTileRows * kp;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      _tile_loadd(4, xrow + kb * kTileK, kp * 2);
      const at::BFloat16* wb = w_group + kb * block_elems;
      _tile_loadd(5, wb, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (n_blocks > 1) {
        _tile_loadd(6, wb + w_step, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (n_blocks > 2) {
        _tile_loadd(7, wb + 2 * w_step, 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (n_blocks > 3) {
        _tile_loadd(5, wb + 3 * w_step, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    const int64_t rows = std::min(kTileRows, m - mb * kTileRows);
    float* dst = out + mb * kTileRows * out_stride;
    if (rows == kTileRows) {  // a whole block of rows: the tiles go straight to out
      const int64_t stride_bytes = out_stride * sizeof(float);
      _tile_stored(0, dst, stride_bytes);
      if (n_blocks > 1) _tile_stored(1, dst + kTileN, stride_bytes);
      if (n_blocks > 2) _tile_stored(2, dst + 2 * kTileN, stride_bytes);
      if (n_blocks > 3) _tile_stored(3, dst + 3 * kTileN, stride_bytes);
      continue;
    }
    _tile_stored(0, &c[0][0], kGroupN * 4);
    _tile_stored(1, &c[0][16], kGroupN * 4);
    _tile_stored(2, &c[0][32], kGroupN * 4);
    _tile_stored(3, &c[0][48], kGroupN * 4);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * out_stride, c[r], n_blocks * kTileN * sizeof(float));
  }
}

// out[i][r][0:16] = A_i's row r (of a_rows[i] <= 16, row stride lda, k_blocks * 32 values; rows
// past a_rows[i] are read and not stored) times one 16-column weight block, for i < num_a (1-4):
// four independent tile-product chains, where amx_group runs one per 16 rows with a single block.
// Each output is one chain in k order, the same as amx_group's. Tiles must be configured.
void amx_blocks_by_group(const at::BFloat16* const* a, const int64_t* /* a_rows: tiles read 16 */, int64_t num_a,
                         int64_t lda, const at::BFloat16* b_block, int64_t k_blocks, float* out) {
  constexpr int64_t block_elems = kTileK * kTileN;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    _tile_loadd(4, b_block + kb * block_elems, 64);
    _tile_loadd(5, a[0] + kb * kTileK, lda * 2);
    _tile_dpbf16ps(0, 5, 4);
    if (num_a > 1) {
      _tile_loadd(6, a[1] + kb * kTileK, lda * 2);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (num_a > 2) {
      _tile_loadd(7, a[2] + kb * kTileK, lda * 2);
      _tile_dpbf16ps(2, 7, 4);
    }
    if (num_a > 3) {
      _tile_loadd(5, a[3] + kb * kTileK, lda * 2);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  constexpr int64_t tile_bytes = kTileN * sizeof(float);
  _tile_stored(0, out, tile_bytes);
  if (num_a > 1) _tile_stored(1, out + kTileRows * kTileN, tile_bytes);
  if (num_a > 2) _tile_stored(2, out + 2 * kTileRows * kTileN, tile_bytes);
  if (num_a > 3) _tile_stored(3, out + 3 * kTileRows * kTileN, tile_bytes);
}
#elif defined(__AVX512BF16__)
// Without AMX, the same packed layout runs on AVX512-BF16 dot products: a 64-byte row of a weight
// block (one k pair for its 16 columns) is one vector, and x's pair is broadcast against it.
constexpr const char* kTileBackend = "avx512_bf16";
constexpr bool kProductsPerRow = true;

bool tiles_permitted() { return true; }  // no tile state to ask the OS for
void configure_tiles() {}
void release_tiles() {}

// Rows r0 .. r0 + R - 1 against NB weight blocks: R * NB accumulators, each one chain of pair
// products in k order from zero (so an output's bits depend only on its row and column).
template <int R, int NB>
inline void bf16_dot_rows(const at::BFloat16* x_pad, int64_t r0, int64_t kp, const at::BFloat16* w_group, int64_t k_blocks,
                          float* out, int64_t out_stride) {
  const int64_t block_elems = kTileK * kTileN, w_step = k_blocks * block_elems;
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_setzero_ps();
  const at::BFloat16* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = x_pad + (r0 + r) * kp;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const at::BFloat16* wb = w_group + kb * block_elems;
    for (int64_t pair = 0; pair < kTileK / 2; ++pair) {
      __m512bh w[NB];
      for (int nb = 0; nb < NB; ++nb) w[nb] = (__m512bh)_mm512_loadu_si512(wb + nb * w_step + pair * 2 * kTileN);
      for (int r = 0; r < R; ++r) {
        int32_t x_pair;  // x's two bfloat16 values of this k pair (memcpy: no aliasing through int32_t*)
        std::memcpy(&x_pair, xrow[r] + kb * kTileK + 2 * pair, sizeof(x_pair));
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(x_pair);
        for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_dpbf16_ps(acc[r][nb], w[nb], xr);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) _mm512_storeu_ps(out + (r0 + r) * out_stride + nb * kTileN, acc[r][nb]);
}

template <int NB>
void bf16_dot_group(const at::BFloat16* x_pad, int64_t m, int64_t kp, const at::BFloat16* w_group, int64_t k_blocks,
                    float* out, int64_t out_stride) {
  // Six rows x four blocks: 24 of the 32 vector registers accumulate.
  constexpr int kRows = 6;
  int64_t r0 = 0;
  for (; r0 + kRows <= m; r0 += kRows) bf16_dot_rows<kRows, NB>(x_pad, r0, kp, w_group, k_blocks, out, out_stride);
  switch (m - r0) {
    case 5: bf16_dot_rows<5, NB>(x_pad, r0, kp, w_group, k_blocks, out, out_stride); break;
    case 4: bf16_dot_rows<4, NB>(x_pad, r0, kp, w_group, k_blocks, out, out_stride); break;
    case 3: bf16_dot_rows<3, NB>(x_pad, r0, kp, w_group, k_blocks, out, out_stride); break;
    case 2: bf16_dot_rows<2, NB>(x_pad, r0, kp, w_group, k_blocks, out, out_stride); break;
    case 1: bf16_dot_rows<1, NB>(x_pad, r0, kp, w_group, k_blocks, out, out_stride); break;
    default: break;
  }
}

// amx_group's contract (below, with AMX) on AVX512-BF16.
void amx_group(const at::BFloat16* x_pad, int64_t m, int64_t kp, const at::BFloat16* w_group, int64_t k_blocks,
               float* out, int64_t out_stride, int64_t n_blocks) {
  switch (n_blocks) {
    case 1: bf16_dot_group<1>(x_pad, m, kp, w_group, k_blocks, out, out_stride); break;
    case 2: bf16_dot_group<2>(x_pad, m, kp, w_group, k_blocks, out, out_stride); break;
    case 3: bf16_dot_group<3>(x_pad, m, kp, w_group, k_blocks, out, out_stride); break;
    default: bf16_dot_group<4>(x_pad, m, kp, w_group, k_blocks, out, out_stride); break;
  }
}

// amx_blocks_by_group's contract (above, with AMX) on AVX512-BF16: only the rows that are stored.
void amx_blocks_by_group(const at::BFloat16* const* a, const int64_t* a_rows, int64_t num_a, int64_t lda,
                         const at::BFloat16* b_block, int64_t k_blocks, float* out) {
  for (int64_t i = 0; i < num_a; ++i) bf16_dot_group<1>(a[i], a_rows[i], lda, b_block, k_blocks, out + i * kTileRows * kTileN, kTileN);
}
#endif

#if defined(__AVX512BF16__)
// row_scores[r * keys + s] = bfloat16(rows[r]) . key s, for r < num_rows, s < keys, on tiles: the
// keys are the A rows (16 per tile, read straight from the cache where a block holds them, else
// copied), the queries a packed B block of 16 columns. rows hold kp values (whole k blocks, zero
// past the key's qdim). A score is one tile-product chain over kp in order, the same whatever the
// other rows and keys are. Tiles must be configured on this thread.
void amx_key_scores(const float* const* rows, int64_t num_rows, const at::BFloat16* const* keys_of, int64_t keys,
                    int64_t qdim, int64_t kp, float* row_scores) {
  const int64_t k_blocks = kp / kTileK, q_blocks = (num_rows + kTileN - 1) / kTileN;
  constexpr int64_t block_elems = kTileK * kTileN;
  thread_local std::vector<at::BFloat16> q_packed, key_rows;
  // Not zeroed: a query column past num_rows (earlier calls' finite values) reaches only its own
  // output column, which is not read.
  q_packed.resize(q_blocks * k_blocks * block_elems);
  key_rows.resize(4 * kTileRows * kp);
  // Block (qb, kb) holds 16 (k pair) x 16 (query) x 2: query r's pair p of block kb is dword
  // p * 16 + r % 16 of that block.
  const __m512i pair_offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(kTileN));
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      const float* x = rows[r] + kb * kTileK;
      const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + kTileN), _mm512_loadu_ps(x));
      int32_t* block = reinterpret_cast<int32_t*>(q_packed.data() + ((r / kTileN) * k_blocks + kb) * block_elems);
      _mm512_i32scatter_epi32(block + r % kTileN, pair_offsets, pairs, 4);
    }
  }
  // Keys s0 .. s0 + 15 as 16 rows of kp values: in place where the cache holds them one after
  // another at that width, else copied into buffer `slot` (zero past the key and the last key).
  auto key_chunk = [&](int64_t s0, int64_t slot) -> const at::BFloat16* {
    const int64_t chunk = std::min(kTileRows, keys - s0);
    bool in_one_run = chunk == kTileRows && kp == qdim;
    for (int64_t i = 1; in_one_run && i < chunk; ++i) in_one_run = keys_of[s0 + i] == keys_of[s0] + i * qdim;
    if (in_one_run) return keys_of[s0];
    at::BFloat16* rows_copy = key_rows.data() + slot * kTileRows * kp;
    for (int64_t i = 0; i < chunk; ++i) {
      std::memcpy(rows_copy + i * kp, keys_of[s0 + i], qdim * sizeof(at::BFloat16));
      std::memset(rows_copy + i * kp + qdim, 0, (kp - qdim) * sizeof(at::BFloat16));
    }
    std::memset(rows_copy + chunk * kp, 0, (kTileRows - chunk) * kp * sizeof(at::BFloat16));
    return rows_copy;
  };
  if (q_blocks == 1) {
    // Up to 16 query rows (a decode step's heads): four key chunks at a time against the one query
    // block, four independent tile chains where one chunk at a time would wait on one.
    alignas(64) float chunk_out[4][kTileRows][kTileN];
    for (int64_t s0 = 0; s0 < keys; s0 += 4 * kTileRows) {
      const at::BFloat16* a[4];
      int64_t a_rows[4], num_a = 0;
      for (; num_a < 4 && s0 + num_a * kTileRows < keys; ++num_a) {
        a[num_a] = key_chunk(s0 + num_a * kTileRows, num_a);
        a_rows[num_a] = std::min(kTileRows, keys - s0 - num_a * kTileRows);
      }
      amx_blocks_by_group(a, a_rows, num_a, kp, q_packed.data(), k_blocks, &chunk_out[0][0][0]);
      for (int64_t r = 0; r < num_rows; ++r) {
        float* dst = row_scores + r * keys + s0;
        for (int64_t c = 0; c < num_a; ++c) {
          for (int64_t i = 0; i < a_rows[c]; ++i) dst[c * kTileRows + i] = chunk_out[c][i][r];
        }
      }
    }
    return;
  }
  alignas(64) float tile_out[kTileRows][kGroupN];
  for (int64_t s0 = 0; s0 < keys; s0 += kTileRows) {
    const int64_t chunk = std::min(kTileRows, keys - s0);
    const at::BFloat16* a = key_chunk(s0, 0);
    for (int64_t qg = 0; qg < q_blocks; qg += 4) {
      const int64_t nq = std::min<int64_t>(4, q_blocks - qg);
      amx_group(a, chunk, kp, q_packed.data() + qg * k_blocks * block_elems, k_blocks, &tile_out[0][0], kGroupN, nq);
      const int64_t r_end = std::min(num_rows, (qg + nq) * kTileN);
      for (int64_t r = qg * kTileN; r < r_end; ++r) {
        float* dst = row_scores + r * keys + s0;
        for (int64_t i = 0; i < chunk; ++i) dst[i] = tile_out[i][r - qg * kTileN];
      }
    }
  }
}

// out_rows[r][0:latent] = sum over keys s of bfloat16(probs[r * keys + s]) * key s's first latent
// values (latent a multiple of 16), on tiles: the probabilities are the A rows, the keys' latents
// packed as B blocks of 32 keys (k) x 16 latent columns, zero past the last key. Tiles must be
// configured on this thread.
void amx_value_sums(const float* probs, int64_t num_rows, const at::BFloat16* const* keys_of, int64_t keys,
                    int64_t latent, float* const* out_rows) {
  const int64_t k_blocks = (keys + kTileK - 1) / kTileK, kp = k_blocks * kTileK, n_blocks = latent / kTileN;
  constexpr int64_t block_elems = kTileK * kTileN;
  thread_local std::vector<at::BFloat16> p_pad, v_packed, zeros;
  thread_local std::vector<float> c;
  // Rows past num_rows are not zeroed (they reach only output rows that are not read); a row's
  // columns past the last key are, as they meet the zero keys.
  p_pad.resize((num_rows + kTileRows - 1) / kTileRows * kTileRows * kp);
  for (int64_t r = 0; r < num_rows; ++r) {
    store_bf16(p_pad.data() + r * kp, probs + r * keys, nullptr, keys);
    std::memset(p_pad.data() + r * kp + keys, 0, (kp - keys) * sizeof(at::BFloat16));
  }
  assign_zeros(zeros, latent);
  v_packed.resize(4 * k_blocks * block_elems);
  c.resize(num_rows * kGroupN);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t g = 0; g * 4 < n_blocks; ++g) {
    const int64_t group_blocks = std::min<int64_t>(4, n_blocks - g * 4), width = group_blocks * kTileN;
    // The group's blocks (nb, kb), written in order (stores a block apart thrash L1's sets): row
    // `pair` of a block interleaves keys 2 * pair and 2 * pair + 1 of the k block over its 16
    // latent columns.
    at::BFloat16* dst = v_packed.data();
    for (int64_t nb = 0; nb < group_blocks; ++nb) {
      const int64_t column = (g * 4 + nb) * kTileN;
      for (int64_t s = 0; s < kp; s += 2, dst += 2 * kTileN) {
        const at::BFloat16* v0 = s < keys ? keys_of[s] : zeros.data();
        const at::BFloat16* v1 = s + 1 < keys ? keys_of[s + 1] : zeros.data();
        const __m512i both = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + column))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + column)), 1);
        _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, both));
      }
    }
    amx_group(p_pad.data(), num_rows, kp, v_packed.data(), k_blocks, c.data(), kGroupN, group_blocks);
    for (int64_t r = 0; r < num_rows; ++r) std::memcpy(out_rows[r] + g * kGroupN, c.data() + r * kGroupN, width * sizeof(float));
  }
}
#else
void amx_blocks_by_group(const at::BFloat16* const*, const int64_t*, int64_t, int64_t, const at::BFloat16*, int64_t, float*) {}
void amx_key_scores(const float* const*, int64_t, const at::BFloat16* const*, int64_t, int64_t, int64_t, float*) {}
void amx_value_sums(const float*, int64_t, const at::BFloat16* const*, int64_t, int64_t, float* const*) {}
#endif

#if !defined(__AVX512BF16__)
constexpr const char* kTileBackend = "";
constexpr bool kProductsPerRow = false;
bool tiles_permitted() { return false; }
void configure_tiles() {}
void release_tiles() {}
void amx_group(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t, float*, int64_t, int64_t) {}
#endif

// The tile-layout kernels run here: on AMX tiles, or on AVX512-BF16 dot products without AMX.
bool tile_kernels_supported() { return kTileBackend[0] != '\0' && tiles_permitted(); }

std::string tile_backend() { return tile_kernels_supported() ? kTileBackend : ""; }

// A bfloat16 weight [N, K] in the tile layout: blocks of 16 columns (padded to groups of four
// blocks) x 32 k, each block 16 rows of (k pair) x 16 columns x 2.
at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_pack_weight: bfloat16 [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t n_blocks = (n + kGroupN - 1) / kGroupN * 4, k_blocks = (k + kTileK - 1) / kTileK;
  at::Tensor packed = at::zeros({n_blocks, k_blocks, kTileK / 2, kTileN, 2}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = packed.data_ptr<at::BFloat16>();
  for (int64_t row = 0; row < n; ++row) {
    const int64_t nb = row / kTileN, col = row % kTileN;
    for (int64_t kk = 0; kk < k; ++kk) {
      const int64_t kb = kk / kTileK, pair = (kk % kTileK) / 2, within = kk % 2;
      dst[(((nb * k_blocks + kb) * (kTileK / 2) + pair) * kTileN + col) * 2 + within] = src[row * k + kk];
    }
  }
  return packed;
}

void check_packed(const at::Tensor& packed, int64_t k, int64_t n, const char* what) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 5 && packed.size(2) == kTileK / 2 &&
                  packed.size(3) == kTileN && packed.size(0) % 4 == 0,
              what, ": weight not packed by amx_pack_weight");
  TORCH_CHECK((k + kTileK - 1) / kTileK == packed.size(1) && n <= packed.size(0) * kTileN && n > packed.size(0) * kTileN - kGroupN,
              what, ": a [", n, ", ", k, "] weight does not match its packed copy");
}

// x's rows zero-padded to whole tiles ([ceil(rows / 16) * 16, k_blocks * 32]) in a buffer of this thread.
const at::BFloat16* padded_tiles(const at::Tensor& x, int64_t k_blocks, std::vector<at::BFloat16>& buffer) {
  const int64_t rows = x.size(0), k = x.size(1), kp = k_blocks * kTileK;
  const int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  if (static_cast<int64_t>(buffer.size()) < padded_rows * kp) assign_zeros(buffer, padded_rows * kp);
  // Only the padding is zeroed: the rows' own values are all written.
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int64_t row_stride = x.stride(0);
  at::BFloat16* dst = buffer.data();
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * kp, xp + r * row_stride, k * sizeof(at::BFloat16));
    if (kp > k) std::memset(dst + r * kp + k, 0, (kp - k) * sizeof(at::BFloat16));
  }
  std::memset(dst + rows * kp, 0, (padded_rows - rows) * kp * sizeof(at::BFloat16));
  return dst;
}

// Parallel over threads once a GEMM's products pay for the pool's wake-up (a few us). AMX multiplies
// a 16-row tile for the price of one row, so there rows count in whole tiles; AVX512-BF16 pays for
// every row, so smaller GEMMs split there (the demo's speculative decoding 1.08x / 1.09x at batch 1 /
// 16, its plain decoding 1.02x / 1.04x; deepseek-bf16 unchanged).
// Rows per thread chunk of the per-row loops around a parallel GEMM (activations, expert sums).
constexpr int64_t kActRowsGrain = 32;

inline bool worth_threads(int64_t m, int64_t n, int64_t k) {
  if constexpr (kProductsPerRow) return n * k * m >= (int64_t{1} << 18);
  return n * k * std::max<int64_t>(m, kTileRows) >= (int64_t{1} << 22);
}

// The checked inputs of a GEMM on a weight packed by amx_pack_weight: x [M, K] bfloat16, its rows
// zero-padded to whole tiles in a buffer of the calling thread (x_pad(), made on first use), and a
// bfloat16 bias [N] or none.
struct AmxLinearInputs {
  const at::Tensor& x;
  int64_t m, k_blocks, kp, group_elems;
  const at::BFloat16* weight;
  at::Tensor bias_c;
  const at::BFloat16* bias_data;

  AmxLinearInputs(const at::Tensor& x_, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias, const char* op)
      : x(x_) {
    TORCH_CHECK(tile_kernels_supported(), op, ": this CPU or build has neither AMX nor AVX512-BF16");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": bfloat16 x [M, K]");
    check_packed(packed, x.size(1), n, op);
    if (bias) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, op, ": bfloat16 bias [N]");
    m = x.size(0);
    k_blocks = packed.size(1);
    kp = k_blocks * kTileK;
    group_elems = 4 * k_blocks * kTileK * kTileN;
    weight = packed.data_ptr<at::BFloat16>();
    bias_c = bias ? bias->contiguous() : at::Tensor();
    bias_data = bias ? bias_c.data_ptr<at::BFloat16>() : nullptr;
  }

  const at::BFloat16* x_pad() const {
    thread_local std::vector<at::BFloat16> buffer;
    return padded_tiles(x.stride(1) == 1 ? x : x.contiguous(), k_blocks, buffer);
  }
};

// x [M, K] @ W^T with W packed by amx_pack_weight, out bfloat16 [M, N] (+ bias). Each output row
// comes from its own tile row: its bits do not depend on M or on the other rows.
// x @ W^T (+ bias) on AMX tiles, rounded to bfloat16; ``widened``: those bfloat16 values as float32
// (an lm_head's logits, which callers take in float32).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                      bool widened = false) {
  const AmxLinearInputs in(x, packed, n, bias, "amx_linear");
  const int64_t m = in.m, k_blocks = in.k_blocks, kp = in.kp, group_elems = in.group_elems, n_groups = packed.size(0) / 4;
  at::Tensor out = at::empty({m, n}, x.options().dtype(widened ? at::kFloat : at::kBFloat16));
  if (m == 0) return out;
  const at::BFloat16 *xp = in.x_pad(), *wp = in.weight, *bp = in.bias_data;
  at::BFloat16* op = widened ? nullptr : out.data_ptr<at::BFloat16>();
  float* op_widened = widened ? out.data_ptr<float>() : nullptr;
  at::parallel_for(0, n_groups, worth_threads(m, n, kp) ? 1 : n_groups, [&](int64_t begin, int64_t end) {
    configure_tiles();
    // Scratch of this thread, kept between calls (rows are written before they are read): a fresh
    // vector of a verify's rows is an allocation zeroed, and past 128 KB a mapping faulted in.
    thread_local std::vector<float> c;
    c.resize(m * kGroupN);
    for (int64_t g = begin; g < end; ++g) {
      amx_group(xp, m, kp, wp + g * group_elems, k_blocks, c.data(), kGroupN);
      const int64_t cols = std::min(kGroupN, n - g * kGroupN);
      for (int64_t r = 0; r < m; ++r) {  // bias added to the float32 sum, then one rounding
        const float* sums = c.data() + r * kGroupN;
        const at::BFloat16* bias_g = bp ? bp + g * kGroupN : nullptr;
        if (widened) {
          store_bf16_widened(op_widened + r * n + g * kGroupN, sums, bias_g, cols);
        } else {
          store_bf16(op + r * n + g * kGroupN, sums, bias_g, cols);
        }
      }
    }
    release_tiles();
  });
  return out;
}

// a + b of two bfloat16 tensors of one shape: each sum in float32, rounded to bfloat16 (nearest
// even), as at::add computes it; one vector pass where at::add's bfloat16 loop takes ~6x longer
// (a residual add of 512 x 128: 16 us against ~3). Other dtypes or layouts: at::add.
at::Tensor add_bf16(const at::Tensor& a, const at::Tensor& b) {
#if defined(__AVX512BF16__)
  if (a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && a.sizes() == b.sizes() && a.is_contiguous() &&
      b.is_contiguous()) {
    at::Tensor out = at::empty_like(a);
    const at::BFloat16 *ap = a.data_ptr<at::BFloat16>(), *bp = b.data_ptr<at::BFloat16>();
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    const int64_t n = a.numel();
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = tail_mask(n - i);
      store16_bf16(op + i, _mm512_add_ps(load16(ap + i, m), load16(bp + i, m)), m);
    }
    return out;
  }
#endif
  return at::add(a, b);
}

// A running argmax over a row's columns, fed in column order in pieces: torch's rule (the first
// NaN, else the first maximum). With AVX-512, per lane: the lane's first maximum (a strict compare
// keeps it) and its first NaN; the lanes are combined once, at the end.
struct RunningArgmax {
#if defined(__AVX512BF16__)
  __m512 value = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i index = _mm512_setzero_si512();
  __m512i nan_index = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());

  // Columns first .. first + n - 1 (n <= 16) hold float(bfloat16(sums + bias)).
  void add16(const float* sums, const at::BFloat16* bias, int32_t first, int64_t n) {
    const __mmask16 m = tail_mask(n);
    __m512 v = _mm512_maskz_loadu_ps(m, sums);
    if (bias) v = _mm512_add_ps(v, load16(bias, m));
    v = round_bf16(v);
    const __m512i columns = _mm512_add_epi32(_mm512_set1_epi32(first), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __mmask16 greater = _mm512_mask_cmp_ps_mask(m, v, value, _CMP_GT_OQ);
    value = _mm512_mask_blend_ps(greater, value, v);
    index = _mm512_mask_blend_epi32(greater, index, columns);
    const __mmask16 first_nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q) &
                                _mm512_cmpeq_epi32_mask(nan_index, _mm512_set1_epi32(std::numeric_limits<int32_t>::max()));
    nan_index = _mm512_mask_blend_epi32(first_nan, nan_index, columns);
  }

  void finish(float& best_value, int64_t& best_index, bool& has_nan) const {
    const int32_t nan_at = _mm512_reduce_min_epi32(nan_index);
    has_nan = nan_at != std::numeric_limits<int32_t>::max();
    if (has_nan) {
      best_value = std::numeric_limits<float>::quiet_NaN();
      best_index = nan_at;
      return;
    }
    best_value = _mm512_reduce_max_ps(value);
    // Lanes never above -inf keep index 0 of the piece they started in: an all -inf row's answer.
    const __mmask16 at_max = _mm512_cmp_ps_mask(value, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
    best_index = _mm512_mask_reduce_min_epi32(at_max, index);
  }
#else
  float value = 0.0f;
  int64_t index = -1;
  bool nan = false;

  void add16(const float* sums, const at::BFloat16* bias, int32_t first, int64_t n) {
    for (int64_t i = 0; i < n && !nan; ++i) {
      const float v = static_cast<float>(at::BFloat16(bias ? sums[i] + static_cast<float>(bias[i]) : sums[i]));
      if (std::isnan(v)) {
        value = v, index = first + i, nan = true;
      } else if (index < 0 || v > value) {
        value = v, index = first + i;
      }
    }
  }

  void finish(float& best_value, int64_t& best_index, bool& has_nan) const {
    best_value = value, best_index = index, has_nan = nan;
  }
#endif
};

// The argmax of each row of amx_linear(x, packed, n, bias, widened=true) without writing the logits:
// each thread keeps a running argmax per row over its column groups, and the threads' answers are
// merged in column order (the first NaN, else the first maximum, as torch.argmax). [M] int64.
at::Tensor amx_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(n > 0 && n < std::numeric_limits<int32_t>::max(), "amx_linear_argmax: 1 to 2^31 - 2 columns");
  const AmxLinearInputs in(x, packed, n, bias, "amx_linear_argmax");
  const int64_t m = in.m, k_blocks = in.k_blocks, kp = in.kp, group_elems = in.group_elems, n_groups = (n + kGroupN - 1) / kGroupN;
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  if (m == 0) return out;
  const at::BFloat16 *xp = in.x_pad(), *wp = in.weight, *bp = in.bias_data;
  struct Best {
    float value;
    int64_t index;
    bool nan;
  };
  // A chunk of groups leaves its rows' answers at its first group's rows, marked in chunk_first.
  std::vector<Best> bests(n_groups * m);
  std::vector<char> chunk_first(n_groups, 0);
  at::parallel_for(0, n_groups, worth_threads(m, n, kp) ? 1 : n_groups, [&](int64_t begin, int64_t end) {
    configure_tiles();
    thread_local std::vector<float> c;  // as amx_linear's
    c.resize(m * kGroupN);
    std::vector<RunningArgmax> running(m);
    for (int64_t g = begin; g < end; ++g) {
      amx_group(xp, m, kp, wp + g * group_elems, k_blocks, c.data(), kGroupN);
      const int64_t cols = std::min(kGroupN, n - g * kGroupN);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < cols; j += kTileN) {
          const int64_t col = g * kGroupN + j;
          running[r].add16(c.data() + r * kGroupN + j, bp ? bp + col : nullptr, static_cast<int32_t>(col), std::min(kTileN, cols - j));
        }
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      Best& b = bests[begin * m + r];
      running[r].finish(b.value, b.index, b.nan);
    }
    chunk_first[begin] = 1;
    release_tiles();
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    Best b{0.0f, -1, false};
    for (int64_t g = 0; g < n_groups; ++g) {
      if (!chunk_first[g]) continue;
      const Best& chunk = bests[g * m + r];
      if (b.index < 0 || (!b.nan && (chunk.nan || chunk.value > b.value))) b = chunk;
    }
    op[r] = b.index;
  }
  return out;
}

// act = bf16(bf16(silu(bf16(gate))) * bf16(up)) for one row of a float32 [gate | up] GEMM output:
// the roundings of linear -> F.silu -> mul on bfloat16 tensors.
void swiglu_act(const float* gate_up, int64_t inter, at::BFloat16* act) {
#if defined(__AVX512BF16__)
  // The loop below 16 lanes at a time, the same operations on each value.
  for (int64_t j = 0; j < inter; j += kLanes) {
    const __mmask16 m = tail_mask(inter - j);
    const __m512 gate = round_bf16(_mm512_maskz_loadu_ps(m, gate_up + j));
    const __m512 up = round_bf16(_mm512_maskz_loadu_ps(m, gate_up + inter + j));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_xor_ps(gate, _mm512_set1_ps(-0.0f)), _mm512_setzero_ps()));  // exp(-gate - 0)
    const __m512 silu = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    store16_bf16(act + j, _mm512_mul_ps(silu, up), m);
  }
#else
  thread_local std::vector<at::BFloat16> gate_bf16, up_bf16;
  thread_local std::vector<float> silu;
  gate_bf16.resize(inter);
  up_bf16.resize(inter);
  silu.resize(inter);
  store_bf16(gate_bf16.data(), gate_up, nullptr, inter);
  store_bf16(up_bf16.data(), gate_up + inter, nullptr, inter);
  load_row(silu.data(), gate_bf16.data(), inter);
  for (int64_t j = 0; j < inter; ++j) silu[j] = -silu[j];
  exp_shifted_row(silu.data(), 0.0f, inter);  // exp(-gate)
  for (int64_t j = 0; j < inter; ++j) silu[j] = static_cast<float>(gate_bf16[j]) / (1.0f + silu[j]);
  store_bf16(gate_bf16.data(), silu.data(), nullptr, inter);
  load_row(silu.data(), gate_bf16.data(), inter);
  for (int64_t j = 0; j < inter; ++j) silu[j] *= static_cast<float>(up_bf16[j]);
  store_bf16(act, silu.data(), nullptr, inter);
#endif
}

// SwiGLU (the dense MLP and the shared experts) in one call: x @ [gate; up]^T on AMX tiles, the
// activation as swiglu_act, then @ down^T, bfloat16 out. Rows are computed alone.
at::Tensor amx_swiglu(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, int64_t inter) {
  TORCH_CHECK(tile_kernels_supported(), "amx_swiglu: this CPU or build has neither AMX nor AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_swiglu: bfloat16 x [T, D]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  check_packed(w13, hidden, 2 * inter, "amx_swiglu gate_up");
  check_packed(w2, inter, hidden, "amx_swiglu down");
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  if (tokens == 0) return out;
  const at::Tensor xr = x.stride(1) == 1 ? x : x.contiguous();
  thread_local std::vector<at::BFloat16> x_pad;
  const at::BFloat16* xp = padded_tiles(xr, w13.size(1), x_pad);
  const int64_t kp_hidden = w13.size(1) * kTileK, kb_inter = w2.size(1), kp_inter = kb_inter * kTileK;
  const int64_t up_groups = w13.size(0) / 4, down_groups = w2.size(0) / 4;
  const int64_t up_width = up_groups * kGroupN, down_width = down_groups * kGroupN;
  const int64_t padded = (tokens + kTileRows - 1) / kTileRows * kTileRows;
  // Scratch of this thread, kept between calls (references, so the workers' lambdas reach the
  // caller's): gate_up and y rows are written before they are read; act's padding must be zero.
  thread_local std::vector<float> gate_up_buffer, y_buffer;
  thread_local std::vector<at::BFloat16> act_buffer;
  std::vector<float>& gate_up = gate_up_buffer;
  std::vector<float>& y = y_buffer;
  std::vector<at::BFloat16>& act = act_buffer;
  gate_up.resize(tokens * up_width);
  y.resize(tokens * down_width);
  assign_zeros(act, padded * kp_inter);
  const bool parallel = worth_threads(tokens, 2 * inter, hidden);
  const at::BFloat16* w13p = w13.data_ptr<at::BFloat16>();
  const at::BFloat16* w2p = w2.data_ptr<at::BFloat16>();
  at::parallel_for(0, up_groups, parallel ? 1 : up_groups, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t g = begin; g < end; ++g) {
      amx_group(xp, tokens, kp_hidden, w13p + g * 4 * w13.size(1) * kTileK * kTileN, w13.size(1), gate_up.data() + g * kGroupN, up_width);
    }
    release_tiles();
  });
  at::parallel_for(0, tokens, parallel ? kActRowsGrain : tokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) swiglu_act(gate_up.data() + t * up_width, inter, act.data() + t * kp_inter);
  });
  at::parallel_for(0, down_groups, parallel ? 1 : down_groups, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t g = begin; g < end; ++g) {
      amx_group(act.data(), tokens, kp_inter, w2p + g * 4 * kb_inter * kTileK * kTileN, kb_inter, y.data() + g * kGroupN, down_width);
    }
    release_tiles();
  });
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < tokens; ++t) store_bf16(op + t * hidden, y.data() + t * down_width, nullptr, hidden);
  return out;
}

// Routed SwiGLU experts of a bfloat16 model in one call: tokens grouped by expert, each expert's
// gate/up and down products on AMX tiles (amx_group), silu(gate) * up rounded to bfloat16 between
// them as the PyTorch path rounds, and each token's expert outputs weighted and summed in float32
// in ascending expert id. Every (token, expert) row is computed alone: the same bits at any batch.
at::Tensor moe_routed_experts(const at::Tensor& x, const at::Tensor& w13_all, const at::Tensor& w2_all,
                              const at::Tensor& weights, const at::Tensor& ids, int64_t inter) {
  TORCH_CHECK(tile_kernels_supported(), "moe_routed_experts: this CPU or build has neither AMX nor AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "moe_routed_experts: bfloat16 x [T, D]");
  TORCH_CHECK(w13_all.dim() == 6 && w2_all.dim() == 6 && w13_all.size(0) == w2_all.size(0) && w13_all.is_contiguous() &&
                  w2_all.is_contiguous(),
              "moe_routed_experts: every expert's packed w13 and w2 stacked, [E, ...] each");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = w13_all.size(0);
  const at::Tensor w13_first = w13_all[0], w2_first = w2_all[0];
  check_packed(w13_first, hidden, 2 * inter, "moe_routed_experts w13");
  check_packed(w2_first, inter, hidden, "moe_routed_experts w2");
  const at::BFloat16* w13_base = w13_all.data_ptr<at::BFloat16>();
  const at::BFloat16* w2_base = w2_all.data_ptr<at::BFloat16>();
  const int64_t w13_stride = w13_all.stride(0), w2_stride = w2_all.stride(0);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong && weights.sizes() == ids.sizes() &&
                  ids.dim() == 2 && ids.size(0) == tokens,
              "moe_routed_experts: float32 weights and int64 ids, both [T, k]");
  const at::Tensor xc = x.contiguous(), wc = weights.contiguous(), ic = ids.contiguous();
  const int64_t top_k = ids.size(1), assigned = tokens * top_k;
  const int64_t* idp = ic.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  // Assignments grouped by expert, tokens in order within each (a counting sort); each expert's
  // rows start on a whole tile in the padded buffers.
  std::vector<int64_t> count(experts, 0), order(assigned), tile_start(experts + 1, 0);
  for (int64_t a = 0; a < assigned; ++a) {
    TORCH_CHECK(idp[a] >= 0 && idp[a] < experts, "moe_routed_experts: expert id ", idp[a], " out of range");
    ++count[idp[a]];
  }
  std::vector<int64_t> first(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    first[e + 1] = first[e] + count[e];
    tile_start[e + 1] = tile_start[e] + (count[e] + kTileRows - 1) / kTileRows * kTileRows;
  }
  {
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t a = 0; a < assigned; ++a) order[fill[idp[a]]++] = a;
  }
  const int64_t kb_hidden = w13_first.size(1), kb_inter = w2_first.size(1);
  const int64_t kp_hidden = kb_hidden * kTileK, kp_inter = kb_inter * kTileK, padded_rows = tile_start[experts];
  // Scratch of this thread, kept between calls; the inputs' padding must be zero, the outputs'
  // rows are written before they are read.
  thread_local std::vector<at::BFloat16> x_pad, act;
  thread_local std::vector<float> gate_up, expert_out;
  assign_zeros(x_pad, padded_rows * kp_hidden);
  assign_zeros(act, padded_rows * kp_inter);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = 0; r < count[e]; ++r) {
      std::memcpy(x_pad.data() + (tile_start[e] + r) * kp_hidden, xp + (order[first[e] + r] / top_k) * hidden,
                  hidden * sizeof(at::BFloat16));
    }
  }
  const int64_t up_groups = w13_first.size(0) / 4, down_groups = w2_first.size(0) / 4;
  const int64_t up_width = up_groups * kGroupN, down_width = down_groups * kGroupN;
  gate_up.resize(padded_rows * up_width);
  expert_out.resize(padded_rows * down_width);
  const bool parallel = worth_threads(assigned, 2 * inter, hidden);
  // Work items are (active expert, column group), so the threads split the experts in use evenly.
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e]) active.push_back(e);
  }
  const int64_t num_active = static_cast<int64_t>(active.size());
  // out rows (width out_width) of every expert's rows of x (k_blocks tiles of k) times its weight
  auto run_experts = [&](const at::BFloat16* x, int64_t k_blocks, const at::BFloat16* w_base, int64_t w_stride, int64_t n_groups,
                         float* out, int64_t out_width) {
    at::parallel_for(0, num_active * n_groups, parallel ? 1 : num_active * n_groups, [&](int64_t begin, int64_t end) {
      configure_tiles();
      for (int64_t item = begin; item < end; ++item) {
        const int64_t e = active[item / n_groups], g = item % n_groups;
        amx_group(x + tile_start[e] * k_blocks * kTileK, count[e], k_blocks * kTileK,
                  w_base + e * w_stride + g * 4 * k_blocks * kTileK * kTileN, k_blocks, out + tile_start[e] * out_width + g * kGroupN,
                  out_width);
      }
      release_tiles();
    });
  };
  run_experts(x_pad.data(), kb_hidden, w13_base, w13_stride, up_groups, gate_up.data(), up_width);
  // Rows of every expert, padding rows skipped (their act stays zero). The buffers are this
  // thread's: the workers reach them through pointers.
  const float* gate_up_rows = gate_up.data();
  at::BFloat16* act_rows = act.data();
  at::parallel_for(0, padded_rows, parallel ? kActRowsGrain : padded_rows, [&](int64_t begin, int64_t end) {
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t row = std::max(begin, tile_start[e]); row < std::min(end, tile_start[e] + count[e]); ++row) {
        swiglu_act(gate_up_rows + row * up_width, inter, act_rows + row * kp_inter);
      }
    }
  });
  run_experts(act.data(), kb_inter, w2_base, w2_stride, down_groups, expert_out.data(), down_width);
  // where each assignment's output row is
  std::vector<int64_t> row_of(assigned);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = 0; r < count[e]; ++r) row_of[order[first[e] + r]] = tile_start[e] + r;
  }
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float* expert_rows = expert_out.data();
  at::parallel_for(0, tokens, parallel ? kActRowsGrain : tokens, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden);
    std::vector<at::BFloat16> rounded_bf16(hidden);
    std::vector<int64_t> by_id(top_k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < top_k; ++k) by_id[k] = k;
      std::sort(by_id.begin(), by_id.end(), [&](int64_t a, int64_t b) { return idp[t * top_k + a] < idp[t * top_k + b]; });
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k : by_id) {
        const float w = static_cast<float>(at::BFloat16(wp[t * top_k + k]));
        const float* y = expert_rows + row_of[t * top_k + k] * down_width;
        store_bf16(rounded_bf16.data(), y, nullptr, hidden);  // the expert's bfloat16 output
        axpy(acc.data(), w, rounded_bf16.data(), hidden);
      }
      store_bf16(op + t * hidden, acc.data(), nullptr, hidden);
    }
  });
  return out;
}

// f() inside a profiler range called ``name``: the decoder stack calls its kernels directly, not
// through the dispatcher, so without these ranges torch.profiler sees one opaque call per forward.
// With no profiler running a range costs a flag check.
template <typename F>
auto traced(const char* name, F&& f) {
  RECORD_USER_SCOPE(name);
  return f();
}

// The weights of one DeepSeek-V3 decoder layer in the forms the kernels above take (AMX tile
// copies for every bfloat16 matrix), for DecoderStack.
struct StackLayer {
  at::Tensor input_norm, post_norm, kv_a_norm;
  at::Tensor hidden_norm;  // the EAGLE-3 midlayer's norm of the fed-back hidden (undefined otherwise)
  at::Tensor first;  // packed [q_a; kv_a] (with q_lora) or kv_a: the down-projections of x
  c10::optional<at::Tensor> first_bias;
  at::Tensor q_proj, q_a_norm;  // q_proj: packed q_b_proj (with q_lora) or q_proj
  at::Tensor w_uk, w_uv_t;
  c10::optional<at::Tensor> uk_packed, uv_packed;
  at::Tensor o_proj;
  c10::optional<at::Tensor> o_bias;
  at::Tensor mlp_w13, mlp_w2;  // the dense SwiGLU, or the shared experts of a MoE layer (if any)
  int64_t mlp_inter = 0;
  bool moe = false;
  at::Tensor router_weight, router_bias, experts_w13, experts_w2;
  int64_t expert_inter = 0;
};

c10::optional<at::Tensor> optional_entry(const c10::Dict<std::string, at::Tensor>& weights, const std::string& name) {
  return weights.contains(name) ? c10::optional<at::Tensor>(weights.at(name)) : c10::nullopt;
}

// A DeepSeek-V3 model's decoder layers run in one call per forward, for batches whose attention
// takes the absorbed form: the sequence of kernels that DecoderLayer.forward calls through
// RMSNorm, MLAAttention, FusedCPUMLABackend, MoE and SwiGLU, the same kernels on the same inputs
// (so the same bits), without the Python in between (eaglet/kernels/decoder_stack.py).
struct DecoderStack : torch::CustomClassHolder {
  int64_t hidden, heads, nope, rope, value, latent, q_lora, top_k, n_group, topk_group;
  bool norm_topk_prob, interleave;
  double eps, scaling, routed_scaling;
  std::vector<StackLayer> layers;

  // ints: hidden, heads, qk_nope, qk_rope, v_head, kv_lora, q_lora (0: none), top_k, n_group,
  // topk_group, norm_topk_prob, rope_interleave; floats: rms eps, softmax scale, routed scaling.
  DecoderStack(std::vector<int64_t> ints, std::vector<double> floats) {
    TORCH_CHECK(ints.size() == 12 && floats.size() == 3, "DecoderStack: 12 ints and 3 floats");
    hidden = ints[0], heads = ints[1], nope = ints[2], rope = ints[3], value = ints[4], latent = ints[5], q_lora = ints[6];
    top_k = ints[7], n_group = ints[8], topk_group = ints[9], norm_topk_prob = ints[10] != 0, interleave = ints[11] != 0;
    eps = floats[0], scaling = floats[1], routed_scaling = floats[2];
  }

  // weights by role (see StackLayer); sizes: mlp_inter (dense or shared; 0: no shared experts), expert_inter (0: dense layer).
  void add_layer(c10::Dict<std::string, at::Tensor> weights, std::vector<int64_t> sizes) {
    TORCH_CHECK(sizes.size() == 2, "DecoderStack.add_layer: sizes are [mlp_inter, expert_inter]");
    StackLayer layer;
    layer.input_norm = weights.at("input_norm");
    layer.post_norm = weights.at("post_norm");
    layer.kv_a_norm = weights.at("kv_a_norm");
    if (weights.contains("hidden_norm")) layer.hidden_norm = weights.at("hidden_norm");
    layer.first = weights.at("first");
    layer.first_bias = optional_entry(weights, "first_bias");
    layer.q_proj = weights.at("q_proj");
    if (q_lora) layer.q_a_norm = weights.at("q_a_norm");
    layer.w_uk = weights.at("w_uk");
    layer.w_uv_t = weights.at("w_uv_t");
    layer.uk_packed = optional_entry(weights, "uk_packed");
    layer.uv_packed = optional_entry(weights, "uv_packed");
    layer.o_proj = weights.at("o_proj");
    layer.o_bias = optional_entry(weights, "o_bias");
    layer.mlp_inter = sizes[0];
    layer.expert_inter = sizes[1];
    layer.moe = sizes[1] > 0;
    if (layer.mlp_inter) {
      layer.mlp_w13 = weights.at("mlp_w13");
      layer.mlp_w2 = weights.at("mlp_w2");
    }
    if (layer.moe) {
      layer.router_weight = weights.at("router_weight");
      layer.router_bias = weights.at("router_bias");
      layer.experts_w13 = weights.at("experts_w13");
      layer.experts_w2 = weights.at("experts_w2");
    }
    TORCH_CHECK(layer.moe || layer.mlp_inter, "DecoderStack.add_layer: a layer needs a dense MLP or experts");
    layers.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // hidden [T, D] bfloat16 in; returns [final hidden (before the model's norm), then the hidden
  // after each layer of capture_layers, ascending]. kv: the pool [layers, slots, L + R]; the rest
  // is mla_absorbed_attention's metadata, the same for every layer.
  std::vector<at::Tensor> forward(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor out_cache_loc,
                                  at::Tensor slots, at::Tensor kv_lens, at::Tensor token_starts,
                                  c10::optional<at::Tensor> custom_mask, std::vector<int64_t> capture_layers) {
    check_inputs(h, kv);
    std::vector<at::Tensor> out{at::Tensor()};
    for (int64_t i = 0; i < num_layers(); ++i) {
      const StackLayer& l = layers[i];
      h = layer_forward(l, i, rms_norm(h, l.input_norm, eps), h, cos, sin, kv, out_cache_loc, slots, kv_lens, token_starts, custom_mask);
      if (std::find(capture_layers.begin(), capture_layers.end(), i) != capture_layers.end()) out.push_back(h);
    }
    out[0] = h;
    return out;
  }

  // The EAGLE-3 midlayer (a stack of one layer added with a "hidden_norm"): attention reads
  // cat(input_norm(emb), hidden_norm(h)), h is the residual. Returns the layer's output.
  at::Tensor forward_eagle3(at::Tensor emb, at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor out_cache_loc,
                            at::Tensor slots, at::Tensor kv_lens, at::Tensor token_starts, c10::optional<at::Tensor> custom_mask) {
    TORCH_CHECK(num_layers() == 1 && layers[0].hidden_norm.defined(), "DecoderStack.forward_eagle3: a stack of one EAGLE-3 midlayer");
    TORCH_CHECK(emb.sizes() == h.sizes() && emb.scalar_type() == h.scalar_type(), "DecoderStack.forward_eagle3: emb and hidden differ in shape");
    check_inputs(h, kv);
    const StackLayer& l = layers[0];
    const at::Tensor x = at::cat({rms_norm(emb, l.input_norm, eps), rms_norm(h, l.hidden_norm, eps)}, -1);
    return layer_forward(l, 0, x, h, cos, sin, kv, out_cache_loc, slots, kv_lens, token_starts, custom_mask);
  }

  // A draft extend in one call, as Eagle3Draft.forward (target features in, no fc_norm) and
  // EagleWorker._set_draft_states do it: fc over the features, the midlayer over the ragged batch,
  // then at the flat rows `logits_rows` the final norm and the lm_head: with k == 1 its first
  // maximal logit (amx_linear_argmax), else the k largest log-probabilities (topk_logprobs over the
  // float32 logits), d2t applied. The results go to row state_rows[r] of the worker's state
  // tables: state_tokens [rows, >= k] (first k columns), state_logprobs [rows, >= k] float32
  // (k > 1 only) and state_hidden [rows, H] (the hidden fed to the next step). rope_table
  // [> max(positions), 2, R / 2]. With feature_rows [T], token t reads features[feature_rows[t]]
  // (a round's commit: the verify's features of each accepted path's nodes).
  void extend_proposals(at::Tensor ids, at::Tensor features, at::Tensor fc, int64_t fc_out, at::Tensor embed,
                        at::Tensor rope_table, at::Tensor positions, at::Tensor norm_weight, double norm_eps,
                        at::Tensor lm_head, int64_t vocab, c10::optional<at::Tensor> lm_head_bias, at::Tensor d2t,
                        bool norm_output, at::Tensor logits_rows, int64_t k, at::Tensor state_rows, at::Tensor state_tokens,
                        at::Tensor state_logprobs, at::Tensor state_hidden, at::Tensor kv, at::Tensor out_cache_loc,
                        at::Tensor slots, at::Tensor kv_lens, at::Tensor token_starts, c10::optional<at::Tensor> custom_mask,
                        c10::optional<at::Tensor> feature_rows) {
    if (feature_rows) features = features.index_select(0, *feature_rows);
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && positions.sizes() == ids.sizes() &&
                    positions.scalar_type() == at::kLong && logits_rows.dim() == 1 && logits_rows.scalar_type() == at::kLong &&
                    d2t.scalar_type() == at::kLong && state_rows.sizes() == logits_rows.sizes() &&
                    state_rows.scalar_type() == at::kLong,
                "DecoderStack.extend_proposals: int64 ids [T], positions [T], logits_rows [R], state_rows [R] and d2t");
    TORCH_CHECK(features.dim() == 2 && features.size(0) == ids.size(0), "DecoderStack.extend_proposals: features [T, F]");
    TORCH_CHECK(rope_table.dim() == 3 && rope_table.size(1) == 2, "DecoderStack.extend_proposals: rope_table [P, 2, R / 2]");
    const int64_t table_rows = state_tokens.size(0);
    TORCH_CHECK(k >= 1 && state_tokens.dim() == 2 && state_tokens.scalar_type() == at::kLong && state_tokens.size(1) >= k &&
                    state_tokens.is_contiguous() && state_logprobs.dim() == 2 && state_logprobs.size(0) == table_rows &&
                    state_logprobs.scalar_type() == at::kFloat && state_logprobs.size(1) >= k && state_logprobs.is_contiguous() &&
                    state_hidden.dim() == 2 && state_hidden.size(0) == table_rows && state_hidden.size(1) == hidden &&
                    state_hidden.scalar_type() == at::kBFloat16 && state_hidden.is_contiguous(),
                "DecoderStack.extend_proposals: contiguous state tables: int64 tokens and float32 logprobs [rows, >= ", k,
                "], bfloat16 hidden [rows, ", hidden, "]");
    const at::Tensor h = amx_linear(features, fc, fc_out, c10::nullopt);
    const at::Tensor cos_sin = rope_table.index_select(0, positions);
    const at::Tensor out = forward_eagle3(embed.index_select(0, ids), h, cos_sin.select(1, 0), cos_sin.select(1, 1), kv,
                                          out_cache_loc, slots, kv_lens, token_starts, custom_mask);
    const at::Tensor rows = out.index_select(0, logits_rows);
    const at::Tensor normed = rms_norm(rows, norm_weight, norm_eps);
    at::Tensor top_ids, top_logprobs;
    if (k == 1) {
      const at::Tensor draft_ids = amx_linear_argmax(normed, lm_head, vocab, lm_head_bias);
      top_ids = draft_ids + d2t.index_select(0, draft_ids);
    } else {
      const std::vector<at::Tensor> top = topk_logprobs(amx_linear(normed, lm_head, vocab, lm_head_bias, true), k, d2t);
      top_logprobs = top[0];
      top_ids = top[1];
    }
    const at::Tensor hidden_out = (norm_output ? normed : rows).contiguous();
    const at::Tensor state_rows_c = state_rows.contiguous();
    const int64_t* sr = state_rows_c.data_ptr<int64_t>();
    const int64_t* tp = top_ids.data_ptr<int64_t>();
    const float* lp = k > 1 ? top_logprobs.data_ptr<float>() : nullptr;
    const int64_t token_width = state_tokens.size(1), logprob_width = state_logprobs.size(1);
    for (int64_t r = 0; r < state_rows_c.size(0); ++r) {
      const int64_t row = sr[r];
      TORCH_CHECK(row >= 0 && row < table_rows, "DecoderStack.extend_proposals: state row ", row, " out of range");
      std::copy_n(tp + r * k, k, state_tokens.data_ptr<int64_t>() + row * token_width);
      if (lp) std::copy_n(lp + r * k, k, state_logprobs.data_ptr<float>() + row * logprob_width);
      std::memcpy(state_hidden.data_ptr<at::BFloat16>() + row * hidden, hidden_out.data_ptr<at::BFloat16>() + r * hidden,
                  hidden * sizeof(at::BFloat16));
    }
  }

  // Top-1 drafting of a speculative round in one call: `steps` midlayer forwards, step s (from 1)
  // feeding each request its previous token and fed-back hidden at position prefix + s - 1, which
  // is also the row index its draft entry is written to; it sees row indices < prefix + s (a chain's
  // causal mask). Then the final norm, lm_head, the first maximal logit (argmax) and d2t, as
  // Eagle3Draft.forward and EagleWorker._draft_chain do per step, with the same kernels on the same
  // inputs. Request b's step-0 token, fed-back hidden and cache slots by row index are row
  // state_rows[b] of the worker's tables: state_tokens [R, k] (column 0), state_hidden [R, H],
  // req_to_token [R, >= max(prefix) + steps] (gathered here: three tensor ops fewer in each
  // round's Python); rope_table [positions, 2, R / 2]: cos and sin per position. With final_ids
  // [B, S] (-1 pads), drafting stops once every request's chain holds one of its final ids (tokens
  // that would end it: later drafts are never kept). Returns the chain [B, steps + 2] (shorter
  // where it stopped): the roots, the tokens, then the drafted target ids.
  at::Tensor draft_chain(at::Tensor roots, at::Tensor state_rows, at::Tensor state_tokens, at::Tensor state_hidden,
                         at::Tensor embed, at::Tensor rope_table, at::Tensor norm_weight, double norm_eps, at::Tensor lm_head,
                         int64_t vocab, c10::optional<at::Tensor> lm_head_bias, at::Tensor d2t, bool norm_output, at::Tensor kv,
                         at::Tensor req_to_token, at::Tensor prefix, int64_t steps, c10::optional<at::Tensor> final_ids) {
    const int64_t batch = state_rows.size(0);
    TORCH_CHECK(state_rows.dim() == 1 && state_rows.scalar_type() == at::kLong && prefix.sizes() == state_rows.sizes() &&
                    roots.sizes() == state_rows.sizes() && roots.scalar_type() == at::kLong && prefix.scalar_type() == at::kLong &&
                    d2t.scalar_type() == at::kLong,
                "DecoderStack.draft_chain: int64 roots [B], state_rows [B], prefix [B] and d2t");
    TORCH_CHECK(state_tokens.dim() == 2 && state_tokens.size(1) >= 1 && state_tokens.scalar_type() == at::kLong &&
                    state_hidden.dim() == 2 && req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong,
                "DecoderStack.draft_chain: int64 state_tokens [R, k], state_hidden [R, H], int64 req_to_token [R, W]");
    TORCH_CHECK(rope_table.dim() == 3 && rope_table.size(1) == 2 && steps >= 1, "DecoderStack.draft_chain: rope_table [P, 2, R / 2]");
    const at::Tensor prefix_c = prefix.contiguous();
    const int64_t* pp = prefix_c.data_ptr<int64_t>();
    const int64_t max_prefix = largest_prefix(pp, batch, "DecoderStack.draft_chain");
    const at::Tensor tokens = state_tokens.select(1, 0).index_select(0, state_rows);
    at::Tensor h = state_hidden.index_select(0, state_rows);
    const at::Tensor row_slots = table_rows(req_to_token, state_rows, max_prefix + steps);
    TORCH_CHECK(row_slots.size(1) >= max_prefix + steps && rope_table.size(0) >= max_prefix + steps,
                "DecoderStack.draft_chain: req_to_token or rope_table too short for ", steps, " steps");
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == hidden && embed.scalar_type() == h.scalar_type(),
                "DecoderStack.draft_chain: embeddings [V, ", hidden, "] in the hidden's dtype");
    // Each step's inputs are written in place (ids, positions, slots, embedding and rotary rows):
    // at one row per request, a step's tensor ops would cost more than its cache write and rotary.
    const auto longs = prefix_c.options();
    const at::Tensor token_starts = at::arange(batch + 1, longs);
    const at::Tensor slots_c = row_slots.contiguous(), embed_c = embed.contiguous(), table_c = rope_table.contiguous();
    const at::Tensor d2t_c = d2t.contiguous();
    at::Tensor chain = at::empty({batch, steps + 2}, longs);
    at::Tensor out_cache_loc = at::empty({batch}, longs), kv_lens = at::empty({batch}, longs);
    at::Tensor emb = at::empty({batch, hidden}, embed_c.options());
    at::Tensor cos_sin = at::empty({batch, 2, table_c.size(2)}, table_c.options());
    int64_t* cp = chain.data_ptr<int64_t>();
    const at::Tensor roots_c = roots.contiguous(), tokens_c = tokens.contiguous();
    for (int64_t b = 0; b < batch; ++b) {
      cp[b * (steps + 2)] = roots_c.data_ptr<int64_t>()[b];
      cp[b * (steps + 2) + 1] = tokens_c.data_ptr<int64_t>()[b];
    }
    const int64_t* sp = slots_c.data_ptr<int64_t>();
    const int64_t* d2tp = d2t_c.data_ptr<int64_t>();
    const int64_t embed_row = embed_c.stride(0) * embed_c.element_size(), table_row = table_c.stride(0) * table_c.element_size();
    const char* embed_base = static_cast<const char*>(embed_c.data_ptr());
    const char* table_base = static_cast<const char*>(table_c.data_ptr());
    at::Tensor finals;
    if (final_ids) {
      finals = final_ids->contiguous();
      TORCH_CHECK(finals.dim() == 2 && finals.size(0) == batch && finals.scalar_type() == at::kLong,
                  "DecoderStack.draft_chain: int64 final_ids [B, S]");
    }
    std::vector<char> ended(batch, 0);
    // Whether every request's chain now holds a final id (its token at chain column `column`, or before).
    auto all_ended = [&](int64_t column) {
      if (!final_ids) return false;
      bool all = true;
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t* own = finals.data_ptr<int64_t>() + b * finals.size(1);
        ended[b] = ended[b] || std::find(own, own + finals.size(1), cp[b * (steps + 2) + column]) != own + finals.size(1);
        all = all && ended[b];
      }
      return all;
    };
    int64_t drafted = steps;
    if (all_ended(1)) drafted = 0;
    for (int64_t s = 1; s <= drafted; ++s) {
      int64_t *loc = out_cache_loc.data_ptr<int64_t>(), *lens = kv_lens.data_ptr<int64_t>();
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t position = pp[b] + s - 1, current = cp[b * (steps + 2) + s];
        TORCH_CHECK(current >= 0 && current < embed_c.size(0), "DecoderStack.draft_chain: token id ", current, " out of range");
        loc[b] = sp[b * slots_c.size(1) + position];
        lens[b] = pp[b] + s;
        std::memcpy(static_cast<char*>(emb.data_ptr()) + b * hidden * emb.element_size(), embed_base + current * embed_row,
                    hidden * emb.element_size());
        std::memcpy(static_cast<char*>(cos_sin.data_ptr()) + b * table_row, table_base + position * table_row, table_row);
      }
      const at::Tensor out = forward_eagle3(emb, h, cos_sin.select(1, 0), cos_sin.select(1, 1), kv, out_cache_loc,
                                            slots_c.narrow(1, 0, max_prefix + s), kv_lens, token_starts, c10::nullopt);
      const at::Tensor normed = rms_norm(out, norm_weight, norm_eps);
      const at::Tensor draft_ids = amx_linear_argmax(normed, lm_head, vocab, lm_head_bias);
      const int64_t* ids = draft_ids.data_ptr<int64_t>();
      for (int64_t b = 0; b < batch; ++b) {
        TORCH_CHECK(ids[b] < d2t_c.size(0), "DecoderStack.draft_chain: d2t [", d2t_c.size(0), "] shorter than the lm_head");
        cp[b * (steps + 2) + s + 1] = ids[b] + d2tp[ids[b]];
      }
      h = norm_output ? normed : out;
      if (s < drafted && all_ended(s + 1)) drafted = s;
    }
    if (drafted < steps) return chain.narrow(1, 0, drafted + 2).contiguous();
    return chain;
  }

  // EAGLE-2 tree drafting of a speculative round in one call (EagleWorker._draft_tree's loop, then
  // select_draft_tree): the k frontier candidates of each request (tokens / scores: the last draft
  // extend's top k and their log-probabilities, all fed its hidden; request b's are row
  // state_rows[b] of the worker's tables state_tokens / state_logprobs [R, >= k] and state_hidden
  // [R, H]) expand for steps - 1 midlayer forwards. Step s writes frontier node f of request b at
  // row index prefix + (s - 1) * k + f, position prefix + s - 1, seeing row indices below prefix and
  // its own ancestors' (the scratch rows of the nodes it descends from); its top k children score the
  // parent's score plus their log-probability (topk_logprobs over the lm_head logits, d2t applied),
  // and the k best children (the earlier first among equal scores) are the next frontier, fed their
  // parent's hidden out. Same kernels on the same inputs as the per-step Eagle3Draft.forward.
  // Cache slots by row index: row state_rows[b] of req_to_token [R, >= max(prefix) + (steps - 1) * k].
  // Returns select_draft_tree's [tokens, parents, depths] of num_nodes nodes, the roots first.
  std::vector<at::Tensor> draft_tree(at::Tensor roots, at::Tensor state_rows, at::Tensor state_tokens, at::Tensor state_logprobs,
                                     int64_t k, at::Tensor state_hidden, at::Tensor embed, at::Tensor rope_table, at::Tensor norm_weight,
                                     double norm_eps, at::Tensor lm_head, int64_t vocab, c10::optional<at::Tensor> lm_head_bias,
                                     at::Tensor d2t, bool norm_output, at::Tensor kv, at::Tensor req_to_token, at::Tensor prefix,
                                     int64_t steps, int64_t num_nodes) {
    const int64_t batch = state_rows.size(0);
    TORCH_CHECK(state_tokens.dim() == 2 && k >= 1 && state_tokens.size(1) >= k && state_tokens.scalar_type() == at::kLong &&
                    state_logprobs.sizes() == state_tokens.sizes() && state_logprobs.scalar_type() == at::kFloat,
                "DecoderStack.draft_tree: int64 state_tokens and float32 state_logprobs [R, >= k]");
    TORCH_CHECK(state_rows.dim() == 1 && state_rows.scalar_type() == at::kLong && roots.sizes() == state_rows.sizes() &&
                    roots.scalar_type() == at::kLong && prefix.sizes() == state_rows.sizes() && prefix.scalar_type() == at::kLong &&
                    d2t.scalar_type() == at::kLong,
                "DecoderStack.draft_tree: int64 roots [B], state_rows [B], prefix [B] and d2t");
    TORCH_CHECK(state_hidden.dim() == 2 && req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong,
                "DecoderStack.draft_tree: state_hidden [R, H], int64 req_to_token [R, W]");
    TORCH_CHECK(rope_table.dim() == 3 && rope_table.size(1) == 2 && steps >= 1, "DecoderStack.draft_tree: rope_table [P, 2, R / 2]");
    const int64_t scratch = (steps - 1) * k, num_candidates = k + scratch * k;
    const at::Tensor prefix_c = prefix.contiguous();
    const int64_t* pp = prefix_c.data_ptr<int64_t>();
    const int64_t max_prefix = largest_prefix(pp, batch, "DecoderStack.draft_tree");
    const at::Tensor tokens = state_tokens.narrow(1, 0, k).index_select(0, state_rows);
    const at::Tensor scores = state_logprobs.narrow(1, 0, k).index_select(0, state_rows);
    const at::Tensor h = state_hidden.index_select(0, state_rows);
    const at::Tensor row_slots = table_rows(req_to_token, state_rows, max_prefix + scratch);
    TORCH_CHECK(row_slots.size(1) >= max_prefix + scratch && rope_table.size(0) >= max_prefix + steps,
                "DecoderStack.draft_tree: req_to_token or rope_table too short for ", steps, " steps of ", k);
    TORCH_CHECK(num_nodes >= 1 && num_nodes - 1 <= num_candidates, "DecoderStack.draft_tree: ", num_nodes, " nodes from ",
                num_candidates, " candidates");
    const auto longs = prefix_c.options();
    // Every candidate of the round: the first k are the frontier of step 1 (parent: the root).
    at::Tensor cand_tokens = at::empty({batch, num_candidates}, longs), cand_parents = at::empty({batch, num_candidates}, longs);
    at::Tensor cand_scores = at::empty({batch, num_candidates}, longs.dtype(at::kFloat));
    at::Tensor cand_depths = at::empty({num_candidates}, longs);
    int64_t *ct = cand_tokens.data_ptr<int64_t>(), *cp = cand_parents.data_ptr<int64_t>(), *cd = cand_depths.data_ptr<int64_t>();
    float* cs = cand_scores.data_ptr<float>();
    const at::Tensor tokens_c = tokens.contiguous(), scores_c = scores.contiguous();
    // The frontier: k nodes per request, their candidate ids and, per scratch row, whether it holds an ancestor-or-self.
    std::vector<int64_t> frontier_tokens(tokens_c.data_ptr<int64_t>(), tokens_c.data_ptr<int64_t>() + batch * k);
    std::vector<float> frontier_scores(scores_c.data_ptr<float>(), scores_c.data_ptr<float>() + batch * k);
    std::vector<int64_t> frontier_ids(batch * k);
    std::vector<char> ancestry(batch * k * std::max<int64_t>(scratch, 1), 0), next_ancestry(ancestry.size());
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t f = 0; f < k; ++f) {
        ct[b * num_candidates + f] = frontier_tokens[b * k + f];
        cs[b * num_candidates + f] = frontier_scores[b * k + f];
        cp[b * num_candidates + f] = -1;
        frontier_ids[b * k + f] = f;
      }
    }
    std::fill(cd, cd + k, 1);
    const int64_t rows = batch * k;
    at::Tensor hidden = h.repeat_interleave(k, 0);  // [B * k, H]: every frontier node starts from the request's hidden
    at::Tensor positions = at::empty({rows}, longs), out_cache_loc = at::empty({rows}, longs), kv_lens = at::empty({batch}, longs);
    at::Tensor input_ids = at::empty({rows}, longs);
    const at::Tensor token_starts = at::arange(0, rows + 1, k, longs);
    const at::Tensor slots_c = row_slots.contiguous();
    const int64_t* sp = slots_c.data_ptr<int64_t>();
    const int64_t slot_width = slots_c.size(1);
    std::vector<int64_t> best(k);
    int64_t count = k;
    for (int64_t s = 1; s < steps; ++s) {
      const int64_t first = (s - 1) * k, num_keys = max_prefix + s * k;
      at::Tensor mask = at::zeros({rows, num_keys}, longs.dtype(at::kBool));
      bool* mp = mask.data_ptr<bool>();
      int64_t *pos = positions.data_ptr<int64_t>(), *loc = out_cache_loc.data_ptr<int64_t>(), *ids = input_ids.data_ptr<int64_t>();
      for (int64_t b = 0; b < batch; ++b) {
        kv_lens.data_ptr<int64_t>()[b] = pp[b] + s * k;
        for (int64_t f = 0; f < k; ++f) {
          const int64_t t = b * k + f;
          char* anc = ancestry.data() + t * scratch;
          anc[first + f] = 1;
          pos[t] = pp[b] + s - 1;
          loc[t] = sp[b * slot_width + pp[b] + first + f];
          ids[t] = frontier_tokens[t];
          bool* row = mp + t * num_keys;
          std::fill(row, row + pp[b], true);
          for (int64_t j = 0; j < s * k; ++j) row[pp[b] + j] = anc[j];
        }
      }
      const at::Tensor cos_sin = rope_table.index_select(0, positions);
      const at::Tensor out = forward_eagle3(embed.index_select(0, input_ids), hidden, cos_sin.select(1, 0), cos_sin.select(1, 1), kv,
                                            out_cache_loc, row_slots.narrow(1, 0, num_keys), kv_lens, token_starts, mask);
      const at::Tensor normed = rms_norm(out, norm_weight, norm_eps);
      const at::Tensor logits = amx_linear(normed, lm_head, vocab, lm_head_bias, true);
      const std::vector<at::Tensor> top = topk_logprobs(logits, k, d2t);  // [B * k, k] each
      const float* tv = top[0].data_ptr<float>();
      const int64_t* ti = top[1].data_ptr<int64_t>();
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t f = 0; f < k; ++f) {
          for (int64_t c = 0; c < k; ++c) {
            const int64_t idx = b * num_candidates + count + f * k + c;
            ct[idx] = ti[(b * k + f) * k + c];
            cs[idx] = frontier_scores[b * k + f] + tv[(b * k + f) * k + c];
            cp[idx] = frontier_ids[b * k + f];
          }
        }
      }
      std::fill(cd + count, cd + count + k * k, s + 1);
      if (s == steps - 1) break;
      const at::Tensor out_hidden = norm_output ? normed : out;
      std::vector<int64_t> parent_rows(rows);
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t base = b * num_candidates + count;
        top_indices(cs + base, k * k, k, best.data());
        for (int64_t f = 0; f < k; ++f) {
          const int64_t t = b * k + f, parent = best[f] / k;
          frontier_tokens[t] = ct[base + best[f]];
          frontier_scores[t] = cs[base + best[f]];
          frontier_ids[t] = count + best[f];
          parent_rows[t] = b * k + parent;
          std::copy_n(ancestry.data() + (b * k + parent) * scratch, scratch, next_ancestry.data() + t * scratch);
        }
      }
      ancestry.swap(next_ancestry);
      hidden = out_hidden.index_select(0, at::tensor(parent_rows, longs));
      count += k * k;
    }
    return select_draft_tree(cand_tokens, cand_scores, cand_parents, cand_depths, roots, num_nodes);
  }

 private:
  void check_inputs(const at::Tensor& h, const at::Tensor& kv) const {
    TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden && h.scalar_type() == at::kBFloat16, "DecoderStack: bfloat16 hidden [T, ", hidden, "]");
    TORCH_CHECK(kv.dim() == 3 && kv.size(0) == num_layers(), "DecoderStack: cache pool [", num_layers(), ", slots, L + R]");
  }

  // One layer: h + attention(x), then + the MLP of its norm; x is the normed attention input.
  // Each step runs in a profiler range (traced), so torch.profiler shows where a forward's time goes.
  at::Tensor layer_forward(const StackLayer& l, int64_t index, const at::Tensor& x, at::Tensor h, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& kv, const at::Tensor& out_cache_loc, const at::Tensor& slots,
                           const at::Tensor& kv_lens, const at::Tensor& token_starts, const c10::optional<at::Tensor>& custom_mask) {
    const int64_t tokens = h.size(0), offset = q_lora ? q_lora : 0;
    const at::Tensor down = traced("eaglet.stack.down_proj", [&] { return amx_linear(x, l.first, offset + latent + rope, l.first_bias); });
    const at::Tensor q = traced("eaglet.stack.q_proj", [&] {
      const at::Tensor q_in = q_lora ? rms_norm(down.narrow(1, 0, q_lora), l.q_a_norm, eps) : x;
      return amx_linear(q_in, l.q_proj, heads * (nope + rope), c10::nullopt).view({tokens, heads, nope + rope});
    });
    at::Tensor layer_kv = kv.select(0, index);
    const at::Tensor q_pe = traced("eaglet.stack.rope_and_cache_write", [&] {
      const at::Tensor c_kv = rms_norm(down.narrow(1, offset, latent), l.kv_a_norm, eps);
      auto [q_rot, k_rot] = rope_query_key(q.narrow(2, nope, rope), down.narrow(1, offset + latent, rope), cos, sin, interleave);
      mla_cache_write(layer_kv, out_cache_loc, c_kv, k_rot);
      return q_rot;
    });
    const at::Tensor attn = traced("eaglet.stack.attention", [&] {
      return mla_absorbed_attention(q.narrow(2, 0, nope), q_pe, layer_kv, l.w_uk, l.w_uv_t, slots, kv_lens, token_starts,
                                    custom_mask, scaling, l.uk_packed, l.uv_packed);
    });
    h = traced("eaglet.stack.o_proj", [&] { return add_bf16(h, amx_linear(attn.view({tokens, heads * value}), l.o_proj, hidden, l.o_bias)); });
    const at::Tensor y = rms_norm(h, l.post_norm, eps);
    at::Tensor mlp;
    if (l.moe) {
      const auto route = traced("eaglet.stack.router", [&] {
        return noaux_route(y, l.router_weight, l.router_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling);
      });
      mlp = traced("eaglet.stack.routed_experts", [&] {
        return moe_routed_experts(y, l.experts_w13, l.experts_w2, std::get<0>(route), std::get<1>(route), l.expert_inter);
      });
      if (l.mlp_inter) mlp = traced("eaglet.stack.shared_experts", [&] { return add_bf16(mlp, amx_swiglu(y, l.mlp_w13, l.mlp_w2, l.mlp_inter)); });
    } else {
      mlp = traced("eaglet.stack.mlp", [&] { return amx_swiglu(y, l.mlp_w13, l.mlp_w2, l.mlp_inter); });
    }
    return add_bf16(h, mlp);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglet_info, m) {
  m.def("tile_backend", tile_backend);
}

TORCH_LIBRARY(eaglet, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<int64_t>, std::vector<double>>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward)
      .def("forward_eagle3", &DecoderStack::forward_eagle3)
      .def("extend_proposals", &DecoderStack::extend_proposals)
      .def("draft_chain", &DecoderStack::draft_chain)
      .def("draft_tree", &DecoderStack::draft_tree);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("argmax_last_dim(Tensor logits, Tensor? offsets=None) -> Tensor");
  m.def("topk_logprobs(Tensor logits, int k, Tensor? offsets=None) -> Tensor[]");
  m.def("verify_tree_greedy(Tensor tokens, Tensor parents, Tensor logits) -> Tensor");
  m.def("verify_tree_greedy_ids(Tensor tokens, Tensor parents, Tensor target_ids) -> Tensor");
  m.def("commit_table(Tensor verify_table, Tensor tokens, Tensor slots, Tensor prefix) -> Tensor[]");
  m.def("write_block_entries(Tensor(a!) req_to_token, Tensor blocks, int block_size) -> ()");
  m.def("copy_cache_slots(Tensor(a!) kv, Tensor src, Tensor dst) -> ()");
  m.def("scratch_slots(Tensor req_to_token, Tensor rows, Tensor prefix, int scratch) -> Tensor");
  m.def("select_draft_tree(Tensor tokens, Tensor scores, Tensor parents, Tensor depths, Tensor roots, int num_nodes) -> Tensor[]");
  m.def("tree_attention_mask(Tensor parents, Tensor prefix, int num_keys) -> Tensor");
  m.def("noaux_route(Tensor x, Tensor weight, Tensor bias, int top_k, int n_group, int topk_group, bool norm_topk_prob, float scaling) -> (Tensor, Tensor)");
  m.def("rope_query_key(Tensor q_pe, Tensor k_pe, Tensor cos, Tensor sin, bool interleave) -> (Tensor, Tensor)");
  m.def("mla_cache_write(Tensor(a!) kv, Tensor out_cache_loc, Tensor c_kv, Tensor k_pe) -> ()");
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_swiglu(Tensor x, Tensor w13, Tensor w2, int inter) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, int n, Tensor? bias, bool widened=False) -> Tensor");
  m.def("amx_linear_argmax(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("moe_routed_experts(Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids, int inter) -> Tensor");
  m.def("mla_absorbed_attention(Tensor q_nope, Tensor q_pe, Tensor kv, Tensor w_uk, Tensor w_uv_t, Tensor slots, Tensor kv_lens, Tensor token_starts, Tensor? custom_mask, float scale, Tensor? w_uk_packed=None, Tensor? w_uv_packed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(eaglet, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("argmax_last_dim", argmax_last_dim);
  m.impl("topk_logprobs", topk_logprobs);
  m.impl("verify_tree_greedy", verify_tree_greedy);
  m.impl("verify_tree_greedy_ids", verify_tree_greedy_ids);
  m.impl("commit_table", commit_table);
  m.impl("write_block_entries", write_block_entries);
  m.impl("copy_cache_slots", copy_cache_slots);
  m.impl("scratch_slots", scratch_slots);
  m.impl("select_draft_tree", select_draft_tree);
  m.impl("tree_attention_mask", tree_attention_mask);
  m.impl("noaux_route", noaux_route);
  m.impl("mla_absorbed_attention", mla_absorbed_attention);
  m.impl("moe_routed_experts", moe_routed_experts);
  m.impl("rope_query_key", rope_query_key);
  m.impl("mla_cache_write", mla_cache_write);
  m.impl("amx_pack_weight", amx_pack_weight);
  m.impl("amx_swiglu", amx_swiglu);
  m.impl("amx_linear", amx_linear);
  m.impl("amx_linear_argmax", amx_linear_argmax);
}
