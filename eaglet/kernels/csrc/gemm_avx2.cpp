// The tile-layout GEMM on AVX2 + FMA, for CPUs without AVX512-BF16 (AMD Zen 2 / Zen 3, older Xeons).
//
// The same packed layout, its bfloat16 weights widened to float32 in registers: a 256-bit load of
// a block's pair row is 8 columns x one k pair, whose even k is each dword shifted left by 16 bits
// and whose odd k is the dword's high half. Every output is one chain of fused multiply-adds in k
// order from zero, so its bits depend only on its row and column, never on the batch.
#include "gemm.h"

#if defined(EAGLET_TILES_AVX2)

#include <immintrin.h>

#include <cstring>
#include <vector>

namespace eaglet {

namespace {

// Columns per vector: a pair row's 16 columns are two chunks of 8.
constexpr int kChunkN = 8;

// x's rows as the packed bfloat16 (x_pad), each k pair widened where it is used: for the last 1-3
// rows, which take many column chunks per pass.
struct Bf16Rows {
  using Value = at::BFloat16;
  const Value* x;
  int64_t stride;

  // A row's value 2q (odd: 2q + 1) broadcast to 8 lanes.
  static inline __m256 value(const Value* row, int64_t q, bool odd) {
    int32_t x_pair;  // both values of the pair (memcpy: no aliasing through int32_t*)
    std::memcpy(&x_pair, row + 2 * q, sizeof(x_pair));
    const __m256i both = _mm256_set1_epi32(x_pair);
    return _mm256_castsi256_ps(odd ? _mm256_and_si256(both, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)))
                                   : _mm256_slli_epi32(both, 16));
  }
};

// x's rows widened to float32 once per group (wide_rows): blocks of 4 rows take only 2 column chunks
// per pass, where widening each pair per pass would cost as much as half their multiply-adds.
struct FloatRows {
  using Value = float;
  const Value* x;
  int64_t stride;

  static inline __m256 value(const Value* row, int64_t q, bool odd) { return _mm256_set1_ps(row[2 * q + odd]); }
};

// The first `rows` rows of x_pad (kp values each) as float32, exactly, in a buffer of this thread.
const float* wide_rows(const at::BFloat16* x_pad, int64_t rows, int64_t kp) {
  thread_local std::vector<float> wide;
  wide.resize(rows * kp);
  for (int64_t i = 0; i < rows * kp; i += 8) {
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x_pad + i)));
    _mm256_storeu_ps(wide.data() + i, _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)));
  }
  return wide.data();
}

// Rows r0 .. r0 + R - 1 of x against column chunks c0 .. c0 + C - 1 of a group (chunk c: block
// c / 2, columns (c % 2) * 8 ..): R * C accumulators of the 16 vector registers.
template <int R, int C, typename Rows>
inline void fma_rows(Rows x, int64_t r0, const at::BFloat16* w_group, int64_t k_blocks, int c0, float* out, int64_t out_stride) {
  const int64_t w_step = k_blocks * kTileK * kTileN, pairs = k_blocks * (kTileK / 2);
  const __m256i high_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const typename Rows::Value* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = x.x + (r0 + r) * x.stride;
  const at::BFloat16* wcol[C];
  for (int c = 0; c < C; ++c) wcol[c] = w_group + ((c0 + c) / 2) * w_step + ((c0 + c) % 2) * kChunkN * 2;
  // Pair q of the row is k block q / 16's pair q % 16: x's values 2q, 2q + 1 and row q of the
  // blocks. Each output adds its even product, then its odd one. The loop keeps in registers x's
  // values of every row where they fit beside the accumulators, else the widened weights of every chunk.
  for (int64_t q = 0; q < pairs; ++q) {
    if constexpr (R * C + 2 * R + 2 <= 16) {
      __m256 x_even[R], x_odd[R];
      for (int r = 0; r < R; ++r) x_even[r] = Rows::value(xrow[r], q, false), x_odd[r] = Rows::value(xrow[r], q, true);
      for (int c = 0; c < C; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wcol[c] + q * 2 * kTileN));
        const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(x_even[r], w_even, acc[r][c]);
        const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(w, high_half));
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(x_odd[r], w_odd, acc[r][c]);
      }
    } else {
      __m256 w_even[C], w_odd[C];
      for (int c = 0; c < C; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wcol[c] + q * 2 * kTileN));
        w_even[c] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        w_odd[c] = _mm256_castsi256_ps(_mm256_and_si256(w, high_half));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 x_even = Rows::value(xrow[r], q, false), x_odd = Rows::value(xrow[r], q, true);
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm256_fmadd_ps(x_even, w_even[c], acc[r][c]);
          acc[r][c] = _mm256_fmadd_ps(x_odd, w_odd[c], acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + (r0 + r) * out_stride + (c0 + c) * kChunkN, acc[r][c]);
}

