"""A speculative round's tree selection, verification and commit in PyTorch ops and Python lists
(``SpecOps``). Trees hold a few nodes per request, so walks run over Python lists and convert
their result once; tensor ops cost more there.

Trees are [B, N] tensors: ``tokens`` (node 0 the root) and ``parents`` (-1 for the root). Nodes
are ordered parents before children, siblings in the drafter's preference; a node j > 0 whose
parent is -1 is padding, so trees of different sizes share one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglet.backends.pytorch.sampling_ops import TorchSamplingOps
from eaglet.runtime.forward_batch import long_tensor


@dataclass
class TreeIndex:
    valid: torch.Tensor  # [B, N] bool: node is part of the tree (root included)
    depth: torch.Tensor  # [B, N] depth of each node (root 0; padding 0)
    children: torch.Tensor  # [B, N, K] k-th child (sibling order) of each node, -1 if none
    max_depth: int  # D: the largest depth over the batch
    children_lists: list[list[list[int]]]  # [B][N]: the same children, as lists


def build_tree_index(parents: torch.Tensor) -> TreeIndex:
    """Validates ``parents`` and derives node depths and the per-node child table, over Python
    lists (one pass per request), converted once."""
    if parents.dim() != 2 or parents.shape[1] < 1:
        raise ValueError(f"parents must be [B, N] with N >= 1, got {tuple(parents.shape)}")
    batch, n = parents.shape
    valid: list[list[bool]] = []
    depth: list[list[int]] = []
    children: list[list[list[int]]] = []
    for row in parents.tolist():
        if row[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        row_valid, row_depth = [True] + [False] * (n - 1), [0] * n
        row_children: list[list[int]] = [[] for _ in range(n)]
        for node in range(1, n):
            parent = row[node]
            if parent >= node or parent < -1:
                raise ValueError("every node's parent must be -1 or an earlier node")
            if parent < 0:
                continue  # padding
            # A node whose parent is padding would be unreachable: reject it rather than guess.
            if not row_valid[parent]:
                raise ValueError("a node's parent is a padding node")
            row_valid[node], row_depth[node] = True, row_depth[parent] + 1
            row_children[parent].append(node)
        valid.append(row_valid)
        depth.append(row_depth)
        children.append(row_children)
    max_depth = max((max(row) for row in depth), default=0)
    k = max((len(c) for row in children for c in row), default=0) or 1
    table = [[c + [-1] * (k - len(c)) for c in row] for row in children]
    device = parents.device
    return TreeIndex(
        valid=torch.tensor(valid, dtype=torch.bool, device=device).view(batch, n),
        depth=torch.tensor(depth, dtype=torch.long, device=device).view(batch, n),
        children=torch.tensor(table, dtype=torch.long, device=device).view(batch, n, k),
        max_depth=max_depth,
        children_lists=children,
    )


def node_paths(parents: torch.Tensor) -> list[list[list[int]]]:
    """[B][N]: the nodes from the root down to node i (both included), walked up the parents."""
    paths = []
    for row in parents.tolist():
        row_paths: list[list[int]] = []
        for i in range(len(row)):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = row[j]
            row_paths.append(path[::-1])
        paths.append(row_paths)
    return paths


def check_tree_inputs(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, name: str) -> None:
    if tokens.shape != parents.shape or tokens.dim() != 2:
        raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must both be [B, N]")
    if scores.dim() != 3 or scores.shape[:2] != tokens.shape:
        raise ValueError(f"{name} must be [B, N, V] matching tokens {tuple(tokens.shape)}, got {tuple(scores.shape)}")


def _greedy_table(accepted: list[list[int]], num: list[int], bonus: list[int], depth: int, device: torch.device) -> torch.Tensor:
    """The verify table of a walk over lists, in one host-to-tensor copy (each copy of a small list
    costs about 10 us inside a round)."""
    table = torch.tensor([[n, b, *nodes] for n, b, nodes in zip(num, bonus, accepted)], dtype=torch.long)
    return table.view(len(num), depth + 2).to(device)


def _verify_chain(tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Chains: the accepted nodes are the run of leading nodes whose token is the target's pick
    after the node before."""
    depth = tokens.shape[1] - 1
    accepted: list[list[int]] = []
    num: list[int] = []
    bonus: list[int] = []
    for row, picks in zip(tokens.tolist(), target.tolist()):
        a = 0
        while a < depth and row[a + 1] == picks[a]:
            a += 1
        accepted.append(list(range(1, a + 1)) + [-1] * (depth - a))
        num.append(a)
        bonus.append(picks[a])
    return _greedy_table(accepted, num, bonus, depth, tokens.device)


