// No tile-layout GEMM: without AVX2 and FMA (or off x86), tile_backend() is empty, every
// tile-layout kernel refuses to run (tile_kernels_supported()), and the models multiply with oneDNN
// or F.linear. A GEMM on the same layout for another instruction set would take this file's place.
#include "gemm.h"

#if !defined(EAGLET_TILES)

namespace eaglet {

const char* const kTileBackend = "";

bool tiles_permitted() { return false; }
void configure_tiles() {}
void release_tiles() {}

// Never reached: their callers check tile_kernels_supported() first.
void amx_group(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t, float*, int64_t, int64_t) {
  TORCH_CHECK(false, "amx_group: this build has no tile-layout GEMM");
}

void amx_blocks_by_group(const at::BFloat16* const*, const int64_t*, int64_t, int64_t, const at::BFloat16*, int64_t, float*) {
  TORCH_CHECK(false, "amx_blocks_by_group: this build has no tile-layout GEMM");
}

}  // namespace eaglet

#endif  // no tile-layout GEMM
