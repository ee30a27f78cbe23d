// The latent cache pool and its request-to-slots table: new tokens' entries written
// (mla_cache_write), an accepted path's entries moved (copy_cache_slots), a round's scratch slots
// read (scratch_slots) and new blocks' table entries written (write_block_entries).
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <type_traits>

namespace eaglet {

namespace {

// kv[slot] = [c_kv | k_pe] for each new token (LatentKVPool.write in one call), cast to the cache dtype.
template <typename KV, typename X>
void cache_write_impl(at::Tensor& kv, const int64_t* slots, const at::Tensor& c_kv, const at::Tensor& k_pe) {
  const int64_t tokens = c_kv.size(0), latent = c_kv.size(1), rope = k_pe.size(1), dim = kv.size(1);
  KV* dst = kv.data_ptr<KV>();
  const X* cp = c_kv.data_ptr<X>();
  const X* kp = k_pe.data_ptr<X>();
  const bool copy = std::is_same_v<KV, X> && c_kv.stride(1) == 1 && k_pe.stride(1) == 1;
  for (int64_t t = 0; t < tokens; ++t) {
    KV* row = dst + slots[t] * dim;
    if (copy) {
      std::memcpy(row, cp + t * c_kv.stride(0), latent * sizeof(KV));
      std::memcpy(row + latent, kp + t * k_pe.stride(0), rope * sizeof(KV));
      continue;
    }
    for (int64_t i = 0; i < latent; ++i) row[i] = from_float<KV>(to_float(cp[t * c_kv.stride(0) + i * c_kv.stride(1)]));
    for (int64_t i = 0; i < rope; ++i) row[latent + i] = from_float<KV>(to_float(kp[t * k_pe.stride(0) + i * k_pe.stride(1)]));
  }
}

}  // namespace

void mla_cache_write(at::Tensor kv, const at::Tensor& out_cache_loc, const at::Tensor& c_kv, const at::Tensor& k_pe) {
  TORCH_CHECK(kv.dim() == 2 && kv.is_contiguous(), "mla_cache_write: contiguous cache [slots, L + R]");
  TORCH_CHECK(c_kv.dim() == 2 && k_pe.dim() == 2 && c_kv.size(0) == k_pe.size(0) && c_kv.size(1) + k_pe.size(1) == kv.size(1),
              "mla_cache_write: c_kv [T, L] and k_pe [T, R] with L + R the cache row");
  TORCH_CHECK(c_kv.scalar_type() == k_pe.scalar_type(), "mla_cache_write: c_kv and k_pe dtypes differ");
  TORCH_CHECK(out_cache_loc.scalar_type() == at::kLong && out_cache_loc.numel() == c_kv.size(0), "mla_cache_write: int64 slot per token");
  const at::Tensor loc = out_cache_loc.contiguous();
  const int64_t* slots = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < loc.numel(); ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < kv.size(0), "mla_cache_write: cache slot ", slots[t], " out of range");
  }
  const bool kv_bf16 = kv.scalar_type() == at::kBFloat16, x_bf16 = c_kv.scalar_type() == at::kBFloat16;
  TORCH_CHECK((kv_bf16 || kv.scalar_type() == at::kFloat) && (x_bf16 || c_kv.scalar_type() == at::kFloat),
              "mla_cache_write: bfloat16 or float32");
  if (kv_bf16 && x_bf16) cache_write_impl<at::BFloat16, at::BFloat16>(kv, slots, c_kv, k_pe);
  else if (kv_bf16) cache_write_impl<at::BFloat16, float>(kv, slots, c_kv, k_pe);
  else if (x_bf16) cache_write_impl<float, at::BFloat16>(kv, slots, c_kv, k_pe);
  else cache_write_impl<float, float>(kv, slots, c_kv, k_pe);
}

