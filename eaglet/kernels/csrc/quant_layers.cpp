// Layers on quantized matrices (QuantMatrix): a linear, a SwiGLU and a MoE layer's routed experts
// (quantized_routed_experts), for the decoder stack and for the layers run one by one. They call
// the ATen ops that eaglet/backends/pytorch/quantized_weights.py's QuantizedExperts and
// TorchSwiGLU call, in the same order, so C++ and Python give the same bits.
#include "ops.h"

#include <algorithm>
#include <numeric>

namespace eaglet {

QuantFormat quant_format(const std::string& name) {
  if (name == "int4") return QuantFormat::kInt4;
  if (name == "int8") return QuantFormat::kInt8;
  TORCH_CHECK(name == "fp8", "quantized matrix format 'int4', 'int8' or 'fp8', got '", name, "'");
  return QuantFormat::kFp8;
}

QuantMatrix QuantMatrix::expert(int64_t e) const {
  return {codes.select(0, e), scales.select(0, e), group, format, int8_activations};
}

at::Tensor QuantMatrix::product(const at::Tensor& x) const {
  switch (format) {
    case QuantFormat::kInt4:
      return int8_activations ? int4_linear_a8(x, codes, scales, group) : int4_linear(x, codes, scales, group);
    case QuantFormat::kInt8:
      return int8_activations ? int8_linear_a8(x, codes, scales, group) : int8_linear(x, codes, scales, group);
    case QuantFormat::kFp8:
      break;
  }
  return fp8_linear(x, codes, scales, group);
}

// KernelQuantizedLinear.apply: the float32 product, plus the bias in float32, rounded to x's dtype once.
at::Tensor QuantMatrix::linear(const at::Tensor& x, const c10::optional<at::Tensor>& bias) const {
  at::Tensor out = product(x);
  if (bias) out = out + bias->to(at::kFloat);
  return out.to(x.scalar_type());
}

// TorchSwiGLU.apply: down(silu(gate) * up), gate and up the halves of one product, in x's dtype.
at::Tensor quantized_swiglu(const at::Tensor& x, const QuantMatrix& w13, const QuantMatrix& w2) {
  const at::Tensor gate_up = w13.linear(x, c10::nullopt);
  const int64_t inter = gate_up.size(1) / 2;
  return w2.linear(at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter), c10::nullopt);
}

// QuantizedExperts.apply: each chosen expert's tokens in one product per matrix, then each token's
// experts summed in float32 in ascending expert id (an order that depends on its own routing only):
// out = e_0 * w_0, then out = out + e_j * w_j, each product and sum rounded on its own.
at::Tensor quantized_routed_experts(const at::Tensor& x, const QuantMatrix& w13, const QuantMatrix& w2,
                                    const at::Tensor& weights, const at::Tensor& ids) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "quantized_routed_experts: x [T, H], weights and ids [T, k]");
  const int64_t tokens = x.size(0), top_k = ids.size(1), hidden = x.size(1), num_experts = w13.codes.size(0);
  const at::Tensor ids64 = ids.to(at::kLong).contiguous();
  const at::Tensor scale32 = weights.to(at::kFloat).contiguous();
  const int64_t* id = ids64.data_ptr<int64_t>();
  const float* scale = scale32.data_ptr<float>();
  // Slots of each token in ascending expert id (stable: argsort(stable=True)), and per expert the
  // flat slots t * k + j that chose it, in slot order.
  std::vector<int64_t> sorted_ids(tokens * top_k);
  std::vector<float> sorted_scale(tokens * top_k);
  std::vector<std::vector<int64_t>> slots_of(num_experts);
  std::vector<int64_t> order(top_k);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[t * top_k + a] < id[t * top_k + b]; });
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = id[t * top_k + order[j]];
      TORCH_CHECK(e >= 0 && e < num_experts, "quantized_routed_experts: expert id ", e, " out of [0, ", num_experts, ")");
      sorted_ids[t * top_k + j] = e;
      sorted_scale[t * top_k + j] = scale[t * top_k + order[j]];
    }
  }
  for (int64_t s = 0; s < tokens * top_k; ++s) slots_of[sorted_ids[s]].push_back(s);
  at::Tensor expert_out = at::empty({tokens * top_k, hidden}, x.options().dtype(at::kFloat));
  for (int64_t e = 0; e < num_experts; ++e) {
    const std::vector<int64_t>& slots = slots_of[e];
    if (slots.empty()) continue;
    std::vector<int64_t> rows(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) rows[i] = slots[i] / top_k;
    const at::Tensor picked = tokens == 1 ? x : x.index_select(0, at::tensor(rows, ids64.options()));
    const at::Tensor y = quantized_swiglu(picked, w13.expert(e), w2.expert(e)).to(at::kFloat).contiguous();
    const float* src = y.data_ptr<float>();
    float* dst = expert_out.data_ptr<float>();
    for (size_t i = 0; i < slots.size(); ++i) std::copy_n(src + i * hidden, hidden, dst + slots[i] * hidden);
  }
  at::Tensor out = at::empty({tokens, hidden}, x.options().dtype(at::kFloat));
  const float* eo = expert_out.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = o + t * hidden;
    for (int64_t j = 0; j < top_k; ++j) {
      const float w = sorted_scale[t * top_k + j];
      const float* term = eo + (t * top_k + j) * hidden;
      if (j == 0) {
        for (int64_t c = 0; c < hidden; ++c) row[c] = term[c] * w;
      } else {
        for (int64_t c = 0; c < hidden; ++c) row[c] = row[c] + term[c] * w;
      }
    }
  }
  return out.to(x.scalar_type());
}

// The op Python calls (torch.ops.eaglet.quantized_routed_experts): format "int4", "int8" or "fp8"
// (codes as uint8), int8_activations for the integer formats only.
at::Tensor quantized_routed_experts_op(const at::Tensor& x, const at::Tensor& w13_codes, const at::Tensor& w13_scales,
                                       const at::Tensor& w2_codes, const at::Tensor& w2_scales, int64_t group,
                                       const std::string& format, bool int8_activations, const at::Tensor& weights,
                                       const at::Tensor& ids) {
  const QuantFormat fmt = quant_format(format);
  TORCH_CHECK(w13_codes.dim() == 3 && w2_codes.dim() == 3 && w13_codes.size(0) == w2_codes.size(0),
              "quantized_routed_experts: stacked codes [E, N, K']");
  TORCH_CHECK(!(fmt == QuantFormat::kFp8 && int8_activations), "quantized_routed_experts: int8 activations run integer weights only");
  return quantized_routed_experts(x, {w13_codes, w13_scales, group, fmt, int8_activations},
                                  {w2_codes, w2_scales, group, fmt, int8_activations}, weights, ids);
}

}  // namespace eaglet
