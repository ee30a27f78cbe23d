// DecoderStack (torch.classes.eaglet.DecoderStack): a bfloat16 DeepSeek-V3 model's decoder layers,
// or an MLA EAGLE-3 draft's midlayer, in one call per forward (decoder_stack.cpp), and a draft's
// extend and a speculative round's whole drafting in one call each (draft.cpp).
#pragma once

#include "ops.h"

#include <torch/custom_class.h>

#include <string>
#include <vector>

namespace eaglet {

// The weights of one DeepSeek-V3 decoder layer in the forms the kernels take (AMX tile
// copies for every bfloat16 matrix), for DecoderStack.
struct StackLayer {
  at::Tensor input_norm, post_norm, kv_a_norm;
  at::Tensor hidden_norm;  // the EAGLE-3 midlayer's norm of the fed-back hidden (undefined otherwise)
  at::Tensor first;  // packed [q_a; kv_a] (with q_lora) or kv_a: the down-projections of x
  c10::optional<at::Tensor> first_bias;
  at::Tensor q_proj, q_a_norm;  // q_proj: packed q_b_proj (with q_lora) or q_proj
  at::Tensor w_uk, w_uv_t;
  c10::optional<at::Tensor> uk_packed, uv_packed;
  at::Tensor o_proj;
  c10::optional<at::Tensor> o_bias;
  at::Tensor mlp_w13, mlp_w2;  // the dense SwiGLU, or the shared experts of a MoE layer (if any)
  int64_t mlp_inter = 0;
  bool moe = false;
  at::Tensor router_weight, router_bias, experts_w13, experts_w2;
  int64_t expert_inter = 0;
};

// A DeepSeek-V3 model's decoder layers run in one call per forward, for batches whose attention
// takes the absorbed form: the sequence of kernels that DecoderLayer.forward calls through
// RMSNorm, MLAAttention, FusedCPUMLABackend, MoE and SwiGLU, the same kernels on the same inputs
// (so the same bits), without the Python in between (eaglet/kernels/decoder_stack.py).
struct DecoderStack : torch::CustomClassHolder {
  int64_t hidden, heads, nope, rope, value, latent, q_lora, top_k, n_group, topk_group;
  bool norm_topk_prob, interleave;
  double eps, scaling, routed_scaling;
  std::vector<StackLayer> layers;

  DecoderStack(std::vector<int64_t> ints, std::vector<double> floats);
  void add_layer(c10::Dict<std::string, at::Tensor> weights, std::vector<int64_t> sizes);
  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  std::vector<at::Tensor> forward(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor out_cache_loc,
                                  at::Tensor slots, at::Tensor kv_lens, at::Tensor token_starts,
                                  c10::optional<at::Tensor> custom_mask, std::vector<int64_t> capture_layers);
  at::Tensor forward_eagle3(at::Tensor emb, at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor out_cache_loc,
                            at::Tensor slots, at::Tensor kv_lens, at::Tensor token_starts, c10::optional<at::Tensor> custom_mask);

  void extend_proposals(at::Tensor ids, at::Tensor features, at::Tensor fc, int64_t fc_out, at::Tensor embed,
                        at::Tensor rope_table, at::Tensor positions, at::Tensor norm_weight, double norm_eps,
                        at::Tensor lm_head, int64_t vocab, c10::optional<at::Tensor> lm_head_bias, at::Tensor d2t,
                        bool norm_output, at::Tensor logits_rows, int64_t k, at::Tensor state_rows, at::Tensor state_tokens,
                        at::Tensor state_logprobs, at::Tensor state_hidden, at::Tensor kv, at::Tensor out_cache_loc,
                        at::Tensor slots, at::Tensor kv_lens, at::Tensor token_starts, c10::optional<at::Tensor> custom_mask,
                        c10::optional<at::Tensor> feature_rows);
  at::Tensor draft_chain(at::Tensor roots, at::Tensor state_rows, at::Tensor state_tokens, at::Tensor state_hidden,
                         at::Tensor embed, at::Tensor rope_table, at::Tensor norm_weight, double norm_eps, at::Tensor lm_head,
                         int64_t vocab, c10::optional<at::Tensor> lm_head_bias, at::Tensor d2t, bool norm_output, at::Tensor kv,
                         at::Tensor req_to_token, at::Tensor prefix, int64_t steps, c10::optional<at::Tensor> final_ids);
  std::vector<at::Tensor> draft_tree(at::Tensor roots, at::Tensor state_rows, at::Tensor state_tokens, at::Tensor state_logprobs,
                                     int64_t k, at::Tensor state_hidden, at::Tensor embed, at::Tensor rope_table, at::Tensor norm_weight,
                                     double norm_eps, at::Tensor lm_head, int64_t vocab, c10::optional<at::Tensor> lm_head_bias,
                                     at::Tensor d2t, bool norm_output, at::Tensor kv, at::Tensor req_to_token, at::Tensor prefix,
                                     int64_t steps, int64_t num_nodes);

 private:
  void check_inputs(const at::Tensor& h, const at::Tensor& kv) const;
  at::Tensor layer_forward(const StackLayer& l, int64_t index, const at::Tensor& x, at::Tensor h, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& kv, const at::Tensor& out_cache_loc, const at::Tensor& slots,
                           const at::Tensor& kv_lens, const at::Tensor& token_starts, const c10::optional<at::Tensor>& custom_mask);
};

}  // namespace eaglet
