// Every torch.ops.eaglet op and the torch.classes.eaglet.DecoderStack class, registered in one
// place: the schemas Python calls, each bound to its kernel (ops.h) or DecoderStack method
// (decoder_stack.h). Where a kernel or method takes a struct, the binding below gathers the call's
// named arguments into it, so callers pass names (Python keywords) rather than positions. (A
// registered class passed per call would cost more than the call.)
#include "decoder_stack.h"
#include "ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

using namespace eaglet;

namespace {

std::tuple<at::Tensor, at::Tensor> noaux_route_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                                  int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                                                  double scaling) {
  return noaux_route(x, weight, bias,
                     {.top_k = top_k, .n_group = n_group, .topk_group = topk_group, .norm_topk_prob = norm_topk_prob, .scaling = scaling});
}

at::Tensor mla_absorbed_attention_op(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv, const at::Tensor& w_uk,
                                     const at::Tensor& w_uv_t, const at::Tensor& slots, const at::Tensor& kv_lens,
                                     const at::Tensor& token_starts, const c10::optional<at::Tensor>& custom_mask, double scale,
                                     const c10::optional<at::Tensor>& w_uk_packed, const c10::optional<at::Tensor>& w_uv_packed) {
  return mla_absorbed_attention(
      q_nope, q_pe, kv, {.w_uk = w_uk, .w_uv_t = w_uv_t, .w_uk_packed = w_uk_packed, .w_uv_packed = w_uv_packed, .scale = scale},
      {.slots = slots, .kv_lens = kv_lens, .token_starts = token_starts, .custom_mask = custom_mask});
}

using Stack = c10::intrusive_ptr<DecoderStack>;

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglet_info, m) {
  m.def("tile_backend", tile_backend);
}

