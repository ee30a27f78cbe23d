// DecoderStack's drafting calls: an EAGLE-3 draft's extend and a speculative round's whole chain
// or tree, in one call each.
#include "decoder_stack.h"

#include <algorithm>

namespace eaglet {

namespace {

// The drafting calls' prefix lengths [B]: each checked non-negative; returns the largest (0 for none).
int64_t largest_prefix(const int64_t* prefix, int64_t batch, const char* who) {
  TORCH_CHECK(batch == 0 || *std::min_element(prefix, prefix + batch) >= 0, who, ": a negative prefix");
  return batch ? *std::max_element(prefix, prefix + batch) : 0;
}

// Rows `rows` of the request-to-slots table, their first `width` entries (fewer where the table is
// narrower: callers check the width they got).
at::Tensor table_rows(const at::Tensor& req_to_token, const at::Tensor& rows, int64_t width) {
  return req_to_token.narrow(1, 0, std::min(req_to_token.size(1), width)).index_select(0, rows);
}

}  // namespace

// A draft extend in one call, as Eagle3Draft.forward (target features in, no fc_norm) and
// EagleWorker._set_draft_states do it: fc over the features, the midlayer over the ragged batch,
// then at the flat rows `logits_rows` the final norm and the lm_head: with k == 1 its first
// maximal logit (amx_linear_argmax), else the k largest log-probabilities (topk_logprobs over the
// float32 logits), d2t applied. The results go to row state_rows[r] of the worker's state
// tables: state_tokens [rows, >= k] (first k columns), state_logprobs [rows, >= k] float32
// (k > 1 only) and state_hidden [rows, H] (the hidden fed to the next step). rope_table
// [> max(positions), 2, R / 2]. With feature_rows [T], token t reads features[feature_rows[t]]
// (a round's commit: the verify's features of each accepted path's nodes).
void DecoderStack::extend_proposals(const DraftExtend& extend, const AbsorbedBatch& batch) {
  const DraftHead& head = head_of("DecoderStack.extend_proposals");
  const at::Tensor &ids = extend.ids, &positions = extend.positions, &rope_table = extend.rope_table;
  const at::Tensor &logits_rows = extend.logits_rows, &state_rows = extend.state_rows;
  const at::Tensor &state_tokens = extend.state_tokens, &state_logprobs = extend.state_logprobs, &state_hidden = extend.state_hidden;
  const int64_t k = extend.k;
  const at::Tensor features = extend.feature_rows ? extend.features.index_select(0, *extend.feature_rows) : extend.features;
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && positions.sizes() == ids.sizes() &&
                  positions.scalar_type() == at::kLong && logits_rows.dim() == 1 && logits_rows.scalar_type() == at::kLong &&
                  head.d2t.scalar_type() == at::kLong && state_rows.sizes() == logits_rows.sizes() &&
                  state_rows.scalar_type() == at::kLong,
              "DecoderStack.extend_proposals: int64 ids [T], positions [T], logits_rows [R], state_rows [R] and d2t");
  TORCH_CHECK(features.dim() == 2 && features.size(0) == ids.size(0), "DecoderStack.extend_proposals: features [T, F]");
  TORCH_CHECK(rope_table.dim() == 3 && rope_table.size(1) == 2, "DecoderStack.extend_proposals: rope_table [P, 2, R / 2]");
  const int64_t table_rows = state_tokens.size(0);
  TORCH_CHECK(k >= 1 && state_tokens.dim() == 2 && state_tokens.scalar_type() == at::kLong && state_tokens.size(1) >= k &&
                  state_tokens.is_contiguous() && state_logprobs.dim() == 2 && state_logprobs.size(0) == table_rows &&
                  state_logprobs.scalar_type() == at::kFloat && state_logprobs.size(1) >= k && state_logprobs.is_contiguous() &&
                  state_hidden.dim() == 2 && state_hidden.size(0) == table_rows && state_hidden.size(1) == hidden &&
                  state_hidden.scalar_type() == at::kBFloat16 && state_hidden.is_contiguous(),
              "DecoderStack.extend_proposals: contiguous state tables: int64 tokens and float32 logprobs [rows, >= ", k,
              "], bfloat16 hidden [rows, ", hidden, "]");
  TORCH_CHECK(head.fc.has_value(), "DecoderStack.extend_proposals: the draft head has no fc tile copy");
  const at::Tensor h = amx_linear(features, *head.fc, head.fc_out, c10::nullopt);
  const at::Tensor cos_sin = rope_table.index_select(0, positions);
  const at::Tensor out = forward_eagle3(head.embed.index_select(0, ids), h, cos_sin.select(1, 0), cos_sin.select(1, 1), batch);
  const at::Tensor rows = out.index_select(0, logits_rows);
  const at::Tensor normed = rms_norm(rows, head.norm_weight, head.norm_eps);
  at::Tensor top_ids, top_logprobs;
  if (k == 1) {
    const at::Tensor draft_ids = amx_linear_argmax(normed, head.lm_head, head.vocab, head.lm_head_bias);
    top_ids = draft_ids + head.d2t.index_select(0, draft_ids);
  } else {
    const at::Tensor logits = amx_linear(normed, head.lm_head, head.vocab, head.lm_head_bias, true);
    const std::vector<at::Tensor> top = topk_logprobs(logits, k, head.d2t);
    top_logprobs = top[0];
    top_ids = top[1];
  }
  const at::Tensor hidden_out = (head.norm_output ? normed : rows).contiguous();
  const at::Tensor state_rows_c = state_rows.contiguous();
  const int64_t* sr = state_rows_c.data_ptr<int64_t>();
  const int64_t* tp = top_ids.data_ptr<int64_t>();
  const float* lp = k > 1 ? top_logprobs.data_ptr<float>() : nullptr;
  const int64_t token_width = state_tokens.size(1), logprob_width = state_logprobs.size(1);
  for (int64_t r = 0; r < state_rows_c.size(0); ++r) {
    const int64_t row = sr[r];
    TORCH_CHECK(row >= 0 && row < table_rows, "DecoderStack.extend_proposals: state row ", row, " out of range");
    std::copy_n(tp + r * k, k, state_tokens.data_ptr<int64_t>() + row * token_width);
    if (lp) std::copy_n(lp + r * k, k, state_logprobs.data_ptr<float>() + row * logprob_width);
    std::memcpy(state_hidden.data_ptr<at::BFloat16>() + row * hidden, hidden_out.data_ptr<at::BFloat16>() + r * hidden,
                hidden * sizeof(at::BFloat16));
  }
}

