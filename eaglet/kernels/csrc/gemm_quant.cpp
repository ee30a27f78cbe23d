// GEMMs on weights as quantized checkpoints store them, unpacked in registers (never a dequantized
// copy of the matrix):
//
// - int4_linear: compressed-tensors pack-quantized int4. codes int32 [N, K / 8], eight values per
//   word as value + 8 in nibbles, least significant first along k; scales [N, K / group]
//   (bfloat16 or float32), group a multiple of 32.
// - fp8_linear: e4m3 codes [N, K] (one byte each) with float32 scales [N, ceil(K / group)].
//
// out [M, N] float32 = x [M, K] (float32 or bfloat16) times the weight's transpose. Each output is
// one product chain in k order with 8 float32 partial sums and a fixed final reduction, the same
// whatever M is: a row's result does not depend on its batch. Threads split the N outputs only.
#include "gemm_quant.h"

#include <cmath>

namespace eaglet {

using namespace quant;

namespace {

// x rows as float32 in the int4 kernel's order: within each 64-value chunk, position 8 * j + w holds
// x[64 c + 8 w + j], so shifting 8 loaded words by 4 j gives, in lane w, the weight that multiplies
// it. Also per chunk and lane the sum of the 8 x values the lane meets, times 8: the nibbles are
// value + 8, and sum x * (q + 8) - 8 * sum x = sum x * q.
struct Int4Rows {
  std::vector<float> x, offset;
  int64_t chunks;

  Int4Rows(const at::Tensor& input, int64_t k) : chunks((k + kChunk - 1) / kChunk) {
    const int64_t m = input.size(0);
    const at::Tensor xf = input.to(at::kFloat).contiguous();
    const float* src = xf.data_ptr<float>();
    x.assign(m * chunks * kChunk, 0.0f);
    offset.assign(m * chunks * 8, 0.0f);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < chunks; ++c) {
        for (int w = 0; w < 8; ++w) {
          float sum = 0.0f;
          for (int j = 0; j < 8; ++j) {
            const int64_t col = c * kChunk + 8 * w + j;
            const float v = col < k ? src[r * k + col] : 0.0f;
            x[(r * chunks + c) * kChunk + 8 * j + w] = v;
            sum += v;
          }
          offset[(r * chunks + c) * 8 + w] = 8.0f * sum;
        }
      }
    }
  }
};

// out[r][n + j] for rows r0 .. r0 + NR - 1 and weight rows n .. n + NC - 1 (constants, so the sums
// stay in registers). Several weight rows at once give the FMA unit independent chains: one row's
// chunk is a chain of eight dependent FMAs, which alone leaves the unit waiting on its latency.
template <int NR, int NC, typename S>
void int4_block(const Int4Rows& rows, int64_t r0, const int32_t* codes, const S* scales, int64_t words,
                int64_t groups, const int32_t* half_group, float* out, int64_t out_stride) {
  constexpr int nr = NR, nc = NC;
#if defined(EAGLET_QUANT_AVX2)
  __m256 acc[NR][NC];
  zero_sums(acc);
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const int64_t x_stride = rows.chunks * kChunk;
  // Groups of 32: the scales of 4 whole chunks in one load per weight row (chunk_of_four picks each
  // chunk's pair); other groups and the last chunks read them one by one (the same values).
  const int64_t four_chunks_end = half_group[1] == 1 ? (words / 8) / 4 * 4 : 0;
  __m256 four[NC];
  for (int64_t c = 0; c < rows.chunks; ++c) {
    __m256i packed[NC];
#pragma GCC unroll 8
    for (int j = 0; j < nc; ++j) {
      if (c % 2 == 0) prefetch_ahead(codes + j * words, c * 8, words, nc);
      packed[j] = load_words(codes + j * words, c * 8, words);
    }
    const float* x0 = rows.x.data() + (r0 * rows.chunks + c) * kChunk;
    __m256 dot[NR][NC];
#pragma GCC unroll 8
    for (int j = 0; j < nc; ++j) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(packed[j], low4));
#pragma GCC unroll 8
      for (int r = 0; r < nr; ++r) dot[r][j] = _mm256_mul_ps(_mm256_loadu_ps(x0 + r * x_stride), q);
    }
