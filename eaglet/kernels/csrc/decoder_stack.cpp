// DecoderStack's forwards: a model's decoder layers (or an EAGLE-3 midlayer) in one call.
#include "decoder_stack.h"
#include "vec.h"

#include <ATen/record_function.h>

#include <algorithm>

namespace eaglet {

namespace {

// f() inside a profiler range called ``name``: the decoder stack calls its kernels directly, not
// through the dispatcher, so without these ranges torch.profiler sees one opaque call per forward.
// With no profiler running a range costs a flag check.
template <typename F>
auto traced(const char* name, F&& f) {
  RECORD_USER_SCOPE(name);
  return f();
}

// a + b of two bfloat16 tensors of one shape: each sum in float32, rounded to bfloat16 (nearest
// even), as at::add computes it, in one vector pass (at::add's bfloat16 loop is several times
// slower). Other dtypes or layouts: at::add.
at::Tensor add_bf16(const at::Tensor& a, const at::Tensor& b) {
#if defined(__AVX512BF16__)
  if (a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && a.sizes() == b.sizes() && a.is_contiguous() &&
      b.is_contiguous()) {
    at::Tensor out = at::empty_like(a);
    const at::BFloat16 *ap = a.data_ptr<at::BFloat16>(), *bp = b.data_ptr<at::BFloat16>();
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    const int64_t n = a.numel();
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = tail_mask(n - i);
      store16_bf16(op + i, _mm512_add_ps(load16(ap + i, m), load16(bp + i, m)), m);
    }
    return out;
  }
#endif
  return at::add(a, b);
}

c10::optional<at::Tensor> optional_entry(const c10::Dict<std::string, at::Tensor>& weights, const std::string& name) {
  return weights.contains(name) ? c10::optional<at::Tensor>(weights.at(name)) : c10::nullopt;
}

// The matrix of role `name`: its tile copy `name`, or quantized `name`_codes and `name`_scales.
StackMatrix matrix_entry(const c10::Dict<std::string, at::Tensor>& weights, const std::string& name,
                         const std::string& quant_format_name, int64_t quant_group, bool int8_activations) {
  StackMatrix m;
  if (!weights.contains(name + "_codes")) {
    m.tiles = weights.at(name);
    return m;
  }
  TORCH_CHECK(quant_group > 0, "DecoderStack.add_layer: ", name, " is quantized: quant_group > 0");
  const QuantFormat format = quant_format(quant_format_name);
  m.quantized = QuantMatrix{weights.at(name + "_codes"), weights.at(name + "_scales"), quant_group, format,
                            int8_activations && format != QuantFormat::kFp8};
  return m;
}

// The SwiGLU's fused tile kernel where both matrices are tile copies; else TorchSwiGLU's ops
// around each matrix's linear (what the layers run one by one for a quantized matrix).
at::Tensor swiglu(const at::Tensor& x, const StackMatrix& w13, const StackMatrix& w2, int64_t inter, int64_t hidden) {
  if (!w13.quantized && !w2.quantized) return amx_swiglu(x, w13.tiles, w2.tiles, inter);
  const at::Tensor gate_up = w13.linear(x, 2 * inter, c10::nullopt);
  return w2.linear(at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter), hidden, c10::nullopt);
}

}  // namespace

at::Tensor StackMatrix::linear(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias) const {
  return quantized ? quantized->linear(x, bias) : amx_linear(x, tiles, n, bias);
}

DecoderStack::DecoderStack(const DecoderStackConfig& config)
    : hidden(config.hidden_size), heads(config.num_heads), nope(config.qk_nope_head_dim), rope(config.qk_rope_head_dim),
      value(config.v_head_dim), latent(config.kv_lora_rank), q_lora(config.q_lora_rank), interleave(config.rope_interleave),
      eps(config.rms_norm_eps), scaling(config.softmax_scale), router(config.router) {}

