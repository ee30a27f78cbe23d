// SwiGLU MLPs on tile-layout weights: the dense MLP and shared experts (amx_swiglu), and a MoE
// layer's routed experts in one call (moe_routed_experts).
#include "gemm.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>

namespace eaglet {

namespace {

// Rows per thread chunk of the per-row loops around a parallel GEMM (activations, expert sums).
constexpr int64_t kActRowsGrain = 32;

// act = bf16(bf16(silu(bf16(gate))) * bf16(up)) for one row of a float32 [gate | up] GEMM output:
// the roundings of linear -> F.silu -> mul on bfloat16 tensors.
void swiglu_act(const float* gate_up, int64_t inter, at::BFloat16* act) {
#if defined(__AVX512BF16__)
  // The loop below 16 lanes at a time, the same operations on each value.
  for (int64_t j = 0; j < inter; j += kLanes) {
    const __mmask16 m = tail_mask(inter - j);
    const __m512 gate = round_bf16(_mm512_maskz_loadu_ps(m, gate_up + j));
    const __m512 up = round_bf16(_mm512_maskz_loadu_ps(m, gate_up + inter + j));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_xor_ps(gate, _mm512_set1_ps(-0.0f)), _mm512_setzero_ps()));  // exp(-gate - 0)
    const __m512 silu = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    store16_bf16(act + j, _mm512_mul_ps(silu, up), m);
  }
#else
  thread_local std::vector<at::BFloat16> gate_bf16, up_bf16;
  thread_local std::vector<float> silu;
  gate_bf16.resize(inter);
  up_bf16.resize(inter);
  silu.resize(inter);
  store_bf16(gate_bf16.data(), gate_up, nullptr, inter);
  store_bf16(up_bf16.data(), gate_up + inter, nullptr, inter);
  load_row(silu.data(), gate_bf16.data(), inter);
  for (int64_t j = 0; j < inter; ++j) silu[j] = -silu[j];
  exp_shifted_row(silu.data(), 0.0f, inter);  // exp(-gate)
  for (int64_t j = 0; j < inter; ++j) silu[j] = static_cast<float>(gate_bf16[j]) / (1.0f + silu[j]);
  store_bf16(gate_bf16.data(), silu.data(), nullptr, inter);
  load_row(silu.data(), gate_bf16.data(), inter);
  for (int64_t j = 0; j < inter; ++j) silu[j] *= static_cast<float>(up_bf16[j]);
  store_bf16(act, silu.data(), nullptr, inter);
#endif
}

}  // namespace

// SwiGLU (the dense MLP and the shared experts) in one call: x @ [gate; up]^T on the tile GEMM, the
// activation as swiglu_act, then @ down^T, bfloat16 out. Rows are computed alone.
at::Tensor amx_swiglu(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, int64_t inter) {
  TORCH_CHECK(tile_kernels_supported(), "amx_swiglu: this CPU or build has no tile-layout GEMM");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_swiglu: bfloat16 x [T, D]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  check_packed(w13, hidden, 2 * inter, "amx_swiglu gate_up");
  check_packed(w2, inter, hidden, "amx_swiglu down");
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  if (tokens == 0) return out;
  const at::Tensor xr = x.stride(1) == 1 ? x : x.contiguous();
  thread_local std::vector<at::BFloat16> x_pad;
  const at::BFloat16* xp = padded_tiles(xr, w13.size(1), x_pad);
  const int64_t kp_hidden = w13.size(1) * kTileK, kb_inter = w2.size(1), kp_inter = kb_inter * kTileK;
  const int64_t up_groups = w13.size(0) / 4, down_groups = w2.size(0) / 4;
  const int64_t up_width = up_groups * kGroupN, down_width = down_groups * kGroupN;
  const int64_t padded = (tokens + kTileRows - 1) / kTileRows * kTileRows;
  // Scratch of this thread, kept between calls (references, so the workers' lambdas reach the
  // caller's): gate_up and y rows are written before they are read; act's padding must be zero.
  thread_local std::vector<float> gate_up_buffer, y_buffer;
  thread_local std::vector<at::BFloat16> act_buffer;
  std::vector<float>& gate_up = gate_up_buffer;
  std::vector<float>& y = y_buffer;
  std::vector<at::BFloat16>& act = act_buffer;
  gate_up.resize(tokens * up_width);
  y.resize(tokens * down_width);
  assign_zeros(act, padded * kp_inter);
  const bool parallel = worth_threads(tokens, 2 * inter, hidden);
  const at::BFloat16* w13p = w13.data_ptr<at::BFloat16>();
  const at::BFloat16* w2p = w2.data_ptr<at::BFloat16>();
  at::parallel_for(0, up_groups, parallel ? 1 : up_groups, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t g = begin; g < end; ++g) {
      amx_group(xp, tokens, kp_hidden, w13p + g * 4 * w13.size(1) * kTileK * kTileN, w13.size(1), gate_up.data() + g * kGroupN, up_width);
    }
    release_tiles();
  });
  at::parallel_for(0, tokens, parallel ? kActRowsGrain : tokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) swiglu_act(gate_up.data() + t * up_width, inter, act.data() + t * kp_inter);
  });
  at::parallel_for(0, down_groups, parallel ? 1 : down_groups, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t g = begin; g < end; ++g) {
      amx_group(act.data(), tokens, kp_inter, w2p + g * 4 * kb_inter * kTileK * kTileN, kb_inter, y.data() + g * kGroupN, down_width);
    }
    release_tiles();
  });
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < tokens; ++t) store_bf16(op + t * hidden, y.data() + t * down_width, nullptr, hidden);
  return out;
}

