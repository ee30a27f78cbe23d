// Every torch.ops.eaglet op and torch.classes.eaglet class, registered in one place: the schemas
// Python calls, each bound to its kernel (ops.h) or DecoderStack method (decoder_stack.h).
#include "decoder_stack.h"
#include "ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

using namespace eaglet;

TORCH_LIBRARY_FRAGMENT(eaglet_info, m) {
  m.def("tile_backend", tile_backend);
}

TORCH_LIBRARY(eaglet, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<int64_t>, std::vector<double>>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward)
      .def("forward_eagle3", &DecoderStack::forward_eagle3)
      .def("extend_proposals", &DecoderStack::extend_proposals)
      .def("draft_chain", &DecoderStack::draft_chain)
      .def("draft_tree", &DecoderStack::draft_tree);
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
  m.def("amx_linear_argmax(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("moe_routed_experts(Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids, int inter) -> Tensor");
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
  m.impl("noaux_route", noaux_route);
  m.impl("mla_absorbed_attention", mla_absorbed_attention);
  m.impl("moe_routed_experts", moe_routed_experts);
  m.impl("rope_query_key", rope_query_key);
  m.impl("mla_cache_write", mla_cache_write);
  m.impl("amx_pack_weight", amx_pack_weight);
  m.impl("amx_swiglu", amx_swiglu);
  m.impl("amx_linear", amx_linear);
  m.impl("amx_linear_argmax", amx_linear_argmax);
}
