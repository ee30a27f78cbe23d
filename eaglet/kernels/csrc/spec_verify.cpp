// A speculative round's greedy verification (verify_tree_greedy, verify_tree_greedy_ids) and what it
// commits (commit_table).
#include "logits.h"
#include "ops.h"

#include <algorithm>

namespace eaglet {

namespace {

// Greedy verification of trees, chains included (verify.py's _verify_greedy_tree): node j > 0 with parent -1 is
// padding, every other parent is an earlier node that is not padding. The accepted path is the
// deepest one whose every node's token is the target's pick after its parent, the lowest end node
// among equally deep ones; the table's rows are [num_accepted, bonus, path nodes, -1 ...], D + 2
// wide for the deepest tree D of the batch. A node's logits are reduced only if it is on a
// matching path.
// The greedy walk of verify_tree_greedy over [B, N] int64 trees: pick(b, j) is the target's token
// after node j of request b, asked only for nodes on matching paths (a chain's only up to its first
// rejection) and from the thread that walks request b; pick_at keeps each node's answer. Requests
// are split over threads in chunks of ``grain`` (the batch size: all on the calling thread).
template <typename Pick>
at::Tensor greedy_walk(const at::Tensor& tokens, const at::Tensor& parents, const char* op, int64_t grain, const Pick& pick) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.size(1) > 0 && parents.sizes() == tokens.sizes() &&
                  parents.scalar_type() == at::kLong,
              op, ": int64 tokens and parents [B, N] with N >= 1");
  const at::Tensor t = tokens.contiguous(), par = parents.contiguous();
  const int64_t batch = t.size(0), n = t.size(1);
  const int64_t* tp = t.data_ptr<int64_t>();
  const int64_t* pp = par.data_ptr<int64_t>();
  std::vector<int64_t> depth(batch * n, -1);  // -1: padding
  int64_t max_depth = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* row = pp + b * n;
    int64_t* d = depth.data() + b * n;
    TORCH_CHECK(row[0] == -1, op, ": node 0 must be the root (parent -1)");
    d[0] = 0;
    for (int64_t j = 1; j < n; ++j) {
      TORCH_CHECK(row[j] >= -1 && row[j] < j, op, ": every node's parent must be -1 or an earlier node");
      if (row[j] < 0) continue;
      TORCH_CHECK(d[row[j]] >= 0, op, ": a node's parent is a padding node");
      d[j] = d[row[j]] + 1;
      max_depth = std::max(max_depth, d[j]);
    }
  }
  at::Tensor out = at::full({batch, max_depth + 2}, -1, t.options());
  int64_t* op_out = out.data_ptr<int64_t>();
  at::parallel_for(0, batch, std::max<int64_t>(grain, 1), [&](int64_t begin, int64_t end) {
    std::vector<int64_t> picked(n);
    std::vector<char> matched(n);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* row = pp + b * n;
      const int64_t* d = depth.data() + b * n;
      std::fill(picked.begin(), picked.end(), -1);
      const auto pick_at = [&](int64_t node) {
        if (picked[node] < 0) picked[node] = pick(b, node);
        return picked[node];
      };
      matched[0] = 1;
      int64_t best = 0;
      for (int64_t j = 1; j < n; ++j) {
        matched[j] = d[j] >= 0 && matched[row[j]] && tp[b * n + j] == pick_at(row[j]);
        if (matched[j] && d[j] > d[best]) best = j;
      }
      int64_t* out_row = op_out + b * (max_depth + 2);
      out_row[0] = d[best];
      out_row[1] = pick_at(best);
      for (int64_t node = best; node > 0; node = row[node]) out_row[1 + d[node]] = node;
    }
  });
  return out;
}

}  // namespace

at::Tensor verify_tree_greedy(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 3 && tokens.dim() == 2 && logits.size(0) == tokens.size(0) && logits.size(1) == tokens.size(1) &&
                  logits.size(2) > 0,
              "verify_tree_greedy: logits [B, N, V] matching the tokens, V >= 1");
  const at::Tensor x = logits.contiguous();
  const int64_t n = tokens.size(1), vocab = x.size(2);
  at::Tensor out;
  with_logits(x, "verify_tree_greedy", [&](const auto* xp) {
    out = greedy_walk(tokens, parents, "verify_tree_greedy", 1,
                      [&](int64_t b, int64_t node) { return argmax_row(xp + (b * n + node) * vocab, vocab); });
  });
  return out;
}

