// What the quantized-weight GEMMs (gemm_quant.cpp, gemm_int4_a8.cpp) share: the int4 chunk of 64
// k values, the fixed final reduction of 8 partial sums, the argument checks and the split of the
// N outputs over threads (never of a row's k, so a row's bits do not depend on the threads).
#pragma once

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EAGLET_QUANT_AVX2 1
#endif

namespace eaglet::quant {

constexpr int64_t kChunk = 64;  // int4: k values per step (8 words, one per lane)
constexpr int kRowsAtOnce = 4;  // x rows sharing each unpacked weight chunk
constexpr int64_t kColBlock = 4;  // weight rows a body call gets (the int4 kernel runs up to 4 at once)
constexpr int64_t kRowBlock = 64;  // x rows against which a thread's columns run before the next rows (a multiple of 4)

template <typename S>
inline float scale_at(const S* scales, int64_t g) { return static_cast<float>(scales[g]); }

// Per 32 k values (half a chunk), the index of their scale group, or -1 past K: the inner loops
// then read scales without a division (an integer division per chunk cost as much as its products).
inline std::vector<int32_t> half_chunk_groups(int64_t k, int64_t group) {
  const int64_t halves = 2 * ((k + kChunk - 1) / kChunk);
  std::vector<int32_t> out(halves);
  for (int64_t h = 0; h < halves; ++h) out[h] = 32 * h < k ? static_cast<int32_t>(32 * h / group) : -1;
  return out;
}

// The scales of a chunk's two halves for one weight row, lanes 0-3 and 4-7 (zero past K).
template <typename S>
inline void chunk_scales(const S* row_scales, const int32_t* half_group, int64_t c, float& lo, float& hi) {
  lo = scale_at(row_scales, half_group[2 * c]);
  hi = half_group[2 * c + 1] >= 0 ? scale_at(row_scales, half_group[2 * c + 1]) : 0.0f;
}

#if defined(EAGLET_QUANT_AVX2)
inline float reduce8(__m256 v) {
  // Fixed order: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 p = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

template <int NR, int NC>
inline void zero_sums(__m256 (&acc)[NR][NC]) {
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) acc[r][j] = _mm256_setzero_ps();
}

// out[r0 + r][j] = the lanes of acc[r][j] reduced in reduce8's order.
template <int NR, int NC>
inline void store_sums(const __m256 (&acc)[NR][NC], int64_t r0, float* out, int64_t out_stride) {
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) out[(r0 + r) * out_stride + j] = reduce8(acc[r][j]);
}

// Scales first .. first + 7 of a row as float32 (groups of 32: the scales of 4 chunks).
inline __m256 eight_scales(const at::BFloat16* row_scales, int64_t first) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_scales + first));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 eight_scales(const float* row_scales, int64_t first) { return _mm256_loadu_ps(row_scales + first); }

// Chunk q (0-3) of eight_scales' four: its two scales, lanes 0-3 and 4-7 (what chunk_scales reads).
inline __m256 chunk_of_four(__m256 four, int q) {
  return _mm256_permutevar8x32_ps(four, _mm256_add_epi32(_mm256_set1_epi32(2 * q), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
}

// Words w0 .. w0 + 7 of a codes row (fewer at the row's end: the rest read as zero nibbles, whose
// x values are zero too).
inline __m256i load_words(const int32_t* codes, int64_t w0, int64_t words) {
  if (w0 + 8 <= words) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + w0));
  alignas(32) int32_t tail[8] = {0};
  for (int64_t i = w0; i < words; ++i) tail[i - w0] = codes[i];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
}

// Asks for words w0 .. w0 + 7 of the row `rows_ahead` rows below (the same place in the next block
// of weight rows): a block's rows share a page or two, whose streams are too short for the hardware
// prefetcher to have them in cache in time. Prefetching never faults, even past the matrix's end.
inline void prefetch_ahead(const int32_t* codes, int64_t w0, int64_t words, int64_t rows_ahead) {
  _mm_prefetch(reinterpret_cast<const char*>(codes + rows_ahead * words + w0), _MM_HINT_T0);
}
#endif

// One row's k values as llama.cpp's Q8_0 quantizes them, per block of 32 (the last block padded
// with zeros): a float32 scale d = absmax / 127 and codes round(x * (1 / d)), ties to even.
inline void quantize_q8_0(const float* row, int64_t k, int64_t blocks, int8_t* codes, float* block_scale) {
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * 32, stop = std::min(k, start + 32);
    float absmax = 0.0f;
    for (int64_t i = start; i < stop; ++i) absmax = std::max(absmax, std::fabs(row[i]));
    const float d = absmax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    block_scale[b] = d;
    for (int64_t i = start; i < start + 32; ++i) {
      const float q = i < stop ? std::nearbyint(row[i] * inverse) : 0.0f;
      codes[i] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
    }
  }
}