#pragma GCC unroll 7
    for (int b = 1; b < 8; ++b) {
#pragma GCC unroll 8
      for (int j = 0; j < nc; ++j) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(packed[j], 4 * b), low4));
#pragma GCC unroll 8
        for (int r = 0; r < nr; ++r) dot[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + r * x_stride + 8 * b), q, dot[r][j]);
      }
    }
    // Lanes 0-3 cover k values 64c .. 64c + 31, lanes 4-7 the next 32: each half within one group.
#pragma GCC unroll 8
    for (int j = 0; j < nc; ++j) {
      __m256 scale;
      if (c < four_chunks_end) {
        if (c % 4 == 0) four[j] = eight_scales(scales + j * groups, 2 * c);
        scale = chunk_of_four(four[j], static_cast<int>(c % 4));
      } else {
        float s_lo, s_hi;
        chunk_scales(scales + j * groups, half_group, c, s_lo, s_hi);
        scale = _mm256_set_m128(_mm_set1_ps(s_hi), _mm_set1_ps(s_lo));
      }
#pragma GCC unroll 8
      for (int r = 0; r < nr; ++r) {
        const __m256 off = _mm256_loadu_ps(rows.offset.data() + ((r0 + r) * rows.chunks + c) * 8);
        acc[r][j] = _mm256_fmadd_ps(_mm256_sub_ps(dot[r][j], off), scale, acc[r][j]);
      }
    }
  }
  store_sums(acc, r0, out, out_stride);
#else
  for (int j = 0; j < nc; ++j) {
    const int32_t* row_codes = codes + j * words;
    const S* row_scales = scales + j * groups;
    for (int r = 0; r < nr; ++r) {
      float acc[8] = {0};
      for (int64_t c = 0; c < rows.chunks; ++c) {
        for (int w = 0; w < 8; ++w) {
          const int64_t word = c * 8 + w;
          const uint32_t bits = word < words ? static_cast<uint32_t>(row_codes[word]) : 0u;
          const float s = word < words ? scale_at(row_scales, half_group[2 * c + w / 4]) : 0.0f;
          float dot = 0.0f;
          for (int b = 0; b < 8; ++b) {
            const float q = static_cast<float>((bits >> (4 * b)) & 0xF);
            const float xv = rows.x[((r0 + r) * rows.chunks + c) * kChunk + 8 * b + w];
            dot = b == 0 ? xv * q : std::fma(xv, q, dot);
          }
          acc[w] = std::fma(dot - rows.offset[((r0 + r) * rows.chunks + c) * 8 + w], s, acc[w]);
        }
      }
      out[(r0 + r) * out_stride + j] = reduce8(acc);
    }
  }
#endif
}

// int4_product's kernel for W4A16: as many weight rows at once as the registers hold next to NR x rows.
struct W4A16 {
  using Rows = Int4Rows;
  template <int NR>
  static constexpr int cols = NR == 1 ? 4 : NR == 2 ? 2 : 1;
  template <int NR, int NC, typename S>
  static void block(const Rows& rows, int64_t r0, const int32_t* codes, const S* scales, int64_t words, int64_t groups,
                    const int32_t* half_group, float* out, int64_t out_stride) {
    int4_block<NR, NC>(rows, r0, codes, scales, words, groups, half_group, out, out_stride);
  }
};

// An e4m3 byte as float32: its exponent and mantissa moved to bits 20-26 and its sign to bit 31 read
// as a float32 give the value times 2^-120 (exactly, for normal and subnormal codes alike), which
// one multiplication by 2^120 restores.
constexpr float kFp8Rescale = 1.329227995784916e36f;  // 2^120

