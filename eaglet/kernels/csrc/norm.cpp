// RMSNorm (RMSNorm.forward in one call).
#include "ops.h"
#include "vec.h"

#include <type_traits>

namespace eaglet {

namespace {

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t dim = x.size(-1);
  const int64_t rows = x.numel() / dim;
  const int64_t row_stride = x.dim() == 2 ? x.stride(0) : dim;  // rows of a 2-d x may be apart (a narrow)
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kParallelWork / dim);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    const float* row_ptr = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * row_stride;
      T* orow = op + r * dim;
      load_row(row.data(), xr, dim);
      float sum_square;
      dot_rows<1>(&row_ptr, row.data(), dim, &sum_square);
      const float mean_square = sum_square / static_cast<float>(dim);
      const float inv_rms = 1.0f / std::sqrt(mean_square + static_cast<float>(eps));
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {  // the loop below, 16 lanes at a time
        const __m512 inv = _mm512_set1_ps(inv_rms);
        for (int64_t i = 0; i < dim; i += kLanes) {
          const __mmask16 m = tail_mask(dim - i);
          const __m512 normed = round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row.data() + i), inv));
          store16_bf16(orow + i, _mm512_mul_ps(load16(wp + i, m), normed), m);
        }
        continue;
      }
#endif
      for (int64_t i = 0; i < dim; ++i) {
        // normalized in float32, rounded to the input dtype, then scaled by the weight in that dtype
        const float normed = to_float(from_float<T>(to_float(xr[i]) * inv_rms));
        orow[i] = from_float<T>(to_float(wp[i]) * normed);
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [hidden]");
  // A 2-d x whose rows are contiguous is read in place (the stack normalises column slices).
  const at::Tensor xc = x.dim() == 2 && x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  if (xc.scalar_type() == at::kBFloat16) {
    rms_norm_impl<at::BFloat16>(xc, wc, eps, out);
  } else {
    TORCH_CHECK(xc.scalar_type() == at::kFloat, "rms_norm: bfloat16 or float32 input");
    rms_norm_impl<float>(xc, wc, eps, out);
  }
  return out;
}

}  // namespace eaglet
