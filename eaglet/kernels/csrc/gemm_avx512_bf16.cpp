// The tile-layout GEMM on AVX512-BF16, for CPUs without AMX (AMD Zen 4 and later).
//
// Without AMX, the same packed layout runs on AVX512-BF16 dot products: a 64-byte row of a weight
// block (one k pair for its 16 columns) is one vector, and x's pair is broadcast against it.
#include "gemm.h"

#if defined(EAGLET_TILES_AVX512_BF16)

#include <immintrin.h>

#include <cstring>

namespace eaglet {

namespace {

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

}  // namespace

const char* const kTileBackend = "avx512_bf16";

bool tiles_permitted() { return true; }  // no tile state to ask the OS for
void configure_tiles() {}
void release_tiles() {}

// amx_group's contract (gemm.h) on AVX512-BF16.
void amx_group(const at::BFloat16* x_pad, int64_t m, int64_t kp, const at::BFloat16* w_group, int64_t k_blocks,
               float* out, int64_t out_stride, int64_t n_blocks) {
  switch (n_blocks) {
    case 1: bf16_dot_group<1>(x_pad, m, kp, w_group, k_blocks, out, out_stride); break;
    case 2: bf16_dot_group<2>(x_pad, m, kp, w_group, k_blocks, out, out_stride); break;
    case 3: bf16_dot_group<3>(x_pad, m, kp, w_group, k_blocks, out, out_stride); break;
    default: bf16_dot_group<4>(x_pad, m, kp, w_group, k_blocks, out, out_stride); break;
  }
}

// amx_blocks_by_group's contract (gemm.h) on AVX512-BF16: only the rows that are stored.
void amx_blocks_by_group(const at::BFloat16* const* a, const int64_t* a_rows, int64_t num_a, int64_t lda,
                         const at::BFloat16* b_block, int64_t k_blocks, float* out) {
  for (int64_t i = 0; i < num_a; ++i) bf16_dot_group<1>(a[i], a_rows[i], lda, b_block, k_blocks, out + i * kTileRows * kTileN, kTileN);
}

}  // namespace eaglet

#endif  // EAGLET_TILES_AVX512_BF16