#if defined(EAGLET_QUANT_AVX2)
inline __m256 fp8_values(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(magnitude, sign)), _mm256_set1_ps(kFp8Rescale));
}
#endif

inline float fp8_value(uint8_t b) {
  const uint32_t bits = (static_cast<uint32_t>(b & 0x7F) << 20) | (static_cast<uint32_t>(b & 0x80) << 24);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * kFp8Rescale;
}

// out[r][n] for rows r0 .. r0 + nr - 1 of one fp8 weight row n (x float32 [M, K]): per group, 8
// partial sums of x * code, then acc += partial * the group's scale.
template <int NR>
void fp8_row(const float* x, int64_t k, int64_t r0, const uint8_t* codes, const float* scales, int64_t group,
             float* out, int64_t out_stride) {
  constexpr int nr = NR;
  const int64_t groups = (k + group - 1) / group;
#if defined(EAGLET_QUANT_AVX2)
  __m256 acc[NR];
  for (int r = 0; r < nr; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t start = g * group, stop = std::min(k, start + group);
    __m256 dot[NR];
    for (int r = 0; r < nr; ++r) dot[r] = _mm256_setzero_ps();
    for (int64_t i = start; i < stop; i += 8) {
      const int64_t count = std::min<int64_t>(8, stop - i);
      alignas(32) uint8_t code_tail[8] = {0};
      if (count < 8) std::memcpy(code_tail, codes + i, count);
      const __m256 w = fp8_values(count < 8 ? code_tail : codes + i);
      for (int r = 0; r < nr; ++r) {
        const float* row = x + (r0 + r) * k + i;
        __m256 xv;
        if (count == 8) {
          xv = _mm256_loadu_ps(row);
        } else {
          alignas(32) float x_tail[8] = {0};
          std::memcpy(x_tail, row, count * sizeof(float));
          xv = _mm256_load_ps(x_tail);
        }
        dot[r] = _mm256_fmadd_ps(xv, w, dot[r]);
      }
    }
    const __m256 scale = _mm256_set1_ps(scales[g]);
    for (int r = 0; r < nr; ++r) acc[r] = _mm256_fmadd_ps(dot[r], scale, acc[r]);
  }
  for (int r = 0; r < nr; ++r) out[(r0 + r) * out_stride] = reduce8(acc[r]);
#else
  for (int r = 0; r < nr; ++r) {
    float acc[8] = {0};
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t start = g * group, stop = std::min(k, start + group);
      float dot[8] = {0};
      for (int64_t i = start; i < stop; ++i) {
        dot[(i - start) % 8] = std::fma(x[(r0 + r) * k + i], fp8_value(codes[i]), dot[(i - start) % 8]);
      }
      for (int l = 0; l < 8; ++l) acc[l] = std::fma(dot[l], scales[g], acc[l]);
    }
    out[(r0 + r) * out_stride] = reduce8(acc);
  }
#endif
}

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  return int4_product<W4A16>(x, codes, scales, group, "int4_linear");
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  check_common(x, codes, scales, group, "fp8_linear");
  TORCH_CHECK(codes.element_size() == 1 && codes.size(1) == x.size(1), "fp8_linear: one-byte codes [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "fp8_linear: float32 scales");
  const int64_t m = x.size(0), n = codes.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* x_data = xf.data_ptr<float>();
  const uint8_t* code_data = static_cast<const uint8_t*>(codes.data_ptr());
  const float* s = scales.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t groups = scales.size(1);
  for_outputs(m, n, k, [&](auto rows_at_once, int64_t col0, int64_t cols, int64_t r0) {
    for (int64_t col = col0; col < col0 + cols; ++col) {
      fp8_row<decltype(rows_at_once)::value>(x_data, k, r0, code_data + col * k, s + col * groups, group, out_data + col, n);
    }
  });
  return out;
}

}  // namespace eaglet