// weights by role (see StackLayer); mlp_inter: the dense MLP's or shared experts' (0: no shared
// experts), expert_inter: the routed experts' (0: a dense layer).
// quant_format ("int4", "int8", "fp8" or ""), quant_group and int8_activations describe the layer's quantized
// matrices (the roles given as codes and scales), all alike.
void DecoderStack::add_layer(const c10::Dict<std::string, at::Tensor>& weights, int64_t mlp_inter, int64_t expert_inter,
                             const std::string& quant_format, int64_t quant_group, bool int8_activations) {
  const auto matrix = [&](const std::string& name) {
    return matrix_entry(weights, name, quant_format, quant_group, int8_activations);
  };
  StackLayer layer;
  layer.input_norm = weights.at("input_norm");
  layer.post_norm = weights.at("post_norm");
  layer.kv_a_norm = weights.at("kv_a_norm");
  if (weights.contains("hidden_norm")) layer.hidden_norm = weights.at("hidden_norm");
  layer.first = matrix("first");
  layer.first_bias = optional_entry(weights, "first_bias");
  layer.q_proj = matrix("q_proj");
  if (q_lora) layer.q_a_norm = weights.at("q_a_norm");
  layer.attention = {.w_uk = weights.at("w_uk"),
                     .w_uv_t = weights.at("w_uv_t"),
                     .w_uk_packed = optional_entry(weights, "uk_packed"),
                     .w_uv_packed = optional_entry(weights, "uv_packed"),
                     .scale = scaling};
  layer.o_proj = matrix("o_proj");
  layer.o_bias = optional_entry(weights, "o_bias");
  layer.mlp_inter = mlp_inter;
  layer.expert_inter = expert_inter;
  layer.moe = expert_inter > 0;
  if (layer.mlp_inter) {
    layer.mlp_w13 = matrix("mlp_w13");
    layer.mlp_w2 = matrix("mlp_w2");
  }
  if (layer.moe) {
    layer.router_weight = weights.at("router_weight");
    layer.router_bias = weights.at("router_bias");
    layer.experts_w13 = matrix("experts_w13");
    layer.experts_w2 = matrix("experts_w2");
  }
  TORCH_CHECK(layer.moe || layer.mlp_inter, "DecoderStack.add_layer: a layer needs a dense MLP or experts");
  TORCH_CHECK(!layer.moe || layer.experts_w13.quantized.has_value() == layer.experts_w2.quantized.has_value(),
              "DecoderStack.add_layer: routed experts quantized all alike or not at all");
  layers.push_back(std::move(layer));
}

void DecoderStack::set_draft_head(const DraftHead& head) { draft_head = head; }

// The draft head, which `call` needs: set_draft_head must have run.
const DraftHead& DecoderStack::head_of(const char* call) const {
  TORCH_CHECK(draft_head.has_value(), call, ": no draft head (set_draft_head)");
  return *draft_head;
}

// hidden [T, D] bfloat16 in; returns [final hidden (before the model's norm), then the hidden
// after each layer of capture_layers, ascending]. batch.kv: the pool [layers, slots, L + R].
std::vector<at::Tensor> DecoderStack::forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const AbsorbedBatch& batch,
                                              const std::vector<int64_t>& capture_layers) {
  check_inputs(h, batch.kv);
  std::vector<at::Tensor> out{at::Tensor()};
  for (int64_t i = 0; i < num_layers(); ++i) {
    const StackLayer& l = layers[i];
    h = layer_forward(l, i, rms_norm(h, l.input_norm, eps), h, cos, sin, batch);
    if (std::find(capture_layers.begin(), capture_layers.end(), i) != capture_layers.end()) out.push_back(h);
  }
  out[0] = h;
  return out;
}

// The EAGLE-3 midlayer (a stack of one layer added with a "hidden_norm"): attention reads
// cat(input_norm(emb), hidden_norm(h)), h is the residual. Returns the layer's output.
at::Tensor DecoderStack::forward_eagle3(const at::Tensor& emb, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                                        const AbsorbedBatch& batch) {
  TORCH_CHECK(num_layers() == 1 && layers[0].hidden_norm.defined(), "DecoderStack.forward_eagle3: a stack of one EAGLE-3 midlayer");
  TORCH_CHECK(emb.sizes() == h.sizes() && emb.scalar_type() == h.scalar_type(), "DecoderStack.forward_eagle3: emb and hidden differ in shape");
  check_inputs(h, batch.kv);
  const StackLayer& l = layers[0];
  const at::Tensor x = at::cat({rms_norm(emb, l.input_norm, eps), rms_norm(h, l.hidden_norm, eps)}, -1);
  return layer_forward(l, 0, x, h, cos, sin, batch);
}

