// The tile layout: which backend multiplies on it here, packing a weight into it, checking a packed
// copy against its weight, and padding activations to whole tiles.
#include "gemm.h"
#include "ops.h"

#include <string>

namespace eaglet {

bool tile_kernels_supported() { return kTileBackend[0] != '\0' && tiles_permitted(); }

std::string tile_backend() { return tile_kernels_supported() ? kTileBackend : ""; }

// A bfloat16 weight [N, K] in the tile layout: blocks of 16 columns (padded to groups of four
// blocks) x 32 k, each block 16 rows of (k pair) x 16 columns x 2.
at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_pack_weight: bfloat16 [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t n_blocks = (n + kGroupN - 1) / kGroupN * 4, k_blocks = (k + kTileK - 1) / kTileK;
  at::Tensor packed = at::zeros({n_blocks, k_blocks, kTileK / 2, kTileN, 2}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = packed.data_ptr<at::BFloat16>();
  for (int64_t row = 0; row < n; ++row) {
    const int64_t nb = row / kTileN, col = row % kTileN;
    for (int64_t kk = 0; kk < k; ++kk) {
      const int64_t kb = kk / kTileK, pair = (kk % kTileK) / 2, within = kk % 2;
      dst[(((nb * k_blocks + kb) * (kTileK / 2) + pair) * kTileN + col) * 2 + within] = src[row * k + kk];
    }
  }
  return packed;
}

void check_packed(const at::Tensor& packed, int64_t k, int64_t n, const char* what) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 5 && packed.size(2) == kTileK / 2 &&
                  packed.size(3) == kTileN && packed.size(0) % 4 == 0,
              what, ": weight not packed by amx_pack_weight");
  TORCH_CHECK((k + kTileK - 1) / kTileK == packed.size(1) && n <= packed.size(0) * kTileN && n > packed.size(0) * kTileN - kGroupN,
              what, ": a [", n, ", ", k, "] weight does not match its packed copy");
}

const at::BFloat16* padded_tiles(const at::Tensor& x, int64_t k_blocks, std::vector<at::BFloat16>& buffer) {
  const int64_t rows = x.size(0), k = x.size(1), kp = k_blocks * kTileK;
  const int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  if (static_cast<int64_t>(buffer.size()) < padded_rows * kp) assign_zeros(buffer, padded_rows * kp);
  // Only the padding is zeroed: the rows' own values are all written.
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int64_t row_stride = x.stride(0);
  at::BFloat16* dst = buffer.data();
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * kp, xp + r * row_stride, k * sizeof(at::BFloat16));
    if (kp > k) std::memset(dst + r * kp + k, 0, (kp - k) * sizeof(at::BFloat16));
  }
  std::memset(dst + rows * kp, 0, (padded_rows - rows) * kp * sizeof(at::BFloat16));
  return dst;
}

}  // namespace eaglet
