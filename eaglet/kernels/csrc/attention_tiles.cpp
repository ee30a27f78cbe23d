// Absorbed attention's products on the tile-layout GEMM: the keys (or the keys' latents) and the
// queries (or the probabilities) packed into tiles, multiplied by amx_group / amx_blocks_by_group.
#include "attention_tiles.h"

#if defined(EAGLET_TILES)

#include "vec.h"

#include <immintrin.h>

namespace eaglet {

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
#if defined(__AVX512BF16__)
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
#else
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      const float* x = rows[r] + kb * kTileK;
      at::BFloat16* block = q_packed.data() + ((r / kTileN) * k_blocks + kb) * block_elems;
      for (int64_t p = 0; p < kTileK / 2; ++p) {
        block[(p * kTileN + r % kTileN) * 2] = at::BFloat16(x[2 * p]);
        block[(p * kTileN + r % kTileN) * 2 + 1] = at::BFloat16(x[2 * p + 1]);
      }
    }
  }
#endif
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
#if defined(__AVX512BF16__)
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#endif
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
#if defined(__AVX512BF16__)
        const __m512i both = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + column))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + column)), 1);
        _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, both));
#else
        // Columns 0-7 then 8-15 of the two keys, interleaved by 16-bit unpacks.
        for (int64_t half = 0; half < 2; ++half) {
          const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v0 + column + half * 8));
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v1 + column + half * 8));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + half * 16), _mm_unpacklo_epi16(a, b));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + half * 16 + 8), _mm_unpackhi_epi16(a, b));
        }
#endif
      }
    }
    amx_group(p_pad.data(), num_rows, kp, v_packed.data(), k_blocks, c.data(), kGroupN, group_blocks);
    for (int64_t r = 0; r < num_rows; ++r) std::memcpy(out_rows[r] + g * kGroupN, c.data() + r * kGroupN, width * sizeof(float));
  }
}

}  // namespace eaglet

#endif  // EAGLET_TILES