// Top-1 drafting of a speculative round in one call: `steps` midlayer forwards, step s (from 1)
// feeding each request its previous token and fed-back hidden at position prefix + s - 1, which
// is also the row index its draft entry is written to; it sees row indices < prefix + s (a chain's
// causal mask). Then the final norm, lm_head, the first maximal logit (argmax) and d2t, as
// Eagle3Draft.forward and EagleWorker._draft_chain do per step, with the same kernels on the same
// inputs. Request b's step-0 token, fed-back hidden and cache slots by row index are row
// state_rows[b] of the worker's tables: state_tokens [R, k] (column 0), state_hidden [R, H],
// req_to_token [R, >= max(prefix) + steps] (gathered here: three tensor ops fewer in each
// round's Python); rope_table [positions, 2, R / 2]: cos and sin per position. With final_ids
// [B, S] (-1 pads), drafting stops once every request's chain holds one of its final ids (tokens
// that would end it: later drafts are never kept). Returns the chain [B, steps + 2] (shorter
// where it stopped): the roots, the tokens, then the drafted target ids.
at::Tensor DecoderStack::draft_chain(const DraftRound& round, const c10::optional<at::Tensor>& final_ids) {
  const DraftHead& head = head_of("DecoderStack.draft_chain");
  const at::Tensor &roots = round.roots, &state_rows = round.state_rows, &prefix = round.prefix;
  const at::Tensor &state_tokens = round.state_tokens, &state_hidden = round.state_hidden;
  const at::Tensor &rope_table = round.rope_table, &kv = round.kv, &req_to_token = round.req_to_token;
  const int64_t steps = round.steps;
  const int64_t batch = state_rows.size(0);
  TORCH_CHECK(state_rows.dim() == 1 && state_rows.scalar_type() == at::kLong && prefix.sizes() == state_rows.sizes() &&
                  roots.sizes() == state_rows.sizes() && roots.scalar_type() == at::kLong && prefix.scalar_type() == at::kLong &&
                  head.d2t.scalar_type() == at::kLong,
              "DecoderStack.draft_chain: int64 roots [B], state_rows [B], prefix [B] and d2t");
  TORCH_CHECK(state_tokens.dim() == 2 && state_tokens.size(1) >= 1 && state_tokens.scalar_type() == at::kLong &&
                  state_hidden.dim() == 2 && req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong,
              "DecoderStack.draft_chain: int64 state_tokens [R, k], state_hidden [R, H], int64 req_to_token [R, W]");
  TORCH_CHECK(rope_table.dim() == 3 && rope_table.size(1) == 2 && steps >= 1, "DecoderStack.draft_chain: rope_table [P, 2, R / 2]");
  const at::Tensor prefix_c = prefix.contiguous();
  const int64_t* pp = prefix_c.data_ptr<int64_t>();
  const int64_t max_prefix = largest_prefix(pp, batch, "DecoderStack.draft_chain");
  const at::Tensor tokens = state_tokens.select(1, 0).index_select(0, state_rows);
  at::Tensor h = state_hidden.index_select(0, state_rows);
  const at::Tensor row_slots = table_rows(req_to_token, state_rows, max_prefix + steps);
  TORCH_CHECK(row_slots.size(1) >= max_prefix + steps && rope_table.size(0) >= max_prefix + steps,
              "DecoderStack.draft_chain: req_to_token or rope_table too short for ", steps, " steps");
  TORCH_CHECK(head.embed.dim() == 2 && head.embed.size(1) == hidden && head.embed.scalar_type() == h.scalar_type(),
              "DecoderStack.draft_chain: embeddings [V, ", hidden, "] in the hidden's dtype");
  // Each step's inputs are written in place (ids, positions, slots, embedding and rotary rows):
  // at one row per request, a step's tensor ops would cost more than its cache write and rotary.
  const auto longs = prefix_c.options();
  const at::Tensor token_starts = at::arange(batch + 1, longs);
  const at::Tensor slots_c = row_slots.contiguous(), embed_c = head.embed.contiguous(), table_c = rope_table.contiguous();
  const at::Tensor d2t_c = head.d2t.contiguous();
  at::Tensor chain = at::empty({batch, steps + 2}, longs);
  at::Tensor out_cache_loc = at::empty({batch}, longs), kv_lens = at::empty({batch}, longs);
  at::Tensor emb = at::empty({batch, hidden}, embed_c.options());
  at::Tensor cos_sin = at::empty({batch, 2, table_c.size(2)}, table_c.options());
  int64_t* cp = chain.data_ptr<int64_t>();
  const at::Tensor roots_c = roots.contiguous(), tokens_c = tokens.contiguous();
  for (int64_t b = 0; b < batch; ++b) {
    cp[b * (steps + 2)] = roots_c.data_ptr<int64_t>()[b];
    cp[b * (steps + 2) + 1] = tokens_c.data_ptr<int64_t>()[b];
  }
  const int64_t* sp = slots_c.data_ptr<int64_t>();
  const int64_t* d2tp = d2t_c.data_ptr<int64_t>();
  const int64_t embed_row = embed_c.stride(0) * embed_c.element_size(), table_row = table_c.stride(0) * table_c.element_size();
  const char* embed_base = static_cast<const char*>(embed_c.data_ptr());
  const char* table_base = static_cast<const char*>(table_c.data_ptr());
  at::Tensor finals;
  if (final_ids) {
    finals = final_ids->contiguous();
    TORCH_CHECK(finals.dim() == 2 && finals.size(0) == batch && finals.scalar_type() == at::kLong,
                "DecoderStack.draft_chain: int64 final_ids [B, S]");
  }
  std::vector<char> ended(batch, 0);
  // Whether every request's chain now holds a final id (its token at chain column `column`, or before).
  auto all_ended = [&](int64_t column) {
    if (!final_ids) return false;
    bool all = true;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t* own = finals.data_ptr<int64_t>() + b * finals.size(1);
      ended[b] = ended[b] || std::find(own, own + finals.size(1), cp[b * (steps + 2) + column]) != own + finals.size(1);
      all = all && ended[b];
    }
    return all;
  };
  int64_t drafted = steps;
  if (all_ended(1)) drafted = 0;
  for (int64_t s = 1; s <= drafted; ++s) {
    int64_t *loc = out_cache_loc.data_ptr<int64_t>(), *lens = kv_lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t position = pp[b] + s - 1, current = cp[b * (steps + 2) + s];
      TORCH_CHECK(current >= 0 && current < embed_c.size(0), "DecoderStack.draft_chain: token id ", current, " out of range");
      loc[b] = sp[b * slots_c.size(1) + position];
      lens[b] = pp[b] + s;
      std::memcpy(static_cast<char*>(emb.data_ptr()) + b * hidden * emb.element_size(), embed_base + current * embed_row,
                  hidden * emb.element_size());
      std::memcpy(static_cast<char*>(cos_sin.data_ptr()) + b * table_row, table_base + position * table_row, table_row);
    }
    const AbsorbedBatch step{.kv = kv,
                             .out_cache_loc = out_cache_loc,
                             .attention = {.slots = slots_c.narrow(1, 0, max_prefix + s),
                                           .kv_lens = kv_lens,
                                           .token_starts = token_starts,
                                           .custom_mask = c10::nullopt}};
    const at::Tensor out = forward_eagle3(emb, h, cos_sin.select(1, 0), cos_sin.select(1, 1), step);
    const at::Tensor normed = rms_norm(out, head.norm_weight, head.norm_eps);
    const at::Tensor draft_ids = amx_linear_argmax(normed, head.lm_head, head.vocab, head.lm_head_bias);
    const int64_t* ids = draft_ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(ids[b] < d2t_c.size(0), "DecoderStack.draft_chain: d2t [", d2t_c.size(0), "] shorter than the lm_head");
      cp[b * (steps + 2) + s + 1] = ids[b] + d2tp[ids[b]];
    }
    h = head.norm_output ? normed : out;
    if (s < drafted && all_ended(s + 1)) drafted = s;
  }
  if (drafted < steps) return chain.narrow(1, 0, drafted + 2).contiguous();
  return chain;
}

