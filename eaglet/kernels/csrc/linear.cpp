// GEMMs on tile-layout weights: amx_linear (x @ W^T + bias, rounded to bfloat16) and
// amx_linear_argmax (an lm_head's greedy ids without its logits).
#include "gemm.h"
#include "ops.h"
#include "vec.h"

#include <limits>

namespace eaglet {

namespace {

// The checked inputs of a GEMM on a weight packed by amx_pack_weight: x [M, K] bfloat16, its rows
// zero-padded to whole tiles in a buffer of the calling thread (x_pad(), made on first use), and a
// bfloat16 bias [N] or none.
struct AmxLinearInputs {
  const at::Tensor& x;
  int64_t m, k_blocks, kp, group_elems;
  const at::BFloat16* weight;
  at::Tensor bias_c;
  const at::BFloat16* bias_data;

  AmxLinearInputs(const at::Tensor& x_, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias, const char* op)
      : x(x_) {
    TORCH_CHECK(tile_kernels_supported(), op, ": this CPU or build has no tile-layout GEMM");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": bfloat16 x [M, K]");
    check_packed(packed, x.size(1), n, op);
    if (bias) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, op, ": bfloat16 bias [N]");
    m = x.size(0);
    k_blocks = packed.size(1);
    kp = k_blocks * kTileK;
    group_elems = 4 * k_blocks * kTileK * kTileN;
    weight = packed.data_ptr<at::BFloat16>();
    bias_c = bias ? bias->contiguous() : at::Tensor();
    bias_data = bias ? bias_c.data_ptr<at::BFloat16>() : nullptr;
  }

  const at::BFloat16* x_pad() const {
    thread_local std::vector<at::BFloat16> buffer;
    return padded_tiles(x.stride(1) == 1 ? x : x.contiguous(), k_blocks, buffer);
  }
};

// A running argmax over a row's columns, fed in column order in pieces: torch's rule (the first
// NaN, else the first maximum). With AVX-512, per lane: the lane's first maximum (a strict compare
// keeps it) and its first NaN; the lanes are combined once, at the end.
struct RunningArgmax {
#if defined(__AVX512BF16__)
  __m512 value = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i index = _mm512_setzero_si512();
  __m512i nan_index = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());

  // Columns first .. first + n - 1 (n <= 16) hold float(bfloat16(sums + bias)).
  void add16(const float* sums, const at::BFloat16* bias, int32_t first, int64_t n) {
    const __mmask16 m = tail_mask(n);
    __m512 v = _mm512_maskz_loadu_ps(m, sums);
    if (bias) v = _mm512_add_ps(v, load16(bias, m));
    v = round_bf16(v);
    const __m512i columns = _mm512_add_epi32(_mm512_set1_epi32(first), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __mmask16 greater = _mm512_mask_cmp_ps_mask(m, v, value, _CMP_GT_OQ);
    value = _mm512_mask_blend_ps(greater, value, v);
    index = _mm512_mask_blend_epi32(greater, index, columns);
    const __mmask16 first_nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q) &
                                _mm512_cmpeq_epi32_mask(nan_index, _mm512_set1_epi32(std::numeric_limits<int32_t>::max()));
    nan_index = _mm512_mask_blend_epi32(first_nan, nan_index, columns);
  }

  void finish(float& best_value, int64_t& best_index, bool& has_nan) const {
    const int32_t nan_at = _mm512_reduce_min_epi32(nan_index);
    has_nan = nan_at != std::numeric_limits<int32_t>::max();
    if (has_nan) {
      best_value = std::numeric_limits<float>::quiet_NaN();
      best_index = nan_at;
      return;
    }
    best_value = _mm512_reduce_max_ps(value);
    // Lanes never above -inf keep index 0 of the piece they started in: an all -inf row's answer.
    const __mmask16 at_max = _mm512_cmp_ps_mask(value, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
    best_index = _mm512_mask_reduce_min_epi32(at_max, index);
  }
#else
  float value = 0.0f;
  int64_t index = -1;
  bool nan = false;

  void add16(const float* sums, const at::BFloat16* bias, int32_t first, int64_t n) {
    for (int64_t i = 0; i < n && !nan; ++i) {
      const float v = static_cast<float>(at::BFloat16(bias ? sums[i] + static_cast<float>(bias[i]) : sums[i]));
      if (std::isnan(v)) {
        value = v, index = first + i, nan = true;
      } else if (index < 0 || v > value) {
        value = v, index = first + i;
      }
    }
  }

  void finish(float& best_value, int64_t& best_index, bool& has_nan) const {
    best_value = value, best_index = index, has_nan = nan;
  }
#endif
};

}  // namespace

