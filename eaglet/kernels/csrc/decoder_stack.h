// DecoderStack (torch.classes.eaglet.DecoderStack): a bfloat16 DeepSeek-V3 model's decoder layers,
// or an MLA EAGLE-3 draft's midlayer, in one call per forward (decoder_stack.cpp), and a draft's
// extend and a speculative round's whole drafting in one call each (draft.cpp).
#pragma once

#include "shm_all_reduce.h"
#include "ops.h"

#include <torch/custom_class.h>

#include <string>
#include <vector>

namespace eaglet {

// A stack's shape and scalars, named as in the model's config (DecoderStack's constructor).
struct DecoderStackConfig {
  int64_t hidden_size, num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank;
  int64_t q_lora_rank;  // 0: no query compression
  bool rope_interleave;
  double rms_norm_eps, softmax_scale;
  RouterConfig router;  // the MoE layers' routing
};

// A matrix of a stack layer: the tile copy of a bfloat16 matrix, or a quantized matrix as the
// checkpoint stores it (a layer may hold both kinds).
struct StackMatrix {
  at::Tensor tiles;
  c10::optional<QuantMatrix> quantized;
  // x times the matrix's transpose (+ bias), in x's dtype: amx_linear, or QuantMatrix::linear.
  at::Tensor linear(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias) const;
};

// The weights of one DeepSeek-V3 decoder layer in the forms the kernels take, for DecoderStack.
struct StackLayer {
  at::Tensor input_norm, post_norm, kv_a_norm;
  at::Tensor hidden_norm;  // the EAGLE-3 midlayer's norm of the fed-back hidden (undefined otherwise)
  StackMatrix first;  // [q_a; kv_a] (with q_lora) or kv_a: the down-projections of x
  c10::optional<at::Tensor> first_bias;
  StackMatrix q_proj;  // q_b_proj (with q_lora) or q_proj
  at::Tensor q_a_norm;
  AbsorbedLayer attention;  // W_UK, W_UV^T, their tile copies and the softmax scale
  StackMatrix o_proj;
  c10::optional<at::Tensor> o_bias;
  StackMatrix mlp_w13, mlp_w2;  // the dense SwiGLU, or the shared experts of a MoE layer (if any)
  int64_t mlp_inter = 0;
  bool moe = false;
  at::Tensor router_weight, router_bias;
  StackMatrix experts_w13, experts_w2;  // [E, ...]: tile copies stacked, or quantized stacks
  int64_t expert_inter = 0;
};

// What the drafting calls take from an EAGLE-3 draft besides its midlayer, set once per stack
// (set_draft_head).
struct DraftHead {
  c10::optional<at::Tensor> fc;  // fc's tile copy, over the target features (extend_proposals only)
  int64_t fc_out;
  at::Tensor embed;  // the embeddings [V, H]
  at::Tensor norm_weight;  // the final norm
  double norm_eps;
  at::Tensor lm_head;  // the lm_head's tile copy
  int64_t vocab;
  c10::optional<at::Tensor> lm_head_bias;
  at::Tensor d2t;  // int64 [vocab]: draft id i is target id i + d2t[i]
  bool norm_output;  // the next step is fed the normed hidden, else the midlayer's output
};

// A batch's inputs of absorbed attention, the same for every layer of a forward: the cache pool
// [layers, slots, L + R], each new token's slot (out_cache_loc [T]) and where the keys are.
struct AbsorbedBatch {
  at::Tensor kv, out_cache_loc;
  AttentionMetadata attention;
};

// A draft extend's inputs besides its attention (extend_proposals, which describes them).
struct DraftExtend {
  at::Tensor ids, features;
  c10::optional<at::Tensor> feature_rows;
  at::Tensor positions, rope_table, logits_rows;
  int64_t k;
  at::Tensor state_rows, state_tokens, state_logprobs, state_hidden;
};

// A speculative round's drafting inputs (draft_chain and draft_tree, which describe them;
// state_logprobs is draft_tree's only).
struct DraftRound {
  at::Tensor roots, state_rows, prefix;
  at::Tensor state_tokens, state_logprobs, state_hidden;
  at::Tensor rope_table, kv, req_to_token;
  int64_t steps;
};

// A DeepSeek-V3 model's decoder layers run in one call per forward, for batches whose attention
// takes the absorbed form: the sequence of kernels that DecoderLayer.forward calls through
// RMSNorm, MLAAttention, FusedCPUMLABackend, MoE and SwiGLU, the same kernels on the same inputs
// (so the same bits), without the Python in between (eaglet/kernels/decoder_stack.py).
struct DecoderStack : torch::CustomClassHolder {
  int64_t hidden, heads, nope, rope, value, latent, q_lora;
  bool interleave;
  double eps, scaling;
  RouterConfig router;
  std::vector<StackLayer> layers;
  c10::optional<DraftHead> draft_head;
  // Under tensor parallelism (set_tensor_parallel): each layer's attention and MLP outputs are
  // partial sums, all-reduced through the group's shared memory before the residual adds.
  c10::optional<ShmGroup> group;

  explicit DecoderStack(const DecoderStackConfig& config);
  void add_layer(const c10::Dict<std::string, at::Tensor>& weights, int64_t mlp_inter, int64_t expert_inter,
                 const std::string& quant_format, int64_t quant_group, bool int8_activations);
  void set_draft_head(const DraftHead& head);
  void set_tensor_parallel(const ShmGroup& shm_group) { group = shm_group; }
  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  std::vector<at::Tensor> forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const AbsorbedBatch& batch,
                                  const std::vector<int64_t>& capture_layers);
  at::Tensor forward_eagle3(const at::Tensor& emb, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                            const AbsorbedBatch& batch);

  void extend_proposals(const DraftExtend& extend, const AbsorbedBatch& batch);
  at::Tensor draft_chain(const DraftRound& round, const c10::optional<at::Tensor>& final_ids);
  std::vector<at::Tensor> draft_tree(const DraftRound& round, int64_t k, int64_t num_nodes);

 private:
  void check_inputs(const at::Tensor& h, const at::Tensor& kv) const;
  const DraftHead& head_of(const char* call) const;
  at::Tensor reduced(at::Tensor partial) const;
  at::Tensor layer_forward(const StackLayer& l, int64_t index, const at::Tensor& x, at::Tensor h, const at::Tensor& cos,
                           const at::Tensor& sin, const AbsorbedBatch& batch);
};

}  // namespace eaglet
