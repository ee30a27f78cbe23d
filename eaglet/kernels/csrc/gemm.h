// The tile-layout GEMM: bfloat16 weights packed by amx_pack_weight (gemm_pack.cpp) into blocks of
// 16 output columns x 32 k, multiplied on AMX tiles (gemm_amx.cpp), with AVX512-BF16 dot products
// on CPUs without AMX (AMD Zen 4 and later, gemm_avx512_bf16.cpp), or with float32 FMAs on the
// weights widened in registers on AVX2-only CPUs (gemm_avx2.cpp): the same layout and one product
// chain per output in k order, so a row's bits do not depend on its batch. -march=native compiles
// exactly one of those in (EAGLET_TILES says some is); without AVX2 and FMA, gemm_portable.cpp
// stands in and the tile-layout kernels are unsupported (tile_backend() is empty: the models keep
// oneDNN or F.linear).
#pragma once

#include "common.h"

#include <algorithm>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define EAGLET_TILES 1
#define EAGLET_TILES_AMX 1
#elif defined(__AVX512BF16__)
#define EAGLET_TILES 1
#define EAGLET_TILES_AVX512_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define EAGLET_TILES 1
#define EAGLET_TILES_AVX2 1
#endif

namespace eaglet {

// AMX tile geometry: 16 rows x 32 bfloat16 of k per A tile, 16 output columns per B tile, and
// the 4 accumulator tiles of one pass cover a group of 64 output columns.
constexpr int64_t kTileRows = 16, kTileK = 32, kTileN = 16, kGroupN = 4 * kTileN;

// This build's tile backend: "amx", "avx512_bf16", "avx2", or "" for none (defined by its gemm_*.cpp).
extern const char* const kTileBackend;
// Whether the OS lets this process use the backend.
bool tiles_permitted();
// The tile-layout kernels run here: on AMX tiles, AVX512-BF16 dot products or AVX2 FMAs.
bool tile_kernels_supported();

// Each thread that multiplies on tiles configures them first and releases them after.
void configure_tiles();
void release_tiles();

// out[r][0:16 * n_blocks] (row stride out_stride) = x_pad rows r < m against the first n_blocks
// (1-4) of one group of four 16-column weight blocks, in float32. x_pad holds whole tiles:
// ceil(m / 16) * 16 rows of kp = k_blocks * 32 values, zero beyond the real ones. Tiles must be
// configured on this thread. Each output is one product chain in k order, the same for any m.
void amx_group(const at::BFloat16* x_pad, int64_t m, int64_t kp, const at::BFloat16* w_group, int64_t k_blocks,
               float* out, int64_t out_stride, int64_t n_blocks = 4);

// out[i][r][0:16] = A_i's row r (of a_rows[i] <= 16, row stride lda, k_blocks * 32 values; rows
// past a_rows[i] may be read, and are not stored) times one 16-column weight block, for i < num_a
// (1-4): four independent product chains, where amx_group runs one per 16 rows with a single block.
// Each output is one chain in k order, the same as amx_group's. Tiles must be configured.
void amx_blocks_by_group(const at::BFloat16* const* a, const int64_t* a_rows, int64_t num_a, int64_t lda,
                         const at::BFloat16* b_block, int64_t k_blocks, float* out);

// Checks that `packed` is amx_pack_weight's copy of a [n, k] weight (`what` names the caller).
void check_packed(const at::Tensor& packed, int64_t k, int64_t n, const char* what);

// x's rows zero-padded to whole tiles ([ceil(rows / 16) * 16, k_blocks * 32]) in a buffer of this thread.
const at::BFloat16* padded_tiles(const at::Tensor& x, int64_t k_blocks, std::vector<at::BFloat16>& buffer);

// Whether a GEMM pays for each of its rows (dot products, FMAs) rather than for whole 16-row tiles (AMX).
#if defined(EAGLET_TILES_AVX512_BF16) || defined(EAGLET_TILES_AVX2)
constexpr bool kProductsPerRow = true;
#else
constexpr bool kProductsPerRow = false;
#endif

// Parallel over threads once a GEMM's products pay for the pool's wake-up (a few us). AMX multiplies
// a 16-row tile for the price of one row, so there rows count in whole tiles; AVX512-BF16 and AVX2
// pay for every row, so smaller GEMMs split there.
inline bool worth_threads(int64_t m, int64_t n, int64_t k) {
  if constexpr (kProductsPerRow) return n * k * m >= (int64_t{1} << 18);
  return n * k * std::max<int64_t>(m, kTileRows) >= (int64_t{1} << 22);
}

}  // namespace eaglet
