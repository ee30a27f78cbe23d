// The kernels' entry points, by the file that holds each: what registration.cpp registers under
// torch.ops.eaglet and the decoder stack calls directly. Fused CPU kernels for the decode path:
// RMSNorm, rotary, DeepSeek-V3 routing, the latent cache write and absorbed MLA attention over the
// paged cache; bfloat16 GEMMs, SwiGLU and the routed experts on weights in the tile layout
// (gemm.h); greedy and top-k sampling; a speculative round's tree, verification and commit; the
// cache's bookkeeping. Each replaces a chain of small PyTorch ops whose per-op dispatch (not
// arithmetic) dominates a decode step of a small model.
#pragma once

#include "common.h"

#include <string>
#include <tuple>
#include <vector>

namespace eaglet {

// norm.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// rope.cpp
std::tuple<at::Tensor, at::Tensor> rope_query_key(const at::Tensor& q_pe, const at::Tensor& k_pe, const at::Tensor& cos,
                                                  const at::Tensor& sin, bool interleave);

// routing.cpp
void top_indices(const float* values, int64_t n, int64_t k, int64_t* out);

// DeepSeek-V3's routing rule: each token's top_k experts by sigmoid score plus bias, among the
// topk_group best of n_group expert groups (each scored by its two best experts); their scores
// normalised to sum 1 (norm_topk_prob) and multiplied by scaling.
struct RouterConfig {
  int64_t top_k, n_group, topk_group;
  bool norm_topk_prob;
  double scaling;
};

std::tuple<at::Tensor, at::Tensor> noaux_route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                               const RouterConfig& router);

// attention.cpp

// What absorbed attention takes from a layer: W_UK [H, P, L] and W_UV^T [H, L, V] in float32, their
// tile copies (both or neither: [H, ...] stacks of amx_pack_weight's W_UK^T and W_UV, for bfloat16
// queries) and the softmax scale.
struct AbsorbedLayer {
  at::Tensor w_uk, w_uv_t;
  c10::optional<at::Tensor> w_uk_packed, w_uv_packed;
  double scale;
};

// Where a batch's keys are, the same for every layer: slots [B, S] (each request's cache slots by
// row index), kv_lens [B] (its number of keys), token_starts [B + 1] (its first token, then T) and
// custom_mask [T, S] bool (the keys each token sees; none: causal).
struct AttentionMetadata {
  at::Tensor slots, kv_lens, token_starts;
  c10::optional<at::Tensor> custom_mask;
};

at::Tensor mla_absorbed_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv,
                                  const AbsorbedLayer& layer, const AttentionMetadata& metadata);

// cache.cpp
void mla_cache_write(at::Tensor kv, const at::Tensor& out_cache_loc, const at::Tensor& c_kv, const at::Tensor& k_pe);
void copy_cache_slots(at::Tensor kv, const at::Tensor& src, const at::Tensor& dst);
at::Tensor scratch_slots(const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& prefix, int64_t scratch);
void write_block_entries(at::Tensor req_to_token, const at::Tensor& blocks, int64_t block_size);

// gemm_pack.cpp
std::string tile_backend();
at::Tensor amx_pack_weight(const at::Tensor& weight);

// gemm_f32.cpp: float32 GEMMs on weights in 8-column panels, each output one chain over k.
at::Tensor f32_pack_weight(const at::Tensor& weight);
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias);

// linear.cpp
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                      bool widened = false);
at::Tensor amx_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias);

// gemm_quant.cpp: x [M, K] times a quantized [N, K] weight's transpose, float32 [M, N]
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group);
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group);
// gemm_int4_a8.cpp: int4_linear's weights against x quantized per row to int8 in blocks of 32 (W4A8)
at::Tensor int4_linear_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group);
// gemm_int8.cpp: int8 codes [N, K] (W8A16), and against x quantized as int4_linear_a8's (W8A8)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group);
at::Tensor int8_linear_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group);

// quant_layers.cpp: a quantized matrix as QuantizedMatrix holds it (codes: int4 int32 [.., N, K / 8],
// int8 [.., N, K], or fp8 as uint8 [.., N, K]; scales [.., N, K / group]) and how the kernels multiply it.
enum class QuantFormat { kInt4, kInt8, kFp8 };
QuantFormat quant_format(const std::string& name);  // "int4", "int8" or "fp8"
struct QuantMatrix {
  at::Tensor codes, scales;
  int64_t group;
  QuantFormat format;
  bool int8_activations;  // W4A8 / W8A8 (integer formats only)
  QuantMatrix expert(int64_t e) const;  // one matrix of an [E, N, K'] stack
  at::Tensor product(const at::Tensor& x) const;  // float32 [M, N]
  at::Tensor linear(const at::Tensor& x, const c10::optional<at::Tensor>& bias) const;  // in x's dtype
};
at::Tensor quantized_swiglu(const at::Tensor& x, const QuantMatrix& w13, const QuantMatrix& w2);
at::Tensor quantized_routed_experts(const at::Tensor& x, const QuantMatrix& w13, const QuantMatrix& w2,
                                    const at::Tensor& weights, const at::Tensor& ids);
at::Tensor quantized_routed_experts_op(const at::Tensor& x, const at::Tensor& w13_codes, const at::Tensor& w13_scales,
                                       const at::Tensor& w2_codes, const at::Tensor& w2_scales, int64_t group,
                                       const std::string& format, bool int8_activations, const at::Tensor& weights,
                                       const at::Tensor& ids);

// moe.cpp
at::Tensor amx_swiglu(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, int64_t inter);
at::Tensor moe_routed_experts(const at::Tensor& x, const at::Tensor& w13_all, const at::Tensor& w2_all,
                              const at::Tensor& weights, const at::Tensor& ids, int64_t inter);

// sampling.cpp
at::Tensor argmax_last_dim(const at::Tensor& logits, const c10::optional<at::Tensor>& offsets);
std::vector<at::Tensor> topk_logprobs(const at::Tensor& logits, int64_t k, const c10::optional<at::Tensor>& offsets);

// spec_verify.cpp
at::Tensor verify_tree_greedy(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& logits);
at::Tensor verify_tree_greedy_ids(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_ids);
std::vector<at::Tensor> commit_table(const at::Tensor& verify_table, const at::Tensor& tokens, const at::Tensor& slots,
                                     const at::Tensor& prefix);

// spec_tree.cpp
std::vector<at::Tensor> select_draft_tree(const at::Tensor& tokens, const at::Tensor& scores, const at::Tensor& parents,
                                          const at::Tensor& depths, const at::Tensor& roots, int64_t num_nodes);
at::Tensor tree_attention_mask(const at::Tensor& parents, const at::Tensor& prefix, int64_t num_keys);

}  // namespace eaglet