// x [M, K] @ W^T with W packed by amx_pack_weight, out bfloat16 [M, N] (+ bias). Each output row
// comes from its own tile row: its bits do not depend on M or on the other rows.
// x @ W^T (+ bias) on the tile GEMM, rounded to bfloat16; ``widened``: those bfloat16 values as float32
// (an lm_head's logits, which callers take in float32).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                      bool widened) {
  const AmxLinearInputs in(x, packed, n, bias, "amx_linear");
  const int64_t m = in.m, k_blocks = in.k_blocks, kp = in.kp, group_elems = in.group_elems, n_groups = packed.size(0) / 4;
  at::Tensor out = at::empty({m, n}, x.options().dtype(widened ? at::kFloat : at::kBFloat16));
  if (m == 0) return out;
  const at::BFloat16 *xp = in.x_pad(), *wp = in.weight, *bp = in.bias_data;
  at::BFloat16* op = widened ? nullptr : out.data_ptr<at::BFloat16>();
  float* op_widened = widened ? out.data_ptr<float>() : nullptr;
  at::parallel_for(0, n_groups, worth_threads(m, n, kp) ? 1 : n_groups, [&](int64_t begin, int64_t end) {
    configure_tiles();
    // Scratch of this thread, kept between calls (rows are written before they are read): a fresh
    // vector of a verify's rows is an allocation zeroed, and past 128 KB a mapping faulted in.
    thread_local std::vector<float> c;
    c.resize(m * kGroupN);
    for (int64_t g = begin; g < end; ++g) {
      amx_group(xp, m, kp, wp + g * group_elems, k_blocks, c.data(), kGroupN);
      const int64_t cols = std::min(kGroupN, n - g * kGroupN);
      for (int64_t r = 0; r < m; ++r) {  // bias added to the float32 sum, then one rounding
        const float* sums = c.data() + r * kGroupN;
        const at::BFloat16* bias_g = bp ? bp + g * kGroupN : nullptr;
        if (widened) {
          store_bf16_widened(op_widened + r * n + g * kGroupN, sums, bias_g, cols);
        } else {
          store_bf16(op + r * n + g * kGroupN, sums, bias_g, cols);
        }
      }
    }
    release_tiles();
  });
  return out;
}

// The argmax of each row of amx_linear(x, packed, n, bias, widened=true) without writing the logits:
// each thread keeps a running argmax per row over its column groups, and the threads' answers are
// merged in column order (the first NaN, else the first maximum, as torch.argmax). [M] int64.
at::Tensor amx_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(n > 0 && n < std::numeric_limits<int32_t>::max(), "amx_linear_argmax: 1 to 2^31 - 2 columns");
  const AmxLinearInputs in(x, packed, n, bias, "amx_linear_argmax");
  const int64_t m = in.m, k_blocks = in.k_blocks, kp = in.kp, group_elems = in.group_elems, n_groups = (n + kGroupN - 1) / kGroupN;
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  if (m == 0) return out;
  const at::BFloat16 *xp = in.x_pad(), *wp = in.weight, *bp = in.bias_data;
  struct Best {
    float value;
    int64_t index;
    bool nan;
  };
  // A chunk of groups leaves its rows' answers at its first group's rows, marked in chunk_first.
  std::vector<Best> bests(n_groups * m);
  std::vector<char> chunk_first(n_groups, 0);
  at::parallel_for(0, n_groups, worth_threads(m, n, kp) ? 1 : n_groups, [&](int64_t begin, int64_t end) {
    configure_tiles();
    thread_local std::vector<float> c;  // as amx_linear's
    c.resize(m * kGroupN);
    std::vector<RunningArgmax> running(m);
    for (int64_t g = begin; g < end; ++g) {
      amx_group(xp, m, kp, wp + g * group_elems, k_blocks, c.data(), kGroupN);
      const int64_t cols = std::min(kGroupN, n - g * kGroupN);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < cols; j += kTileN) {
          const int64_t col = g * kGroupN + j;
          running[r].add16(c.data() + r * kGroupN + j, bp ? bp + col : nullptr, static_cast<int32_t>(col), std::min(kTileN, cols - j));
        }
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      Best& b = bests[begin * m + r];
      running[r].finish(b.value, b.index, b.nan);
    }
    chunk_first[begin] = 1;
    release_tiles();
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    Best b{0.0f, -1, false};
    for (int64_t g = 0; g < n_groups; ++g) {
      if (!chunk_first[g]) continue;
      const Best& chunk = bests[g * m + r];
      if (b.index < 0 || (!b.nan && (chunk.nan || chunk.value > b.value))) b = chunk;
    }
    op[r] = b.index;
  }
  return out;
}

}  // namespace eaglet
