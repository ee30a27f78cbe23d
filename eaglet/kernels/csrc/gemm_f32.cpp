// float32 GEMMs whose rows do not depend on their batch (f32_linear): x [M, K] times a weight packed
// by f32_pack_weight into panels of 8 output columns ([ceil(N / 8), K, 8]), plus a bias.
//
// oneDNN and MKL pick blocking, and so the order of a dot product's partial sums, by the row count:
// the same token gives other bits in a batch of 1 than of 16. Here each output is one fused
// multiply-add chain over k in order, from zero, then the bias: the bits of a row depend only on
// that row, on any row count, thread count and instruction set (FMA rounds once, as std::fma does).
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>

namespace eaglet {

namespace {

constexpr int64_t kPanel = 8;          // output columns per panel: one AVX2 vector
constexpr int64_t kPanelsPerTask = 8;  // 64 columns per thread task
constexpr int64_t kChunkK = 256;       // k per pass: a task's panels stay in L2 across its rows

// acc[r][p] (R rows x P panels of 8 columns) continues its chains over k in [k0, k1).
template <int R, int P>
inline void chains(const float* x, int64_t ldx, const float* panels, int64_t K, int64_t k0, int64_t k1, float* acc) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) a[r][p] = _mm256_loadu_ps(acc + (r * P + p) * kPanel);
  for (int64_t k = k0; k < k1; ++k) {
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * ldx + k);
    for (int p = 0; p < P; ++p) {
      const __m256 w = _mm256_loadu_ps(panels + (p * K + k) * kPanel);
      for (int r = 0; r < R; ++r) a[r][p] = _mm256_fmadd_ps(xb[r], w, a[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) _mm256_storeu_ps(acc + (r * P + p) * kPanel, a[r][p]);
#else
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int64_t c = 0; c < kPanel; ++c) {
        float s = acc[(r * P + p) * kPanel + c];
        for (int64_t k = k0; k < k1; ++k) s = std::fma(x[r * ldx + k], panels[(p * K + k) * kPanel + c], s);
        acc[(r * P + p) * kPanel + c] = s;
      }
#endif
}

// Rows [0, m) of x against P panels: R rows at a time (12 accumulators and a weight in 16 registers).
template <int P>
void rows_by_panels(const float* x, int64_t ldx, int64_t m, const float* panels, int64_t K, int64_t k0, int64_t k1,
                    float* acc) {
  constexpr int R = P >= 4 ? 3 : 4;
  int64_t r = 0;
  for (; r + R <= m; r += R) chains<R, P>(x + r * ldx, ldx, panels, K, k0, k1, acc + r * P * kPanel);
  for (; r < m; ++r) chains<1, P>(x + r * ldx, ldx, panels, K, k0, k1, acc + r * P * kPanel);
}

}  // namespace

at::Tensor f32_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "f32_pack_weight: float32 weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), num_panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({num_panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({num_panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "f32_linear: float32 x [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() && panels.size(2) == kPanel &&
                  panels.size(1) == x.size(1) && panels.size(0) == (n + kPanel - 1) / kPanel,
              "f32_linear: panels are f32_pack_weight's [ceil(N / 8), K, 8] copy of a [", n, ", ", x.size(1), "] weight");
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "f32_linear: float32 bias [N]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();
  const int64_t m = xc.size(0), K = xc.size(1), num_panels = panels.size(0);
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias ? bias_c.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t tasks = (num_panels + kPanelsPerTask - 1) / kPanelsPerTask;
  const int64_t grain = m * n * K >= kParallelWork * 8 ? 1 : tasks;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(m * kPanelsPerTask * kPanel);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p0 = task * kPanelsPerTask, num = std::min(kPanelsPerTask, num_panels - p0);
      const float* task_panels = wp + p0 * K * kPanel;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
        const int64_t k1 = std::min(K, k0 + kChunkK);
        // Four panels at a time, the rest one by one: either way each column's chain runs over k in order.
        int64_t p = 0;
        for (; p + 4 <= num; p += 4) rows_by_panels<4>(xp, K, m, task_panels + p * K * kPanel, K, k0, k1, acc.data() + p * m * kPanel);
        for (; p < num; ++p) rows_by_panels<1>(xp, K, m, task_panels + p * K * kPanel, K, k0, k1, acc.data() + p * m * kPanel);
      }
      // acc holds, per block of panels, [rows][panels in the block][8]: unpack into out's columns.
      int64_t p = 0;
      while (p < num) {
        const int64_t width = p + 4 <= num ? 4 : 1;
        const float* block = acc.data() + p * m * kPanel;
        for (int64_t r = 0; r < m; ++r)
          for (int64_t q = 0; q < width; ++q)
            for (int64_t c = 0; c < kPanel; ++c) {
              const int64_t col = (p0 + p + q) * kPanel + c;
              if (col < n) op[r * n + col] = block[(r * width + q) * kPanel + c] + (bp ? bp[col] : 0.0f);
            }
        p += width;
      }
    }
  });
  return out;
}

}  // namespace eaglet
