"""Draft trees: recording candidates while drafting, choosing the nodes to verify, tree masks.

EAGLE-2 dynamic trees with SGLang's parameters. Every candidate carries its cumulative draft
log-probability; the tree keeps the best ``num_draft_tokens - 1`` candidates. A child's score never
exceeds its parent's (log-probabilities are <= 0) and ties go to the earlier candidate, so a kept
child's parent is always kept too. Nodes are ordered by creation, which puts parents before
children and, among siblings, the drafter's preferred one first. All of it is batched over requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglet import kernels
from eaglet.runtime.forward_batch import long_tensor


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] target token ids; node 0 is the root (last committed token)
    parents: torch.Tensor  # [B, N] parent node index, -1 for the root
    depths: torch.Tensor  # [B, N] 0 for the root

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def node_paths(self) -> list[list[list[int]]]:
        """[B][N]: the nodes from the root down to node i (both included), walked up the parents
        in Python: a tree has a few nodes per request."""
        paths = []
        for row in self.parents.tolist():
            row_paths: list[list[int]] = []
            for i in range(len(row)):
                path, j = [], i
                while j >= 0:
                    path.append(j)
                    j = row[j]
                row_paths.append(path[::-1])
            paths.append(row_paths)
        return paths


class CandidateRecorder:
    """Collects every candidate proposed during drafting, for all requests at once."""

    def __init__(self) -> None:
        self._tokens: list[torch.Tensor] = []
        self._scores: list[torch.Tensor] = []
        self._parents: list[torch.Tensor] = []
        self._depths: list[int] = []
        self.count = 0

    def add(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
        """Records [B, m] candidates (parents: candidate ids, -1 = root); returns their candidate ids [m]."""
        m = tokens.shape[1]
        self._tokens.append(tokens)
        self._scores.append(scores)
        self._parents.append(parents)
        self._depths.append(depth)
        ids = torch.arange(self.count, self.count + m)
        self.count += m
        return ids

    def build_tree(self, root_tokens: torch.Tensor, num_nodes: int) -> DraftTree:
        tokens = torch.cat(self._tokens, dim=1)  # [B, M]
        scores = torch.cat(self._scores, dim=1)
        parents = torch.cat(self._parents, dim=1)
        depths = torch.cat([torch.full((t.shape[1],), d, dtype=torch.long) for t, d in zip(self._tokens, self._depths)])
        if kernels.loaded() and scores.dtype == torch.float32:
            return DraftTree(*torch.ops.eaglet.select_draft_tree(tokens, scores, parents, depths, root_tokens, num_nodes))
        return _select_tree(tokens, scores.double(), parents, depths, root_tokens, num_nodes)


def _select_tree(
    tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, root_tokens: torch.Tensor,
    num_nodes: int,
) -> DraftTree:
    batch, num_candidates = tokens.shape
    # Ties go to the earlier candidate (a parent is always earlier than its children).
    order_penalty = torch.arange(num_candidates, dtype=torch.float64) * 1e-12
    keep = (scores - order_penalty).topk(num_nodes - 1, dim=1).indices.sort(dim=1).values  # [B, N-1]
    # Candidate id -> node index (1-based; the root is node 0).
    node_of = torch.full((batch, num_candidates), -1, dtype=torch.long)
    node_of.scatter_(1, keep, torch.arange(1, num_nodes).expand(batch, -1))
    kept_parents = parents.gather(1, keep)
    parent_nodes = torch.where(
        kept_parents < 0, torch.zeros_like(kept_parents), node_of.gather(1, kept_parents.clamp(min=0))
    )
    if (parent_nodes < 0).any():
        raise RuntimeError("draft tree selection kept a node without its parent")
    root_col = torch.zeros(batch, 1, dtype=torch.long)
    return DraftTree(
        tokens=torch.cat([root_tokens[:, None], tokens.gather(1, keep)], dim=1),
        parents=torch.cat([root_col - 1, parent_nodes], dim=1),
        depths=torch.cat([root_col, depths[keep]], dim=1),
    )


def tree_attention_mask(tree: DraftTree, prefix_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B*N, num_keys] bool for verifying the tree placed at row indices prefix_len .. prefix_len+N-1.

    Each node sees its request's whole committed prefix, its ancestors and itself.
    """
    if kernels.loaded():
        return torch.ops.eaglet.tree_attention_mask(tree.parents, prefix_lens, num_keys)
    batch, n = tree.tokens.shape
    mask = (torch.arange(num_keys)[None, None, :] < prefix_lens[:, None, None]).expand(batch, n, num_keys).contiguous()
    prefix = prefix_lens.tolist()
    columns = [
        (b * n + i) * num_keys + prefix[b] + j for b, row in enumerate(tree.node_paths()) for i, path in enumerate(row) for j in path
    ]
    mask.view(-1)[long_tensor(columns)] = True
    return mask.view(batch * n, num_keys)