// verify_tree_greedy given the target's greedy token after every node, [B, N] int64 (a fused
// lm_head + argmax's output) instead of its logits.
at::Tensor verify_tree_greedy_ids(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_ids) {
  TORCH_CHECK(target_ids.scalar_type() == at::kLong && target_ids.sizes() == tokens.sizes(),
              "verify_tree_greedy_ids: int64 target_ids [B, N] matching the tokens");
  const at::Tensor ids = target_ids.contiguous();
  const int64_t n = tokens.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  // A few integer compares per request: a thread pool's wake-up would cost more.
  return greedy_walk(tokens, parents, "verify_tree_greedy_ids", tokens.size(0),
                     [&](int64_t b, int64_t node) { return ip[b * n + node]; });
}

// What a speculative round commits (eagle_worker._commit), from a verification's [B, D + 2] table
// (per request: num_accepted, bonus token, accepted nodes), for requests whose path is the root
// then their accepted nodes: T = sum(num_accepted + 1) entries, request after request, as the rows
// of a [5, T] int64 table: the slot that holds the path node's entries (slots[b, node]), the slot
// they belong in (slots[b, i] for the path's i-th entry), its position (prefix[b] + i), its row of
// the verify features (b * N + node), and the draft extend's id there (the path's next token, the
// bonus token after the last). Then the draft extend's per-request vectors: [3, B] (its new tokens
// num_accepted + 1, its sequence lengths prefix + num_accepted + 1, each request's last entry) and
// [B + 1] (each request's first entry, then T).
std::vector<at::Tensor> commit_table(const at::Tensor& verify_table, const at::Tensor& tokens, const at::Tensor& slots,
                                     const at::Tensor& prefix) {
  for (const at::Tensor* x : {&verify_table, &tokens, &slots, &prefix}) {
    TORCH_CHECK(x->scalar_type() == at::kLong, "commit_table: int64 tensors");
  }
  TORCH_CHECK(tokens.dim() == 2 && verify_table.dim() == 2 && slots.dim() == 2 && verify_table.size(1) >= 2,
              "commit_table: tokens [B, N], verify_table [B, D + 2], slots [B, S]");
  const int64_t batch = tokens.size(0), n = tokens.size(1), depth = verify_table.size(1) - 2, scratch = slots.size(1);
  TORCH_CHECK(verify_table.size(0) == batch && slots.size(0) == batch && prefix.numel() == batch,
              "commit_table: one row per request in every input");
  TORCH_CHECK(depth < n && n <= scratch, "commit_table: a path of at most N nodes, slots [B, S] with S >= N");
  const at::Tensor table_c = verify_table.contiguous(), tokens_c = tokens.contiguous();
  const at::Tensor slots_c = slots.contiguous(), prefix_c = prefix.contiguous();
  const int64_t* vp = table_c.data_ptr<int64_t>();
  const int64_t *tp = tokens_c.data_ptr<int64_t>(), *sp = slots_c.data_ptr<int64_t>(), *pp = prefix_c.data_ptr<int64_t>();
  const int64_t width = depth + 2;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t a = vp[b * width];
    TORCH_CHECK(a >= 0 && a <= depth, "commit_table: num_accepted ", a, " outside 0 .. ", depth);
    for (int64_t i = 0; i < a; ++i) {
      const int64_t node = vp[b * width + 2 + i];
      TORCH_CHECK(node >= 1 && node < n, "commit_table: accepted node ", node, " outside 1 .. ", n - 1);
    }
    total += a + 1;
  }
  at::Tensor out = at::empty({5, total}, tokens.options());
  at::Tensor per_request = at::empty({3, batch}, tokens.options()), starts = at::empty({batch + 1}, tokens.options());
  int64_t* src = out.data_ptr<int64_t>();
  int64_t *dst = src + total, *positions = dst + total, *feature_rows = positions + total, *ids = feature_rows + total;
  int64_t *extend_lens = per_request.data_ptr<int64_t>(), *seq_lens = extend_lens + batch, *last = seq_lens + batch;
  int64_t* entry_starts = starts.data_ptr<int64_t>();
  int64_t e = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* row = vp + b * width;  // num_accepted, bonus, nodes
    entry_starts[b] = e;
    extend_lens[b] = row[0] + 1;
    seq_lens[b] = pp[b] + row[0] + 1;
    last[b] = e + row[0];
    for (int64_t i = 0; i <= row[0]; ++i, ++e) {
      const int64_t node = i == 0 ? 0 : row[1 + i];
      src[e] = sp[b * scratch + node];
      dst[e] = sp[b * scratch + i];
      positions[e] = pp[b] + i;
      feature_rows[e] = b * n + node;
      ids[e] = i < row[0] ? tp[b * n + row[2 + i]] : row[1];
    }
  }
  entry_starts[batch] = total;
  return {out, per_request, starts};
}

}  // namespace eaglet
