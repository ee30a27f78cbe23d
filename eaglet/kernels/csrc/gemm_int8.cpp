// GEMMs on int8 weights (--quantization int8): codes int8 [N, K], symmetric, K a multiple of 32;
// scales [N, K / group] (bfloat16 or float32), group a multiple of 32. out [M, N] float32.
//
// - int8_linear (W8A16): x in float32. Per block of 32 k values, lane l's products of k values
//   32b + 8i + l (i = 0..3) in i order, times the block's weight scale, added into the lane's sum.
// - int8_linear_a8 (W8A8, opt-in): x quantized per row to int8 in blocks of 32 as llama.cpp's Q8_0
//   (quantize_q8_0). Per block, lane l's 4 products of k values 32b + 4l .. 32b + 4l + 3 summed
//   exactly in integers (sign / maddubs / madd, as llama.cpp's Q8_0 x Q8_0), converted, times x's
//   block scale, then one multiply-add by the weight's scale into the lane's sum.
//
// The 8 lane sums are reduced in a fixed order (reduce8); threads split the N outputs only, so a
// row's bits depend neither on its batch nor on the threads.
#include "gemm_quant.h"

namespace eaglet {

using namespace quant;

namespace {

constexpr int64_t kBlock = 32;  // k values per int8 block (and per x scale under W8A8)

// Per block of 32 k values, the index of its weight scale group.
std::vector<int32_t> block_groups(int64_t k, int64_t group) {
  std::vector<int32_t> out(k / kBlock);
  for (size_t b = 0; b < out.size(); ++b) out[b] = static_cast<int32_t>(kBlock * b / group);
  return out;
}

// x rows in float32 (W8A16).
struct FloatRows {
  at::Tensor x;
  const float* data;
  int64_t k;
  FloatRows(const at::Tensor& input, int64_t k) : x(input.to(at::kFloat).contiguous()), data(x.data_ptr<float>()), k(k) {}
};

// x rows quantized as Q8_0 (W8A8): codes [M, K] and one scale per block of 32.
struct Q8Rows {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  int64_t k;
  Q8Rows(const at::Tensor& input, int64_t k) : k(k) {
    const int64_t m = input.size(0), blocks = k / kBlock;
    const at::Tensor xf = input.to(at::kFloat).contiguous();
    codes.resize(m * k);
    scales.resize(m * blocks);
    for (int64_t r = 0; r < m; ++r) quantize_q8_0(xf.data_ptr<float>() + r * k, k, blocks, codes.data() + r * k, scales.data() + r * blocks);
  }
};

// out[r][n + j] for x rows r0 .. r0 + NR - 1 and weight rows n .. n + NC - 1 (W8A16).
template <int NR, int NC, typename S>
void w8a16_block(const FloatRows& rows, int64_t r0, const int8_t* codes, const S* scales, int64_t groups,
                 const int32_t* group_of, float* out, int64_t out_stride) {
  constexpr int nr = NR, nc = NC;
  const int64_t k = rows.k, blocks = k / kBlock;
#if defined(EAGLET_QUANT_AVX2)
  __m256 acc[NR][NC];
  zero_sums(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[NC][4];
    __m256 scale[NC];
#pragma GCC unroll 8
    for (int j = 0; j < nc; ++j) {
      const int8_t* block = codes + j * k + b * kBlock;
      if (b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(block + nc * k), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        w[j][i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * i))));
      }
      scale[j] = _mm256_set1_ps(scale_at(scales + j * groups, group_of[b]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; ++r) {
      const float* x = rows.data + (r0 + r) * k + b * kBlock;
#pragma GCC unroll 8
      for (int j = 0; j < nc; ++j) {
        __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(x), w[j][0]);
#pragma GCC unroll 3
        for (int i = 1; i < 4; ++i) dot = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * i), w[j][i], dot);
        acc[r][j] = _mm256_fmadd_ps(dot, scale[j], acc[r][j]);
      }
    }
  }
  store_sums(acc, r0, out, out_stride);
#else
  for (int j = 0; j < nc; ++j) {
    for (int r = 0; r < nr; ++r) {
      const float* x = rows.data + (r0 + r) * k;
      float acc[8] = {0};
      for (int64_t b = 0; b < blocks; ++b) {
        const float s = scale_at(scales + j * groups, group_of[b]);
        for (int l = 0; l < 8; ++l) {
          const int64_t at = b * kBlock + l;
          float dot = x[at] * static_cast<float>(codes[j * k + at]);
          for (int i = 1; i < 4; ++i) dot = std::fma(x[at + 8 * i], static_cast<float>(codes[j * k + at + 8 * i]), dot);
          acc[l] = std::fma(dot, s, acc[l]);
        }
      }
      out[(r0 + r) * out_stride + j] = reduce8(acc);
    }
  }