TORCH_LIBRARY(eaglet, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init([](int64_t hidden_size, int64_t num_heads, int64_t qk_nope_head_dim, int64_t qk_rope_head_dim,
                          int64_t v_head_dim, int64_t kv_lora_rank, int64_t q_lora_rank, bool rope_interleave, double rms_norm_eps,
                          double softmax_scale, int64_t num_experts_per_tok, int64_t n_group, int64_t topk_group,
                          bool norm_topk_prob, double routed_scaling_factor) {
             return c10::make_intrusive<DecoderStack>(DecoderStackConfig{
                 .hidden_size = hidden_size,
                 .num_heads = num_heads,
                 .qk_nope_head_dim = qk_nope_head_dim,
                 .qk_rope_head_dim = qk_rope_head_dim,
                 .v_head_dim = v_head_dim,
                 .kv_lora_rank = kv_lora_rank,
                 .q_lora_rank = q_lora_rank,
                 .rope_interleave = rope_interleave,
                 .rms_norm_eps = rms_norm_eps,
                 .softmax_scale = softmax_scale,
                 .router = {.top_k = num_experts_per_tok,
                            .n_group = n_group,
                            .topk_group = topk_group,
                            .norm_topk_prob = norm_topk_prob,
                            .scaling = routed_scaling_factor}});
           }),
           "", {torch::arg("hidden_size"), torch::arg("num_heads"), torch::arg("qk_nope_head_dim"), torch::arg("qk_rope_head_dim"),
                torch::arg("v_head_dim"), torch::arg("kv_lora_rank"), torch::arg("q_lora_rank"), torch::arg("rope_interleave"),
                torch::arg("rms_norm_eps"), torch::arg("softmax_scale"), torch::arg("num_experts_per_tok"), torch::arg("n_group"),
                torch::arg("topk_group"), torch::arg("norm_topk_prob"), torch::arg("routed_scaling_factor")})
      .def("add_layer", &DecoderStack::add_layer, "",
           {torch::arg("weights"), torch::arg("mlp_inter"), torch::arg("expert_inter"), torch::arg("quant_format") = std::string(),
            torch::arg("quant_group") = 0, torch::arg("int8_activations") = false})
      .def("set_draft_head",
           [](const Stack& self, c10::optional<at::Tensor> fc, int64_t fc_out, at::Tensor embed, at::Tensor norm_weight,
              double norm_eps, at::Tensor lm_head, int64_t vocab, c10::optional<at::Tensor> lm_head_bias, at::Tensor d2t,
              bool norm_output) {
             self->set_draft_head({.fc = fc,
                                   .fc_out = fc_out,
                                   .embed = embed,
                                   .norm_weight = norm_weight,
                                   .norm_eps = norm_eps,
                                   .lm_head = lm_head,
                                   .vocab = vocab,
                                   .lm_head_bias = lm_head_bias,
                                   .d2t = d2t,
                                   .norm_output = norm_output});
           },
           "", {torch::arg("fc"), torch::arg("fc_out"), torch::arg("embed"), torch::arg("norm_weight"), torch::arg("norm_eps"),
                torch::arg("lm_head"), torch::arg("vocab"), torch::arg("lm_head_bias"), torch::arg("d2t"), torch::arg("norm_output")})
      .def("set_tensor_parallel",
           [](const Stack& self, int64_t address, int64_t rank, int64_t size, int64_t slot_bytes, int64_t message_bytes,
              at::Tensor seq, at::Tensor time, std::vector<int64_t> pids, double timeout_s) {
             self->set_tensor_parallel({.base = reinterpret_cast<uint8_t*>(address),
                                        .rank = rank,
                                        .size = size,
                                        .slot_bytes = slot_bytes,
                                        .message_bytes = message_bytes,
                                        .seq = seq,
                                        .time = time,
                                        .pids = pids,
                                        .timeout_s = timeout_s});
           },
           "", {torch::arg("address"), torch::arg("rank"), torch::arg("size"), torch::arg("slot_bytes"),
                torch::arg("message_bytes"), torch::arg("seq"), torch::arg("time"), torch::arg("pids"), torch::arg("timeout_s")})
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward",
           [](const Stack& self, at::Tensor hidden, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor out_cache_loc,
              at::Tensor slots, at::Tensor kv_lens, at::Tensor token_starts, c10::optional<at::Tensor> custom_mask,
              std::vector<int64_t> capture_layers) {
             return self->forward(hidden, cos, sin,
                                  {.kv = kv,
                                   .out_cache_loc = out_cache_loc,
                                   .attention = {.slots = slots, .kv_lens = kv_lens, .token_starts = token_starts, .custom_mask = custom_mask}},
                                  capture_layers);
           },
           "", {torch::arg("hidden"), torch::arg("cos"), torch::arg("sin"), torch::arg("kv"), torch::arg("out_cache_loc"),
                torch::arg("slots"), torch::arg("kv_lens"), torch::arg("token_starts"), torch::arg("custom_mask"),
                torch::arg("capture_layers")})
      .def("forward_eagle3",
           [](const Stack& self, at::Tensor emb, at::Tensor hidden, at::Tensor cos, at::Tensor sin, at::Tensor kv,
              at::Tensor out_cache_loc, at::Tensor slots, at::Tensor kv_lens, at::Tensor token_starts,
              c10::optional<at::Tensor> custom_mask) {
             return self->forward_eagle3(
                 emb, hidden, cos, sin,
                 {.kv = kv,
                  .out_cache_loc = out_cache_loc,
                  .attention = {.slots = slots, .kv_lens = kv_lens, .token_starts = token_starts, .custom_mask = custom_mask}});
           },
           "", {torch::arg("emb"), torch::arg("hidden"), torch::arg("cos"), torch::arg("sin"), torch::arg("kv"),
                torch::arg("out_cache_loc"), torch::arg("slots"), torch::arg("kv_lens"), torch::arg("token_starts"),
                torch::arg("custom_mask")})
      .def("extend_proposals",
           [](const Stack& self, at::Tensor ids, at::Tensor features, c10::optional<at::Tensor> feature_rows, at::Tensor positions,
              at::Tensor rope_table, at::Tensor logits_rows, int64_t k, at::Tensor state_rows, at::Tensor state_tokens,
              at::Tensor state_logprobs, at::Tensor state_hidden, at::Tensor kv, at::Tensor out_cache_loc, at::Tensor slots,
              at::Tensor kv_lens, at::Tensor token_starts, c10::optional<at::Tensor> custom_mask) {
             self->extend_proposals(
                 {.ids = ids,
                  .features = features,
                  .feature_rows = feature_rows,
                  .positions = positions,
                  .rope_table = rope_table,
                  .logits_rows = logits_rows,
                  .k = k,
                  .state_rows = state_rows,
                  .state_tokens = state_tokens,
                  .state_logprobs = state_logprobs,
                  .state_hidden = state_hidden},
                 {.kv = kv,
                  .out_cache_loc = out_cache_loc,
                  .attention = {.slots = slots, .kv_lens = kv_lens, .token_starts = token_starts, .custom_mask = custom_mask}});
           },
           "", {torch::arg("ids"), torch::arg("features"), torch::arg("feature_rows"), torch::arg("positions"),
                torch::arg("rope_table"), torch::arg("logits_rows"), torch::arg("k"), torch::arg("state_rows"),
                torch::arg("state_tokens"), torch::arg("state_logprobs"), torch::arg("state_hidden"), torch::arg("kv"),
                torch::arg("out_cache_loc"), torch::arg("slots"), torch::arg("kv_lens"), torch::arg("token_starts"),
                torch::arg("custom_mask")})
      .def("draft_chain",
           [](const Stack& self, at::Tensor roots, at::Tensor state_rows, at::Tensor prefix, at::Tensor state_tokens,
              at::Tensor state_hidden, at::Tensor rope_table, at::Tensor kv, at::Tensor req_to_token, int64_t steps,
              c10::optional<at::Tensor> final_ids) {
             return self->draft_chain({.roots = roots,
                                       .state_rows = state_rows,
                                       .prefix = prefix,
                                       .state_tokens = state_tokens,
                                       .state_logprobs = at::Tensor(),
                                       .state_hidden = state_hidden,
                                       .rope_table = rope_table,
                                       .kv = kv,
                                       .req_to_token = req_to_token,
                                       .steps = steps},
                                      final_ids);
           },
           "", {torch::arg("roots"), torch::arg("state_rows"), torch::arg("prefix"), torch::arg("state_tokens"),
                torch::arg("state_hidden"), torch::arg("rope_table"), torch::arg("kv"), torch::arg("req_to_token"),
                torch::arg("steps"), torch::arg("final_ids")})
      .def("draft_tree",
           [](const Stack& self, at::Tensor roots, at::Tensor state_rows, at::Tensor prefix, at::Tensor state_tokens,
              at::Tensor state_logprobs, at::Tensor state_hidden, at::Tensor rope_table, at::Tensor kv, at::Tensor req_to_token,
              int64_t steps, int64_t k, int64_t num_nodes) {
             return self->draft_tree({.roots = roots,
                                      .state_rows = state_rows,
                                      .prefix = prefix,
                                      .state_tokens = state_tokens,
                                      .state_logprobs = state_logprobs,
                                      .state_hidden = state_hidden,
                                      .rope_table = rope_table,
                                      .kv = kv,
                                      .req_to_token = req_to_token,
                                      .steps = steps},
                                     k, num_nodes);
           },
           "", {torch::arg("roots"), torch::arg("state_rows"), torch::arg("prefix"), torch::arg("state_tokens"),
                torch::arg("state_logprobs"), torch::arg("state_hidden"), torch::arg("rope_table"), torch::arg("kv"),
                torch::arg("req_to_token"), torch::arg("steps"), torch::arg("k"), torch::arg("num_nodes")});
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("argmax_last_dim(Tensor logits, Tensor? offsets=None) -> Tensor");
  m.def("topk_logprobs(Tensor logits, int k, Tensor? offsets=None) -> Tensor[]");
  m.def("verify_tree_greedy(Tensor tokens, Tensor parents, Tensor logits) -> Tensor");
  m.def("verify_tree_greedy_ids(Tensor tokens, Tensor parents, Tensor target_ids) -> Tensor");
  m.def("commit_table(Tensor verify_table, Tensor tokens, Tensor slots, Tensor prefix) -> Tensor[]");
  m.def("write_block_entries(Tensor(a!) req_to_token, Tensor blocks, int block_size) -> ()");
  m.def("copy_cache_slots(Tensor(a!) kv, Tensor src, Tensor dst) -> ()");
  m.def("scratch_slots(Tensor req_to_token, Tensor rows, Tensor prefix, int scratch) -> Tensor");
  m.def("select_draft_tree(Tensor tokens, Tensor scores, Tensor parents, Tensor depths, Tensor roots, int num_nodes) -> Tensor[]");
  m.def("tree_attention_mask(Tensor parents, Tensor prefix, int num_keys) -> Tensor");
  m.def("noaux_route(Tensor x, Tensor weight, Tensor bias, int top_k, int n_group, int topk_group, bool norm_topk_prob, float scaling) -> (Tensor, Tensor)");
  m.def("rope_query_key(Tensor q_pe, Tensor k_pe, Tensor cos, Tensor sin, bool interleave) -> (Tensor, Tensor)");
  m.def("mla_cache_write(Tensor(a!) kv, Tensor out_cache_loc, Tensor c_kv, Tensor k_pe) -> ()");
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_swiglu(Tensor x, Tensor w13, Tensor w2, int inter) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, int n, Tensor? bias, bool widened=False) -> Tensor");
  m.def("f32_pack_weight(Tensor weight) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("amx_linear_argmax(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, int group) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor codes, Tensor scales, int group) -> Tensor");
  m.def("int4_linear_a8(Tensor x, Tensor codes, Tensor scales, int group) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int group) -> Tensor");
  m.def("int8_linear_a8(Tensor x, Tensor codes, Tensor scales, int group) -> Tensor");
  m.def("moe_routed_experts(Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids, int inter) -> Tensor");
  m.def("quantized_routed_experts(Tensor x, Tensor w13_codes, Tensor w13_scales, Tensor w2_codes, Tensor w2_scales, "
        "int group, str format, bool int8_activations, Tensor weights, Tensor ids) -> Tensor");
  m.def("mla_absorbed_attention(Tensor q_nope, Tensor q_pe, Tensor kv, Tensor w_uk, Tensor w_uv_t, Tensor slots, Tensor kv_lens, Tensor token_starts, Tensor? custom_mask, float scale, Tensor? w_uk_packed=None, Tensor? w_uv_packed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(eaglet, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("argmax_last_dim", argmax_last_dim);
  m.impl("topk_logprobs", topk_logprobs);
  m.impl("verify_tree_greedy", verify_tree_greedy);
  m.impl("verify_tree_greedy_ids", verify_tree_greedy_ids);
  m.impl("commit_table", commit_table);
  m.impl("write_block_entries", write_block_entries);
  m.impl("copy_cache_slots", copy_cache_slots);
  m.impl("scratch_slots", scratch_slots);
  m.impl("select_draft_tree", select_draft_tree);
  m.impl("tree_attention_mask", tree_attention_mask);
  m.impl("noaux_route", noaux_route_op);
  m.impl("mla_absorbed_attention", mla_absorbed_attention_op);
  m.impl("moe_routed_experts", moe_routed_experts);
  m.impl("quantized_routed_experts", quantized_routed_experts_op);
  m.impl("rope_query_key", rope_query_key);
  m.impl("mla_cache_write", mla_cache_write);
  m.impl("amx_pack_weight", amx_pack_weight);
  m.impl("amx_swiglu", amx_swiglu);
  m.impl("amx_linear", amx_linear);
  m.impl("amx_linear_argmax", amx_linear_argmax);
  m.impl("f32_pack_weight", f32_pack_weight);
  m.impl("f32_linear", f32_linear);
  m.impl("int4_linear", int4_linear);
  m.impl("fp8_linear", fp8_linear);
  m.impl("int4_linear_a8", int4_linear_a8);
  m.impl("int8_linear", int8_linear);
  m.impl("int8_linear_a8", int8_linear_a8);
}