void DecoderStack::check_inputs(const at::Tensor& h, const at::Tensor& kv) const {
  TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden && h.scalar_type() == at::kBFloat16, "DecoderStack: bfloat16 hidden [T, ", hidden, "]");
  TORCH_CHECK(kv.dim() == 3 && kv.size(0) == num_layers(), "DecoderStack: cache pool [", num_layers(), ", slots, L + R]");
}

// One layer: h + attention(x), then + the MLP of its norm; x is the normed attention input.
// Each step runs in a profiler range (traced), so torch.profiler shows where a forward's time goes.
at::Tensor DecoderStack::layer_forward(const StackLayer& l, int64_t index, const at::Tensor& x, at::Tensor h, const at::Tensor& cos,
                                       const at::Tensor& sin, const AbsorbedBatch& batch) {
  const int64_t tokens = h.size(0), offset = q_lora ? q_lora : 0;
  const at::Tensor down = traced("eaglet.stack.down_proj", [&] { return l.first.linear(x, offset + latent + rope, l.first_bias); });
  const at::Tensor q = traced("eaglet.stack.q_proj", [&] {
    const at::Tensor q_in = q_lora ? rms_norm(down.narrow(1, 0, q_lora), l.q_a_norm, eps) : x;
    return l.q_proj.linear(q_in, heads * (nope + rope), c10::nullopt).view({tokens, heads, nope + rope});
  });
  at::Tensor layer_kv = batch.kv.select(0, index);
  const at::Tensor q_pe = traced("eaglet.stack.rope_and_cache_write", [&] {
    const at::Tensor c_kv = rms_norm(down.narrow(1, offset, latent), l.kv_a_norm, eps);
    auto [q_rot, k_rot] = rope_query_key(q.narrow(2, nope, rope), down.narrow(1, offset + latent, rope), cos, sin, interleave);
    mla_cache_write(layer_kv, batch.out_cache_loc, c_kv, k_rot);
    return q_rot;
  });
  const at::Tensor attn = traced("eaglet.stack.attention", [&] {
    return mla_absorbed_attention(q.narrow(2, 0, nope), q_pe, layer_kv, l.attention, batch.attention);
  });
  h = traced("eaglet.stack.o_proj", [&] {
    return add_bf16(h, reduced(l.o_proj.linear(attn.view({tokens, heads * value}), hidden, l.o_bias)));
  });
  const at::Tensor y = rms_norm(h, l.post_norm, eps);
  at::Tensor mlp;
  if (l.moe) {
    const auto route = traced("eaglet.stack.router", [&] {
      return noaux_route(y, l.router_weight, l.router_bias, router);
    });
    mlp = traced("eaglet.stack.routed_experts", [&] {
      const auto& [weights, ids] = route;
      if (l.experts_w13.quantized) return quantized_routed_experts(y, *l.experts_w13.quantized, *l.experts_w2.quantized, weights, ids);
      return moe_routed_experts(y, l.experts_w13.tiles, l.experts_w2.tiles, weights, ids, l.expert_inter);
    });
    if (l.mlp_inter) {
      mlp = traced("eaglet.stack.shared_experts", [&] { return add_bf16(mlp, swiglu(y, l.mlp_w13, l.mlp_w2, l.mlp_inter, hidden)); });
    }
  } else {
    mlp = traced("eaglet.stack.mlp", [&] { return swiglu(y, l.mlp_w13, l.mlp_w2, l.mlp_inter, hidden); });
  }
  return add_bf16(h, reduced(mlp));
}

at::Tensor DecoderStack::reduced(at::Tensor partial) const {
  if (group) traced("eaglet.stack.all_reduce", [&] { shm_all_reduce(*group, partial); return 0; });
  return partial;
}

}  // namespace eaglet