// Rows r0 .. r0 + R - 1 against chunks c_begin .. n_chunks - 1, C at a time, the rest (n_chunks
// is even) by halves of C.
template <int R, int C>
inline void fma_row_block(Bf16Rows x, int64_t r0, const at::BFloat16* w_group, int64_t k_blocks, int c_begin, int n_chunks,
                          float* out, int64_t out_stride) {
  int c0 = c_begin;
  for (; c0 + C <= n_chunks; c0 += C) fma_rows<R, C>(x, r0, w_group, k_blocks, c0, out, out_stride);
  if constexpr (C > 2) {
    if (c0 < n_chunks) fma_row_block<R, C / 2>(x, r0, w_group, k_blocks, c0, n_chunks, out, out_stride);
  }
}

}  // namespace

const char* const kTileBackend = "avx2";

bool tiles_permitted() { return true; }  // no tile state to ask the OS for
void configure_tiles() {}
void release_tiles() {}

// amx_group's contract (gemm.h) on AVX2: four rows x 16 columns at a time (8 accumulators), the
// columns outer so that their weights stay in L2 across the row blocks; the last rows take more
// columns per pass, so a decode step's single row still runs 8 independent chains. Either way an
// output's chain is the same: x's values are widened exactly, before or at their use.
void amx_group(const at::BFloat16* x_pad, int64_t m, int64_t kp, const at::BFloat16* w_group, int64_t k_blocks,
               float* out, int64_t out_stride, int64_t n_blocks) {
  const int n_chunks = static_cast<int>(2 * n_blocks);
  const int64_t full = m / 4 * 4;
  if (full) {
    const FloatRows wide{wide_rows(x_pad, full, kp), kp};
    for (int c0 = 0; c0 < n_chunks; c0 += 2) {
      for (int64_t r0 = 0; r0 < full; r0 += 4) fma_rows<4, 2>(wide, r0, w_group, k_blocks, c0, out, out_stride);
    }
  }
  const Bf16Rows rest{x_pad, kp};
  switch (m - full) {
    case 3: fma_row_block<3, 2>(rest, full, w_group, k_blocks, 0, n_chunks, out, out_stride); break;
    case 2: fma_row_block<2, 4>(rest, full, w_group, k_blocks, 0, n_chunks, out, out_stride); break;
    case 1: fma_row_block<1, 8>(rest, full, w_group, k_blocks, 0, n_chunks, out, out_stride); break;
    default: break;
  }
}

// amx_blocks_by_group's contract (gemm.h) on AVX2: only the rows that are stored.
void amx_blocks_by_group(const at::BFloat16* const* a, const int64_t* a_rows, int64_t num_a, int64_t lda,
                         const at::BFloat16* b_block, int64_t k_blocks, float* out) {
  for (int64_t i = 0; i < num_a; ++i) amx_group(a[i], a_rows[i], lda, b_block, k_blocks, out + i * kTileRows * kTileN, kTileN, 1);
}

}  // namespace eaglet

#endif  // EAGLET_TILES_AVX2
