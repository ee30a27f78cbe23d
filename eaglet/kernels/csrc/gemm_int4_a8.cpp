// int4_linear_a8: int4_linear's weights (compressed-tensors pack-quantized, gemm_quant.cpp) against
// x quantized per row to int8 in blocks of 32 k values, as llama.cpp's Q8_0 activations: per block
// a float32 scale d = absmax / 127 and values round(x * (1 / d)), ties to even. Opt-in (W4A8): it
// changes results against the checkpoint's W4A16 arithmetic, and buys about 3x fewer instructions
// per weight, since nibbles times int8 values are summed exactly in integers (maddubs) and only
// each lane's sum of 8 products is converted to float.
//
// Each output: per 64-value chunk and lane (8 k values), the exact integer sum, less 8 times the
// lane's sum of x values (the nibbles are value + 8), times x's block scale, then one multiply-add
// by the weight's group scale into the lane's float32 sum; the 8 lanes reduced in a fixed order.
// Nothing depends on the batch or the threads, which split the N outputs only.
#include "gemm_quant.h"

#include <cmath>

namespace eaglet {

using namespace quant;

namespace {

constexpr int64_t kBlock = 32;  // x values per int8 scale

// x rows quantized, in the order the packed words meet them: byte i of a chunk's 8 words holds k
// values 2i (low nibble) and 2i + 1 (high nibble), so per chunk `even` holds x's codes at 64c + 2i
// and `odd` those at 64c + 2i + 1. Per chunk and lane l (words l, k values 64c + 8l ..): the scale
// of the lane's block and 8 times the sum of its 8 codes.
struct Int8Rows {
  std::vector<int8_t> even, odd;
  std::vector<float> lane_scale;
  std::vector<int32_t> lane_offset;
  int64_t chunks;

  Int8Rows(const at::Tensor& input, int64_t k) : chunks((k + kChunk - 1) / kChunk) {
    const int64_t m = input.size(0), blocks = chunks * (kChunk / kBlock);
    const at::Tensor xf = input.to(at::kFloat).contiguous();
    const float* src = xf.data_ptr<float>();
    even.assign(m * chunks * 32, 0);
    odd.assign(m * chunks * 32, 0);
    lane_scale.assign(m * chunks * 8, 0.0f);
    lane_offset.assign(m * chunks * 8, 0);
    std::vector<int8_t> codes(blocks * kBlock);
    std::vector<float> block_scale(blocks);
    for (int64_t r = 0; r < m; ++r) {
      quantize_q8_0(src + r * k, k, blocks, codes.data(), block_scale.data());
      for (int64_t c = 0; c < chunks; ++c) {
        const int8_t* chunk = codes.data() + c * kChunk;
        const int64_t at = (r * chunks + c) * 32;
        for (int i = 0; i < 32; ++i) even[at + i] = chunk[2 * i], odd[at + i] = chunk[2 * i + 1];
        for (int lane = 0; lane < 8; ++lane) {
          int32_t sum = 0;
          for (int j = 0; j < 8; ++j) sum += chunk[8 * lane + j];
          lane_offset[(r * chunks + c) * 8 + lane] = 8 * sum;
          lane_scale[(r * chunks + c) * 8 + lane] = block_scale[2 * c + lane / 4];
        }
      }
    }
  }
};

#if defined(EAGLET_QUANT_AVX2)
// The weight scales of chunk c for weight rows 0 .. NC - 1: lanes 0-3 cover k values 64c .. 64c +
// 31, lanes 4-7 the next 32, each half within one group (zero past K where kTail).
template <int NC, bool kTail, typename S>
__attribute__((always_inline)) inline void chunk_scale_vectors(const S* scales, int64_t groups, const int32_t* half_group,
                                                               int64_t c, __m256 (&weight_scale)[NC]) {
#pragma GCC unroll 8
  for (int j = 0; j < NC; ++j) {
    const float s_lo = scale_at(scales + j * groups, half_group[2 * c]);
    const float s_hi = !kTail || half_group[2 * c + 1] >= 0 ? scale_at(scales + j * groups, half_group[2 * c + 1]) : 0.0f;
    weight_scale[j] = _mm256_set_m128(_mm_set1_ps(s_hi), _mm_set1_ps(s_lo));
  }
}

// Chunk c of weight rows 0 .. NC - 1 against x rows r0 .. r0 + NR - 1, into acc. kTail: the chunk
// runs past K (read through load_words); kPrefetch: also ask for the next block of rows' line at
// this place.
template <int NR, int NC, bool kTail, bool kPrefetch>
__attribute__((always_inline)) inline void int4_a8_chunk(const Int8Rows& rows, int64_t r0, int64_t c, const int32_t* codes,
                                                         int64_t words, const __m256 (&weight_scale)[NC],
                                                         __m256 (&acc)[NR][NC]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i low[NC], high[NC];
#pragma GCC unroll 8
  for (int j = 0; j < NC; ++j) {
    __m256i packed;
    if constexpr (kTail) {
      packed = load_words(codes + j * words, c * 8, words);
    } else {
      if constexpr (kPrefetch) prefetch_ahead(codes + j * words, c * 8, words, NC);
      packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * words + c * 8));
    }
    low[j] = _mm256_and_si256(packed, low4);
    high[j] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    const int64_t at = (r0 + r) * rows.chunks + c;
    const __m256i x_even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.even.data() + at * 32));
    const __m256i x_odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.odd.data() + at * 32));
    const __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.lane_offset.data() + at * 8));
    const __m256 x_scale = _mm256_loadu_ps(rows.lane_scale.data() + at * 8);
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) {
      // Pairs of products fit int16: |15 * 127 * 2| * 2 < 2^15.
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low[j], x_even), _mm256_maddubs_epi16(high[j], x_odd));
      const __m256i lane_sum = _mm256_sub_epi32(_mm256_madd_epi16(pairs, ones), offset);
      acc[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lane_sum), x_scale), weight_scale[j], acc[r][j]);
    }
  }
}

