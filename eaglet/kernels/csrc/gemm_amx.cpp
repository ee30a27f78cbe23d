// The tile-layout GEMM on AMX (Intel Sapphire Rapids and later).
#include "gemm.h"

#if defined(EAGLET_TILES_AMX)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace eaglet {

const char* const kTileBackend = "amx";

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

}  // namespace eaglet

#endif  // EAGLET_TILES_AMX
