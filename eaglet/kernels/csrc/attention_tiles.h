// Absorbed attention's products on the tile-layout GEMM (attention_tiles.cpp), where the build has
// one (EAGLET_TILES): a bfloat16 cache's scores q . k and sums p . c_kv.
#pragma once

#include "gemm.h"

#if defined(EAGLET_TILES)

namespace eaglet {

// row_scores[r * keys + s] = bfloat16(rows[r]) . key s, for r < num_rows, s < keys, on tiles: the
// keys are the A rows (16 per tile, read straight from the cache where a block holds them, else
// copied), the queries a packed B block of 16 columns. rows hold kp values (whole k blocks, zero
// past the key's qdim). A score is one tile-product chain over kp in order, the same whatever the
// other rows and keys are. Tiles must be configured on this thread.
void amx_key_scores(const float* const* rows, int64_t num_rows, const at::BFloat16* const* keys_of, int64_t keys,
                    int64_t qdim, int64_t kp, float* row_scores);

// out_rows[r][0:latent] = sum over keys s of bfloat16(probs[r * keys + s]) * key s's first latent
// values (latent a multiple of 16), on tiles: the probabilities are the A rows, the keys' latents
// packed as B blocks of 32 keys (k) x 16 latent columns, zero past the last key. Tiles must be
// configured on this thread.
void amx_value_sums(const float* probs, int64_t num_rows, const at::BFloat16* const* keys_of, int64_t keys,
                    int64_t latent, float* const* out_rows);

}  // namespace eaglet

#endif  // EAGLET_TILES