def _verify_tree(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Any tree: the accepted path is the deepest one whose every node's token is the target's pick
    after its parent; among equally deep ones (only possible with duplicate sibling tokens, whose
    paths then carry identical tokens) the one ending at the lowest node index."""
    tree = build_tree_index(parents)
    tokens_l, target_l = tokens.tolist(), target.tolist()
    accepted: list[list[int]] = []
    bonus: list[int] = []
    for b, children in enumerate(tree.children_lists):
        best: list[int] = []  # node indices below the root of the best path so far
        stack: list[list[int]] = [[]]
        while stack:
            path = stack.pop()
            if len(path) > len(best) or (len(path) == len(best) and path and path[-1] < best[-1]):
                best = path
            pick = target_l[b][path[-1] if path else 0]
            stack.extend(path + [child] for child in children[path[-1] if path else 0] if tokens_l[b][child] == pick)
        accepted.append(best + [-1] * (tree.max_depth - len(best)))
        bonus.append(target_l[b][best[-1] if best else 0])
    num = [tree.max_depth - row.count(-1) for row in accepted]
    return _greedy_table(accepted, num, bonus, tree.max_depth, tokens.device)


def _verify_picks(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    batch, n = tokens.shape
    if torch.equal(parents, (torch.arange(n, device=tokens.device) - 1).expand(batch, n)):  # a chain
        return _verify_chain(tokens, target)
    return _verify_tree(tokens, parents, target)


class TorchSpecOps:
    def __init__(self, sampling: TorchSamplingOps) -> None:
        self.sampling = sampling

    def select_draft_tree(
        self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
        root_tokens: torch.Tensor, num_nodes: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, num_candidates = tokens.shape
        # Ties go to the earlier candidate (a parent is always earlier than its children).
        order_penalty = torch.arange(num_candidates, dtype=torch.float64) * 1e-12
        keep = (scores.double() - order_penalty).topk(num_nodes - 1, dim=1).indices.sort(dim=1).values  # [B, N-1]
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
        return (
            torch.cat([root_tokens[:, None], tokens.gather(1, keep)], dim=1),
            torch.cat([root_col - 1, parent_nodes], dim=1),
            torch.cat([root_col, depths[keep]], dim=1),
        )

    def tree_attention_mask(self, parents: torch.Tensor, prefix_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
        batch, n = parents.shape
        mask = (torch.arange(num_keys)[None, None, :] < prefix_lens[:, None, None]).expand(batch, n, num_keys).contiguous()
        prefix = prefix_lens.tolist()
        columns = [
            (b * n + i) * num_keys + prefix[b] + j
            for b, row in enumerate(node_paths(parents)) for i, path in enumerate(row) for j in path
        ]
        mask.view(-1)[long_tensor(columns)] = True
        return mask.view(batch * n, num_keys)

    def verify_tree_greedy(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        check_tree_inputs(tokens, parents, logits, "logits")
        return _verify_picks(tokens.long(), parents.long(), self.sampling.argmax(logits))

    def verify_tree_greedy_ids(self, tokens: torch.Tensor, parents: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        if tokens.shape != parents.shape or tokens.shape != target_ids.shape or tokens.dim() != 2:
            raise ValueError(f"tokens, parents and target_ids must all be [B, N], got {tuple(tokens.shape)}, "
                             f"{tuple(parents.shape)}, {tuple(target_ids.shape)}")
        return _verify_picks(tokens.long(), parents.long(), target_ids)

    def commit_table(
        self, table: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = tokens.shape[1]
        tokens_l, slots_l, prefix_l = tokens.tolist(), slots.tolist(), prefix.tolist()
        columns: list[list[int]] = []
        extend_lens, seq_lens, last, starts = [], [], [], [0]
        for b, (a, bonus, *nodes) in enumerate(table.tolist()):
            path = [0] + nodes[:a]
            next_ids = [tokens_l[b][node] for node in path[1:]] + [bonus]
            columns.extend(
                [slots_l[b][node], slots_l[b][i], prefix_l[b] + i, b * n + node, next_ids[i]] for i, node in enumerate(path)
            )
            extend_lens.append(a + 1)
            seq_lens.append(prefix_l[b] + a + 1)
            last.append(starts[-1] + a)
            starts.append(starts[-1] + a + 1)
        return (
            torch.tensor(columns, dtype=torch.long).view(-1, 5).t().contiguous(),
            torch.tensor([extend_lens, seq_lens, last], dtype=torch.long).view(3, -1),
            torch.tensor(starts, dtype=torch.long),
        )
