// EAGLE-2 draft trees: selecting a round's tree from its candidates (select_draft_tree) and the
// verify pass's attention mask of the trees (tree_attention_mask).
#include "ops.h"

#include <algorithm>

namespace eaglet {

// EAGLE-2 tree selection (tree.py's CandidateRecorder.build_tree). Per request, of its M candidates
// (target ids, cumulative draft log-probabilities, the parent's candidate index or -1 for the root,
// and depths [M] shared by all requests), the num_nodes - 1 ranked highest by score less 1e-12 per
// candidate index (in double, so equal scores go to the earlier candidate), in candidate order after
// the root. Returns [tokens, parents (node indices, -1 for the root), depths], each [B, num_nodes].
std::vector<at::Tensor> select_draft_tree(const at::Tensor& tokens, const at::Tensor& scores, const at::Tensor& parents,
                                          const at::Tensor& depths, const at::Tensor& roots, int64_t num_nodes) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && parents.sizes() == tokens.sizes() &&
                  parents.scalar_type() == at::kLong && scores.sizes() == tokens.sizes() && scores.scalar_type() == at::kFloat,
              "select_draft_tree: int64 tokens and parents, float32 scores, each [B, M]");
  const int64_t batch = tokens.size(0), candidates = tokens.size(1);
  TORCH_CHECK(depths.dim() == 1 && depths.size(0) == candidates && depths.scalar_type() == at::kLong && roots.dim() == 1 &&
                  roots.size(0) == batch && roots.scalar_type() == at::kLong,
              "select_draft_tree: int64 depths [M] and roots [B]");
  TORCH_CHECK(num_nodes >= 1 && num_nodes - 1 <= candidates, "select_draft_tree: ", num_nodes, " nodes from ", candidates,
              " candidates");
  const at::Tensor tc = tokens.contiguous(), sc = scores.contiguous(), pc = parents.contiguous(), dc = depths.contiguous();
  const at::Tensor rc = roots.contiguous();
  const int64_t *tp = tc.data_ptr<int64_t>(), *pp = pc.data_ptr<int64_t>(), *dp = dc.data_ptr<int64_t>();
  const int64_t* rp = rc.data_ptr<int64_t>();
  const float* sp = sc.data_ptr<float>();
  at::Tensor out_tokens = at::empty({batch, num_nodes}, tokens.options());
  at::Tensor out_parents = at::empty({batch, num_nodes}, tokens.options());
  at::Tensor out_depths = at::empty({batch, num_nodes}, tokens.options());
  int64_t *ot = out_tokens.data_ptr<int64_t>(), *op = out_parents.data_ptr<int64_t>(), *od = out_depths.data_ptr<int64_t>();
  std::vector<double> key(candidates);
  std::vector<int64_t> order(candidates), node_of(candidates);
  const int64_t kept = num_nodes - 1;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t c = 0; c < candidates; ++c) {
      key[c] = static_cast<double>(sp[b * candidates + c]) - static_cast<double>(c) * 1e-12;
      order[c] = c;
    }
    std::partial_sort(order.begin(), order.begin() + kept, order.end(),
                      [&](int64_t x, int64_t y) { return key[x] > key[y] || (key[x] == key[y] && x < y); });
    std::sort(order.begin(), order.begin() + kept);
    std::fill(node_of.begin(), node_of.end(), -1);
    for (int64_t i = 0; i < kept; ++i) node_of[order[i]] = i + 1;
    int64_t* row_tokens = ot + b * num_nodes;
    int64_t* row_parents = op + b * num_nodes;
    int64_t* row_depths = od + b * num_nodes;
    row_tokens[0] = rp[b], row_parents[0] = -1, row_depths[0] = 0;
    for (int64_t i = 0; i < kept; ++i) {
      const int64_t c = order[i], parent = pp[b * candidates + c];
      TORCH_CHECK(parent >= -1 && parent < candidates, "select_draft_tree: parent candidate ", parent, " out of range");
      const int64_t parent_node = parent < 0 ? 0 : node_of[parent];
      TORCH_CHECK(parent_node >= 0, "draft tree selection kept a node without its parent");
      row_tokens[i + 1] = tp[b * candidates + c];
      row_parents[i + 1] = parent_node;
      row_depths[i + 1] = dp[c];
    }
  }
  return {out_tokens, out_parents, out_depths};
}

// The verify pass's mask of trees placed at row indices prefix .. prefix + N - 1 (tree.py's
// tree_attention_mask): [B * N, num_keys] bool, node i of request b seeing row indices below
// prefix[b], its ancestors' and its own. Parents: -1 for the root, else an earlier node.
at::Tensor tree_attention_mask(const at::Tensor& parents, const at::Tensor& prefix, int64_t num_keys) {
  TORCH_CHECK(parents.dim() == 2 && parents.scalar_type() == at::kLong && prefix.dim() == 1 && prefix.size(0) == parents.size(0) &&
                  prefix.scalar_type() == at::kLong,
              "tree_attention_mask: int64 parents [B, N] and prefix [B]");
  const int64_t batch = parents.size(0), n = parents.size(1);
  const at::Tensor pc = parents.contiguous(), prefix_c = prefix.contiguous();
  const int64_t *pp = pc.data_ptr<int64_t>(), *xp = prefix_c.data_ptr<int64_t>();
  at::Tensor mask = at::zeros({batch * n, num_keys}, parents.options().dtype(at::kBool));
  bool* mp = mask.data_ptr<bool>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(xp[b] >= 0 && xp[b] + n <= num_keys, "tree_attention_mask: prefix ", xp[b], " + ", n, " nodes past ", num_keys, " keys");
    for (int64_t i = 0; i < n; ++i) {
      bool* row = mp + (b * n + i) * num_keys;
      std::fill(row, row + xp[b], true);
      for (int64_t j = i; j >= 0; j = pp[b * n + j]) {
        TORCH_CHECK((j == 0) == (pp[b * n + j] < 0) && pp[b * n + j] < j,
                    "tree_attention_mask: node 0 is the root (parent -1), every other node's parent an earlier node");
        row[xp[b] + j] = true;
      }
    }
  }
  return mask;
}

}  // namespace eaglet