// EAGLE-2 tree drafting of a speculative round in one call (EagleWorker._draft_tree's loop, then
// select_draft_tree): the k frontier candidates of each request (tokens / scores: the last draft
// extend's top k and their log-probabilities, all fed its hidden; request b's are row
// state_rows[b] of the worker's tables state_tokens / state_logprobs [R, >= k] and state_hidden
// [R, H]) expand for steps - 1 midlayer forwards. Step s writes frontier node f of request b at
// row index prefix + (s - 1) * k + f, position prefix + s - 1, seeing row indices below prefix and
// its own ancestors' (the scratch rows of the nodes it descends from); its top k children score the
// parent's score plus their log-probability (topk_logprobs over the lm_head logits, d2t applied),
// and the k best children (the earlier first among equal scores) are the next frontier, fed their
// parent's hidden out. Same kernels on the same inputs as the per-step Eagle3Draft.forward.
// Cache slots by row index: row state_rows[b] of req_to_token [R, >= max(prefix) + (steps - 1) * k].
// Returns select_draft_tree's [tokens, parents, depths] of num_nodes nodes, the roots first.
std::vector<at::Tensor> DecoderStack::draft_tree(const DraftRound& round, int64_t k, int64_t num_nodes) {
  const DraftHead& head = head_of("DecoderStack.draft_tree");
  const at::Tensor &roots = round.roots, &state_rows = round.state_rows, &prefix = round.prefix;
  const at::Tensor &state_tokens = round.state_tokens, &state_logprobs = round.state_logprobs, &state_hidden = round.state_hidden;
  const at::Tensor &rope_table = round.rope_table, &kv = round.kv, &req_to_token = round.req_to_token;
  const int64_t steps = round.steps;
  const int64_t batch = state_rows.size(0);
  TORCH_CHECK(state_tokens.dim() == 2 && k >= 1 && state_tokens.size(1) >= k && state_tokens.scalar_type() == at::kLong &&
                  state_logprobs.sizes() == state_tokens.sizes() && state_logprobs.scalar_type() == at::kFloat,
              "DecoderStack.draft_tree: int64 state_tokens and float32 state_logprobs [R, >= k]");
  TORCH_CHECK(state_rows.dim() == 1 && state_rows.scalar_type() == at::kLong && roots.sizes() == state_rows.sizes() &&
                  roots.scalar_type() == at::kLong && prefix.sizes() == state_rows.sizes() && prefix.scalar_type() == at::kLong &&
                  head.d2t.scalar_type() == at::kLong,
              "DecoderStack.draft_tree: int64 roots [B], state_rows [B], prefix [B] and d2t");
  TORCH_CHECK(state_hidden.dim() == 2 && req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong,
              "DecoderStack.draft_tree: state_hidden [R, H], int64 req_to_token [R, W]");
  TORCH_CHECK(rope_table.dim() == 3 && rope_table.size(1) == 2 && steps >= 1, "DecoderStack.draft_tree: rope_table [P, 2, R / 2]");
  const int64_t scratch = (steps - 1) * k, num_candidates = k + scratch * k;
  const at::Tensor prefix_c = prefix.contiguous();
  const int64_t* pp = prefix_c.data_ptr<int64_t>();
  const int64_t max_prefix = largest_prefix(pp, batch, "DecoderStack.draft_tree");
  const at::Tensor tokens = state_tokens.narrow(1, 0, k).index_select(0, state_rows);
  const at::Tensor scores = state_logprobs.narrow(1, 0, k).index_select(0, state_rows);
  const at::Tensor h = state_hidden.index_select(0, state_rows);
  const at::Tensor row_slots = table_rows(req_to_token, state_rows, max_prefix + scratch);
  TORCH_CHECK(row_slots.size(1) >= max_prefix + scratch && rope_table.size(0) >= max_prefix + steps,
              "DecoderStack.draft_tree: req_to_token or rope_table too short for ", steps, " steps of ", k);
  TORCH_CHECK(num_nodes >= 1 && num_nodes - 1 <= num_candidates, "DecoderStack.draft_tree: ", num_nodes, " nodes from ",
              num_candidates, " candidates");
  const auto longs = prefix_c.options();
  // Every candidate of the round: the first k are the frontier of step 1 (parent: the root).
  at::Tensor cand_tokens = at::empty({batch, num_candidates}, longs), cand_parents = at::empty({batch, num_candidates}, longs);
  at::Tensor cand_scores = at::empty({batch, num_candidates}, longs.dtype(at::kFloat));
  at::Tensor cand_depths = at::empty({num_candidates}, longs);
  int64_t *ct = cand_tokens.data_ptr<int64_t>(), *cp = cand_parents.data_ptr<int64_t>(), *cd = cand_depths.data_ptr<int64_t>();
  float* cs = cand_scores.data_ptr<float>();
  const at::Tensor tokens_c = tokens.contiguous(), scores_c = scores.contiguous();
  // The frontier: k nodes per request, their candidate ids and, per scratch row, whether it holds an ancestor-or-self.
  std::vector<int64_t> frontier_tokens(tokens_c.data_ptr<int64_t>(), tokens_c.data_ptr<int64_t>() + batch * k);
  std::vector<float> frontier_scores(scores_c.data_ptr<float>(), scores_c.data_ptr<float>() + batch * k);
  std::vector<int64_t> frontier_ids(batch * k);
  std::vector<char> ancestry(batch * k * std::max<int64_t>(scratch, 1), 0), next_ancestry(ancestry.size());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t f = 0; f < k; ++f) {
      ct[b * num_candidates + f] = frontier_tokens[b * k + f];
      cs[b * num_candidates + f] = frontier_scores[b * k + f];
      cp[b * num_candidates + f] = -1;
      frontier_ids[b * k + f] = f;
    }
  }
  std::fill(cd, cd + k, 1);
  const int64_t rows = batch * k;
  at::Tensor hidden = h.repeat_interleave(k, 0);  // [B * k, H]: every frontier node starts from the request's hidden
  at::Tensor positions = at::empty({rows}, longs), out_cache_loc = at::empty({rows}, longs), kv_lens = at::empty({batch}, longs);
  at::Tensor input_ids = at::empty({rows}, longs);
  const at::Tensor token_starts = at::arange(0, rows + 1, k, longs);
  const at::Tensor slots_c = row_slots.contiguous();
  const int64_t* sp = slots_c.data_ptr<int64_t>();
  const int64_t slot_width = slots_c.size(1);
  std::vector<int64_t> best(k);
  int64_t count = k;
  for (int64_t s = 1; s < steps; ++s) {
    const int64_t first = (s - 1) * k, num_keys = max_prefix + s * k;
    at::Tensor mask = at::zeros({rows, num_keys}, longs.dtype(at::kBool));
    bool* mp = mask.data_ptr<bool>();
    int64_t *pos = positions.data_ptr<int64_t>(), *loc = out_cache_loc.data_ptr<int64_t>(), *ids = input_ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      kv_lens.data_ptr<int64_t>()[b] = pp[b] + s * k;
      for (int64_t f = 0; f < k; ++f) {
        const int64_t t = b * k + f;
        char* anc = ancestry.data() + t * scratch;
        anc[first + f] = 1;
        pos[t] = pp[b] + s - 1;
        loc[t] = sp[b * slot_width + pp[b] + first + f];
        ids[t] = frontier_tokens[t];
        bool* row = mp + t * num_keys;
        std::fill(row, row + pp[b], true);
        for (int64_t j = 0; j < s * k; ++j) row[pp[b] + j] = anc[j];
      }
    }
    const at::Tensor cos_sin = rope_table.index_select(0, positions);
    const AbsorbedBatch step{.kv = kv,
                             .out_cache_loc = out_cache_loc,
                             .attention = {.slots = row_slots.narrow(1, 0, num_keys),
                                           .kv_lens = kv_lens,
                                           .token_starts = token_starts,
                                           .custom_mask = mask}};
    const at::Tensor out =
        forward_eagle3(head.embed.index_select(0, input_ids), hidden, cos_sin.select(1, 0), cos_sin.select(1, 1), step);
    const at::Tensor normed = rms_norm(out, head.norm_weight, head.norm_eps);
    const at::Tensor logits = amx_linear(normed, head.lm_head, head.vocab, head.lm_head_bias, true);
    const std::vector<at::Tensor> top = topk_logprobs(logits, k, head.d2t);  // [B * k, k] each
    const float* tv = top[0].data_ptr<float>();
    const int64_t* ti = top[1].data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t f = 0; f < k; ++f) {
        for (int64_t c = 0; c < k; ++c) {
          const int64_t idx = b * num_candidates + count + f * k + c;
          ct[idx] = ti[(b * k + f) * k + c];
          cs[idx] = frontier_scores[b * k + f] + tv[(b * k + f) * k + c];
          cp[idx] = frontier_ids[b * k + f];
        }
      }
    }
    std::fill(cd + count, cd + count + k * k, s + 1);
    if (s == steps - 1) break;
    const at::Tensor out_hidden = head.norm_output ? normed : out;
    std::vector<int64_t> parent_rows(rows);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t base = b * num_candidates + count;
      top_indices(cs + base, k * k, k, best.data());
      for (int64_t f = 0; f < k; ++f) {
        const int64_t t = b * k + f, parent = best[f] / k;
        frontier_tokens[t] = ct[base + best[f]];
        frontier_scores[t] = cs[base + best[f]];
        frontier_ids[t] = count + best[f];
        parent_rows[t] = b * k + parent;
        std::copy_n(ancestry.data() + (b * k + parent) * scratch, scratch, next_ancestry.data() + t * scratch);
      }
    }
    ancestry.swap(next_ancestry);
    hidden = out_hidden.index_select(0, at::tensor(parent_rows, longs));
    count += k * k;
  }
  return select_draft_tree(cand_tokens, cand_scores, cand_parents, cand_depths, roots, num_nodes);
}

}  // namespace eaglet
