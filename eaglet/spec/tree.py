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

from eaglet.backends.base import SpecOps
from eaglet.backends.pytorch.spec_ops import node_paths


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] target token ids; node 0 is the root (last committed token)
    parents: torch.Tensor  # [B, N] parent node index, -1 for the root
    depths: torch.Tensor  # [B, N] 0 for the root

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def node_paths(self) -> list[list[list[int]]]:
        """[B][N]: the nodes from the root down to node i (both included)."""
        return node_paths(self.parents)


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

    def build_tree(self, root_tokens: torch.Tensor, num_nodes: int, ops: SpecOps) -> DraftTree:
        tokens = torch.cat(self._tokens, dim=1)  # [B, M]
        scores = torch.cat(self._scores, dim=1)
        parents = torch.cat(self._parents, dim=1)
        depths = torch.cat([torch.full((t.shape[1],), d, dtype=torch.long) for t, d in zip(self._tokens, self._depths)])
        return DraftTree(*ops.select_draft_tree(tokens, scores, parents, depths, root_tokens, num_nodes))


def tree_attention_mask(tree: DraftTree, prefix_lens: torch.Tensor, num_keys: int, ops: SpecOps) -> torch.Tensor:
    """[B*N, num_keys] bool for verifying the tree placed at row indices prefix_len .. prefix_len+N-1.

    Each node sees its request's whole committed prefix, its ancestors and itself.
    """
    return ops.tree_attention_mask(tree.parents, prefix_lens, num_keys)