#endif
}

// out[r][n + j] for x rows r0 .. r0 + NR - 1 and weight rows n .. n + NC - 1 (W8A8).
template <int NR, int NC, typename S>
void w8a8_block(const Q8Rows& rows, int64_t r0, const int8_t* codes, const S* scales, int64_t groups,
                const int32_t* group_of, float* out, int64_t out_stride) {
  constexpr int nr = NR, nc = NC;
  const int64_t k = rows.k, blocks = k / kBlock;
#if defined(EAGLET_QUANT_AVX2)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][NC];
  zero_sums(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i w[NC], w_abs[NC];
    __m256 scale[NC];
#pragma GCC unroll 8
    for (int j = 0; j < nc; ++j) {
      const int8_t* block = codes + j * k + b * kBlock;
      if (b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(block + nc * k), _MM_HINT_T0);
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
      w_abs[j] = _mm256_sign_epi8(w[j], w[j]);
      scale[j] = _mm256_set1_ps(scale_at(scales + j * groups, group_of[b]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.codes.data() + (r0 + r) * k + b * kBlock));
      const __m256 x_scale = _mm256_set1_ps(rows.scales[(r0 + r) * blocks + b]);
#pragma GCC unroll 8
      for (int j = 0; j < nc; ++j) {
        // |w| (at most 128) times x with w's sign: pairs fit int16, 2 * 128 * 127 < 2^15.
        const __m256i pairs = _mm256_maddubs_epi16(w_abs[j], _mm256_sign_epi8(x, w[j]));
        const __m256i lane_sum = _mm256_madd_epi16(pairs, ones);
        acc[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lane_sum), x_scale), scale[j], acc[r][j]);
      }
    }
  }
  store_sums(acc, r0, out, out_stride);
#else
  for (int j = 0; j < nc; ++j) {
    for (int r = 0; r < nr; ++r) {
      const int8_t* x = rows.codes.data() + (r0 + r) * k;
      float acc[8] = {0};
      for (int64_t b = 0; b < blocks; ++b) {
        const float s = scale_at(scales + j * groups, group_of[b]), xs = rows.scales[(r0 + r) * blocks + b];
        for (int l = 0; l < 8; ++l) {
          int32_t sum = 0;
          for (int i = 0; i < 4; ++i) {
            const int64_t at = b * kBlock + 4 * l + i;
            sum += static_cast<int32_t>(codes[j * k + at]) * x[at];
          }
          acc[l] = std::fma(static_cast<float>(sum) * xs, s, acc[l]);
        }
      }
      out[(r0 + r) * out_stride + j] = reduce8(acc);
    }
  }
#endif
}

// The op frame: checks, output, the block -> group table, the N outputs over threads, each thread's
// columns two weight rows at a time for one or two x rows (more would spill past 16 vector
// registers), one at a time for more.
template <typename Rows, typename BlockFn>
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group,
                        const char* op, BlockFn&& block) {
  check_common(x, codes, scales, group, op);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.size(1) == x.size(1), op, ": int8 codes [N, K]");
  TORCH_CHECK(x.size(1) % kBlock == 0, op, ": K a multiple of 32, got ", x.size(1));
  const int64_t m = x.size(0), n = codes.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out;
  const Rows rows(x, k);
  const int8_t* code_data = codes.data_ptr<int8_t>();
  float* out_data = out.data_ptr<float>();
  const int64_t groups = scales.size(1);
  const std::vector<int32_t> group_of = block_groups(k, group);
  auto run = [&](const auto* s) {
    for_outputs(m, n, k, [&](auto rows_at_once, int64_t col0, int64_t cols, int64_t r0) {
      constexpr int nr = decltype(rows_at_once)::value;
      column_blocks<nr <= 2 ? 2 : 1>(col0, cols, [&](auto weight_rows, int64_t col) {
        block(rows_at_once, weight_rows, rows, r0, code_data + col * k, s + col * groups, groups, group_of.data(),
              out_data + col, n);
      });
    });
  };
  with_scales(scales, run);
  return out;
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  return int8_product<FloatRows>(x, codes, scales, group, "int8_linear", [](auto nr, auto nc, auto&&... args) {
    w8a16_block<decltype(nr)::value, decltype(nc)::value>(args...);
  });
}

at::Tensor int8_linear_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  return int8_product<Q8Rows>(x, codes, scales, group, "int8_linear_a8", [](auto nr, auto nc, auto&&... args) {
    w8a8_block<decltype(nr)::value, decltype(nc)::value>(args...);
  });
}

}  // namespace eaglet