// reduce8's order on 8 scalar lane sums (the portable kernels).
inline float reduce8(const float* lanes) {
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// run(scales' data), typed by their dtype (bfloat16 or float32, as check_common allows).
template <typename F>
void with_scales(const at::Tensor& scales, F&& run) {
  if (scales.scalar_type() == at::kBFloat16) {
    run(scales.data_ptr<at::BFloat16>());
  } else {
    run(scales.data_ptr<float>());
  }
}

inline void check_common(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group, const char* op) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": float32 or bfloat16 x [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), op, ": contiguous codes [N, ...]");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.size(0) == codes.size(0), op, ": scales [N, groups]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 scales");
  TORCH_CHECK(group > 0 && group % 32 == 0, op, ": a group of a multiple of 32 columns");
  TORCH_CHECK(scales.size(1) == (x.size(1) + group - 1) / group, op, ": ", scales.size(1), " scale groups for K = ",
              x.size(1));
}

// Splits the N outputs over threads once the work pays for the pool's wake-up; body<NR>(col0, cols,
// r0) computes rows r0 .. r0 + NR - 1 of outputs col0 .. col0 + cols - 1 (cols <= kColBlock). Rows
// go in blocks of kRowBlock, each block against every column of the thread, so a prefill chunk's x
// block stays in cache while the weight streams.
template <typename F>
void for_outputs(int64_t m, int64_t n, int64_t k, F&& body) {
  const int64_t grain = m * n * k >= kParallelWork ? std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, m * k)) : n;
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t block = 0; block < m; block += kRowBlock) {
      const int64_t block_end = std::min(m, block + kRowBlock);
      for (int64_t col0 = n0; col0 < n1; col0 += kColBlock) {
        const int64_t cols = std::min(kColBlock, n1 - col0);
        int64_t r0 = block;
        for (; r0 + kRowsAtOnce <= block_end; r0 += kRowsAtOnce) body(std::integral_constant<int, kRowsAtOnce>{}, col0, cols, r0);
        switch (block_end - r0) {
          case 3: body(std::integral_constant<int, 3>{}, col0, cols, r0); break;
          case 2: body(std::integral_constant<int, 2>{}, col0, cols, r0); break;
          case 1: body(std::integral_constant<int, 1>{}, col0, cols, r0); break;
          default: break;
        }
      }
    }
  });
}

// body(NC, col) over a thread's weight rows col0 .. col0 + cols - 1: blocks of kCols rows at once
// (NC = kCols), then the rest one at a time (NC = 1).
template <int kCols, typename F>
void column_blocks(int64_t col0, int64_t cols, F&& body) {
  int64_t col = col0;
  for (; col + kCols <= col0 + cols; col += kCols) body(std::integral_constant<int, kCols>{}, col);
  for (; col < col0 + cols; ++col) body(std::integral_constant<int, 1>{}, col);
}

// An int4 op whole: argument checks, the output, the scale-group table, and the N outputs split
// over threads, each thread's columns in blocks of Kernel::cols<NR> weight rows (the rest one at a
// time). Kernel names the x form (Kernel::Rows, built once from x) and its register block
// (Kernel::block<NR, NC>(rows, r0, codes, scales, words, groups, half_group, out, out_stride)).
template <typename Kernel>
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group,
                        const char* op) {
  check_common(x, codes, scales, group, op);
  TORCH_CHECK(codes.scalar_type() == at::kInt && codes.size(1) * 8 == x.size(1), op, ": int32 codes [N, K / 8]");
  const int64_t m = x.size(0), n = codes.size(0), k = x.size(1), words = codes.size(1);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out;
  const typename Kernel::Rows rows(x, k);
  const int32_t* code_data = codes.data_ptr<int32_t>();
  float* out_data = out.data_ptr<float>();
  const int64_t groups = scales.size(1);
  const std::vector<int32_t> half_group = half_chunk_groups(k, group);
  auto run = [&](const auto* s) {
    for_outputs(m, n, k, [&](auto rows_at_once, int64_t col0, int64_t cols, int64_t r0) {
      constexpr int nr = decltype(rows_at_once)::value;
      column_blocks<Kernel::template cols<nr>>(col0, cols, [&](auto weight_rows, int64_t col) {
        Kernel::template block<nr, decltype(weight_rows)::value>(rows, r0, code_data + col * words, s + col * groups,
                                                                 words, groups, half_group.data(), out_data + col, n);
      });
    });
  };
  with_scales(scales, run);
  return out;
}

}  // namespace eaglet::quant