// LatentKVPool.copy_slots: every layer's entries of slots src[i] go to slots dst[i] (an accepted
// tree path's nodes moving to their row indices; dst holds distinct slots), as
// kv[:, dst] = kv[:, src]: each layer's sources are read before any is written. Entries already in
// place (src[i] == dst[i]) are skipped.
void copy_cache_slots(at::Tensor kv, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(kv.dim() == 3 && kv.is_contiguous(), "copy_cache_slots: a contiguous cache [layers, slots, dim]");
  TORCH_CHECK(src.dim() == 1 && src.sizes() == dst.sizes() && src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong,
              "copy_cache_slots: int64 src and dst [n]");
  const int64_t layers = kv.size(0), num_slots = kv.size(1), n = src.size(0);
  const at::Tensor src_c = src.contiguous(), dst_c = dst.contiguous();
  const int64_t *sp = src_c.data_ptr<int64_t>(), *dp = dst_c.data_ptr<int64_t>();
  std::vector<int64_t> moves;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots && dp[i] >= 0 && dp[i] < num_slots, "copy_cache_slots: slot ",
                sp[i] < 0 || sp[i] >= num_slots ? sp[i] : dp[i], " outside 0 .. ", num_slots - 1);
    if (sp[i] != dp[i]) moves.push_back(i);
  }
  std::vector<int64_t> sorted_dst(dp, dp + n);
  std::sort(sorted_dst.begin(), sorted_dst.end());
  TORCH_CHECK(std::adjacent_find(sorted_dst.begin(), sorted_dst.end()) == sorted_dst.end(),
              "copy_cache_slots: a destination slot appears twice");
  if (moves.empty()) return;
  const int64_t row_bytes = kv.size(2) * kv.element_size(), count = static_cast<int64_t>(moves.size());
  std::vector<char> staged(count * row_bytes);
  char* base = static_cast<char*>(kv.data_ptr());
  for (int64_t layer = 0; layer < layers; ++layer) {
    char* buf = base + layer * num_slots * row_bytes;
    for (int64_t m = 0; m < count; ++m) std::memcpy(staged.data() + m * row_bytes, buf + sp[moves[m]] * row_bytes, row_bytes);
    for (int64_t m = 0; m < count; ++m) std::memcpy(buf + dp[moves[m]] * row_bytes, staged.data() + m * row_bytes, row_bytes);
  }
}

// KVCacheManager.scratch_slots: [B, scratch] the cache slots of row rows[b]'s row indices
// prefix[b] .. prefix[b] + scratch - 1 (a speculative round's draft scratch and verify tree).
at::Tensor scratch_slots(const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& prefix, int64_t scratch) {
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.is_contiguous() && req_to_token.scalar_type() == at::kLong,
              "scratch_slots: a contiguous int64 req_to_token [R, W]");
  TORCH_CHECK(rows.dim() == 1 && prefix.sizes() == rows.sizes() && rows.scalar_type() == at::kLong &&
                  prefix.scalar_type() == at::kLong && scratch >= 0,
              "scratch_slots: int64 rows [B] and prefix [B], scratch >= 0");
  const int64_t batch = rows.size(0), num_rows = req_to_token.size(0), width = req_to_token.size(1);
  const at::Tensor rows_c = rows.contiguous(), prefix_c = prefix.contiguous();
  const int64_t *rp = rows_c.data_ptr<int64_t>(), *pp = prefix_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(rp[b] >= 0 && rp[b] < num_rows && pp[b] >= 0 && pp[b] + scratch <= width, "scratch_slots: row ", rp[b],
                " at ", pp[b], " + ", scratch, " outside the table [", num_rows, ", ", width, "]");
  }
  at::Tensor out = at::empty({batch, scratch}, req_to_token.options());
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) std::copy_n(table + rp[b] * width + pp[b], scratch, op + b * scratch);
  return out;
}

// KVCacheManager's table entries of newly allocated cache blocks: per row of `blocks` [n, 3]
// (a request row, the block's index in that row, the cache block), the row's entries of that
// block's positions get the block's slots (block * block_size + j), up to the table's width.
void write_block_entries(at::Tensor req_to_token, const at::Tensor& blocks, int64_t block_size) {
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.is_contiguous() && req_to_token.scalar_type() == at::kLong,
              "write_block_entries: a contiguous int64 req_to_token [R, W]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 3 && blocks.scalar_type() == at::kLong && block_size >= 1,
              "write_block_entries: int64 blocks [n, 3] (row, block index, block) and block_size >= 1");
  const int64_t rows = req_to_token.size(0), width = req_to_token.size(1), n = blocks.size(0);
  const at::Tensor blocks_c = blocks.contiguous();
  const int64_t* entry = blocks_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = entry[3 * i], index = entry[3 * i + 1], block = entry[3 * i + 2];
    TORCH_CHECK(row >= 0 && row < rows && index >= 0 && index * block_size < width && block >= 0,
                "write_block_entries: block ", block, " at index ", index, " of row ", row, " outside the table");
  }
  int64_t* table = req_to_token.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = entry[3 * i], start = entry[3 * i + 1] * block_size, block = entry[3 * i + 2];
    const int64_t count = std::min(block_size, width - start);
    int64_t* out = table + row * width + start;
    for (int64_t j = 0; j < count; ++j) out[j] = block * block_size + j;
  }
}

}  // namespace eaglet