// Chunk c with its scales read one by one (any group size, and the tail).
template <int NR, int NC, bool kTail, bool kPrefetch, typename S>
__attribute__((always_inline)) inline void int4_a8_chunk_scalar_scales(const Int8Rows& rows, int64_t r0, int64_t c,
                                                                       const int32_t* codes, const S* scales, int64_t words,
                                                                       int64_t groups, const int32_t* half_group,
                                                                       __m256 (&acc)[NR][NC]) {
  __m256 weight_scale[NC];
  chunk_scale_vectors<NC, kTail>(scales, groups, half_group, c, weight_scale);
  int4_a8_chunk<NR, NC, kTail, kPrefetch>(rows, r0, c, codes, words, weight_scale, acc);
}
#endif

// out[r][n + j] for x rows r0 .. r0 + NR - 1 and weight rows n .. n + NC - 1.
template <int NR, int NC, typename S>
void int4_a8_block(const Int8Rows& rows, int64_t r0, const int32_t* codes, const S* scales, int64_t words,
                   int64_t groups, const int32_t* half_group, float* out, int64_t out_stride) {
  constexpr int nr = NR, nc = NC;
#if defined(EAGLET_QUANT_AVX2)
  __m256 acc[NR][NC];
  zero_sums(acc);
  const int64_t full = words / 8;
  int64_t c = 0;
  // Groups of 32 (Kimi-K2.5's): the scales of 4 chunks in one load per weight row, each chunk's
  // pair of halves picked by a permute (the same float values as the scalar reads below).
  if (half_group[1] == 1) {
    for (; c + 4 <= full; c += 4) {
      __m256 four_chunks[NC];
#pragma GCC unroll 8
      for (int j = 0; j < nc; ++j) four_chunks[j] = eight_scales(scales + j * groups, 2 * c);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        __m256 weight_scale[NC];
#pragma GCC unroll 8
        for (int j = 0; j < nc; ++j) weight_scale[j] = chunk_of_four(four_chunks[j], q);
        // Two chunks of a row are one line: every other chunk prefetches the next rows' line.
        if (q % 2 == 0) {
          int4_a8_chunk<NR, NC, false, true>(rows, r0, c + q, codes, words, weight_scale, acc);
        } else {
          int4_a8_chunk<NR, NC, false, false>(rows, r0, c + q, codes, words, weight_scale, acc);
        }
      }
    }
  }
  // Chunks in pairs, the first prefetching the next rows' line.
  for (; c + 2 <= full; c += 2) {
    int4_a8_chunk_scalar_scales<NR, NC, false, true>(rows, r0, c, codes, scales, words, groups, half_group, acc);
    int4_a8_chunk_scalar_scales<NR, NC, false, false>(rows, r0, c + 1, codes, scales, words, groups, half_group, acc);
  }
  if (c < full) int4_a8_chunk_scalar_scales<NR, NC, false, true>(rows, r0, c++, codes, scales, words, groups, half_group, acc);
  if (c < rows.chunks) int4_a8_chunk_scalar_scales<NR, NC, true, false>(rows, r0, c, codes, scales, words, groups, half_group, acc);
  store_sums(acc, r0, out, out_stride);
#else
  for (int j = 0; j < nc; ++j) {
    const int32_t* row_codes = codes + j * words;
    const S* row_scales = scales + j * groups;
    for (int r = 0; r < nr; ++r) {
      float acc[8] = {0};
      for (int64_t c = 0; c < rows.chunks; ++c) {
        const int64_t at = (r0 + r) * rows.chunks + c;
        for (int lane = 0; lane < 8; ++lane) {
          const int64_t word = c * 8 + lane;
          const uint32_t bits = word < words ? static_cast<uint32_t>(row_codes[word]) : 0u;
          int32_t sum = 0;
          for (int b = 0; b < 4; ++b) {
            const int i = 4 * lane + b;
            sum += static_cast<int32_t>((bits >> (8 * b)) & 0xF) * rows.even[at * 32 + i];
            sum += static_cast<int32_t>((bits >> (8 * b + 4)) & 0xF) * rows.odd[at * 32 + i];
          }
          const int32_t g = half_group[2 * c + lane / 4];
          const float s = g >= 0 ? scale_at(row_scales, g) : 0.0f;
          const float scaled = static_cast<float>(sum - rows.lane_offset[at * 8 + lane]) * rows.lane_scale[at * 8 + lane];
          acc[lane] = std::fma(scaled, s, acc[lane]);
        }
      }
      out[(r0 + r) * out_stride + j] = reduce8(acc);
    }
  }
#endif
}

// int4_product's kernel for W4A8: two weight rows at once for one or two x rows (more would spill
// past the 16 vector registers), one at a time for more.
struct W4A8 {
  using Rows = Int8Rows;
  template <int NR>
  static constexpr int cols = NR <= 2 ? 2 : 1;
  template <int NR, int NC, typename S>
  static void block(const Rows& rows, int64_t r0, const int32_t* codes, const S* scales, int64_t words, int64_t groups,
                    const int32_t* half_group, float* out, int64_t out_stride) {
    int4_a8_block<NR, NC>(rows, r0, codes, scales, words, groups, half_group, out, out_stride);
  }
};

}  // namespace

at::Tensor int4_linear_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  return int4_product<W4A8>(x, codes, scales, group, "int4_linear_a8");
}

}  // namespace eaglet