// Routed SwiGLU experts of a bfloat16 model in one call: tokens grouped by expert, each expert's
// gate/up and down products on the tile GEMM (amx_group), silu(gate) * up rounded to bfloat16 between
// them as the PyTorch path rounds, and each token's expert outputs weighted and summed in float32
// in ascending expert id. Every (token, expert) row is computed alone: the same bits at any batch.
at::Tensor moe_routed_experts(const at::Tensor& x, const at::Tensor& w13_all, const at::Tensor& w2_all,
                              const at::Tensor& weights, const at::Tensor& ids, int64_t inter) {
  TORCH_CHECK(tile_kernels_supported(), "moe_routed_experts: this CPU or build has no tile-layout GEMM");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "moe_routed_experts: bfloat16 x [T, D]");
  TORCH_CHECK(w13_all.dim() == 6 && w2_all.dim() == 6 && w13_all.size(0) == w2_all.size(0) && w13_all.is_contiguous() &&
                  w2_all.is_contiguous(),
              "moe_routed_experts: every expert's packed w13 and w2 stacked, [E, ...] each");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = w13_all.size(0);
  const at::Tensor w13_first = w13_all[0], w2_first = w2_all[0];
  check_packed(w13_first, hidden, 2 * inter, "moe_routed_experts w13");
  check_packed(w2_first, inter, hidden, "moe_routed_experts w2");
  const at::BFloat16* w13_base = w13_all.data_ptr<at::BFloat16>();
  const at::BFloat16* w2_base = w2_all.data_ptr<at::BFloat16>();
  const int64_t w13_stride = w13_all.stride(0), w2_stride = w2_all.stride(0);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong && weights.sizes() == ids.sizes() &&
                  ids.dim() == 2 && ids.size(0) == tokens,
              "moe_routed_experts: float32 weights and int64 ids, both [T, k]");
  const at::Tensor xc = x.contiguous(), wc = weights.contiguous(), ic = ids.contiguous();
  const int64_t top_k = ids.size(1), assigned = tokens * top_k;
  const int64_t* idp = ic.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  // Assignments grouped by expert, tokens in order within each (a counting sort); each expert's
  // rows start on a whole tile in the padded buffers.
  std::vector<int64_t> count(experts, 0), order(assigned), tile_start(experts + 1, 0);
  for (int64_t a = 0; a < assigned; ++a) {
    TORCH_CHECK(idp[a] >= 0 && idp[a] < experts, "moe_routed_experts: expert id ", idp[a], " out of range");
    ++count[idp[a]];
  }
  std::vector<int64_t> first(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    first[e + 1] = first[e] + count[e];
    tile_start[e + 1] = tile_start[e] + (count[e] + kTileRows - 1) / kTileRows * kTileRows;
  }
  {
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t a = 0; a < assigned; ++a) order[fill[idp[a]]++] = a;
  }
  const int64_t kb_hidden = w13_first.size(1), kb_inter = w2_first.size(1);
  const int64_t kp_hidden = kb_hidden * kTileK, kp_inter = kb_inter * kTileK, padded_rows = tile_start[experts];
  // Scratch of this thread, kept between calls; the inputs' padding must be zero, the outputs'
  // rows are written before they are read.
  thread_local std::vector<at::BFloat16> x_pad, act;
  thread_local std::vector<float> gate_up, expert_out;
  assign_zeros(x_pad, padded_rows * kp_hidden);
  assign_zeros(act, padded_rows * kp_inter);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = 0; r < count[e]; ++r) {
      std::memcpy(x_pad.data() + (tile_start[e] + r) * kp_hidden, xp + (order[first[e] + r] / top_k) * hidden,
                  hidden * sizeof(at::BFloat16));
    }
  }
  const int64_t up_groups = w13_first.size(0) / 4, down_groups = w2_first.size(0) / 4;
  const int64_t up_width = up_groups * kGroupN, down_width = down_groups * kGroupN;
  gate_up.resize(padded_rows * up_width);
  expert_out.resize(padded_rows * down_width);
  const bool parallel = worth_threads(assigned, 2 * inter, hidden);
  // Work items are (active expert, column group), so the threads split the experts in use evenly.
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e]) active.push_back(e);
  }
  const int64_t num_active = static_cast<int64_t>(active.size());
  // out rows (width out_width) of every expert's rows of x (k_blocks tiles of k) times its weight
  auto run_experts = [&](const at::BFloat16* x, int64_t k_blocks, const at::BFloat16* w_base, int64_t w_stride, int64_t n_groups,
                         float* out, int64_t out_width) {
    at::parallel_for(0, num_active * n_groups, parallel ? 1 : num_active * n_groups, [&](int64_t begin, int64_t end) {
      configure_tiles();
      for (int64_t item = begin; item < end; ++item) {
        const int64_t e = active[item / n_groups], g = item % n_groups;
        amx_group(x + tile_start[e] * k_blocks * kTileK, count[e], k_blocks * kTileK,
                  w_base + e * w_stride + g * 4 * k_blocks * kTileK * kTileN, k_blocks, out + tile_start[e] * out_width + g * kGroupN,
                  out_width);
      }
      release_tiles();
    });
  };
  run_experts(x_pad.data(), kb_hidden, w13_base, w13_stride, up_groups, gate_up.data(), up_width);
  // Rows of every expert, padding rows skipped (their act stays zero). The buffers are this
  // thread's: the workers reach them through pointers.
  const float* gate_up_rows = gate_up.data();
  at::BFloat16* act_rows = act.data();
  at::parallel_for(0, padded_rows, parallel ? kActRowsGrain : padded_rows, [&](int64_t begin, int64_t end) {
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t row = std::max(begin, tile_start[e]); row < std::min(end, tile_start[e] + count[e]); ++row) {
        swiglu_act(gate_up_rows + row * up_width, inter, act_rows + row * kp_inter);
      }
    }
  });
  run_experts(act.data(), kb_inter, w2_base, w2_stride, down_groups, expert_out.data(), down_width);
  // where each assignment's output row is
  std::vector<int64_t> row_of(assigned);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = 0; r < count[e]; ++r) row_of[order[first[e] + r]] = tile_start[e] + r;
  }
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float* expert_rows = expert_out.data();
  at::parallel_for(0, tokens, parallel ? kActRowsGrain : tokens, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden);
    std::vector<at::BFloat16> rounded_bf16(hidden);
    std::vector<int64_t> by_id(top_k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < top_k; ++k) by_id[k] = k;
      std::sort(by_id.begin(), by_id.end(), [&](int64_t a, int64_t b) { return idp[t * top_k + a] < idp[t * top_k + b]; });
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k : by_id) {
        const float w = static_cast<float>(at::BFloat16(wp[t * top_k + k]));
        const float* y = expert_rows + row_of[t * top_k + k] * down_width;
        store_bf16(rounded_bf16.data(), y, nullptr, hidden);  // the expert's bfloat16 output
        axpy(acc.data(), w, rounded_bf16.data(), hidden);
      }
      store_bf16(op + t * hidden, acc.data(), nullptr, hidden);
    }
  });
  return out;
}

}  // namespace eaglet
