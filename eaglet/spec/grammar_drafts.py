"""Structured output under speculation: the target's verify logits are masked at every node by the
grammar state after that node's path, so each node's distribution is the one plain decoding would
mask there, and draft tokens the grammar rejects are cut before verification.

A node whose token the grammar rejects has probability 0 under its parent's masked distribution,
so neither greedy nor sampled verification can accept it (nor anything below it): greedy output
is exactly plain greedy output under the grammar, sampled output is drawn from the masked
distribution. Cutting spares the verify forward such nodes: the columns after the last node any
request's grammar keeps are dropped (a chain's rejected tail; trees keep rejected nodes that sit
among kept ones, as the tree mask has no padding, and they are never accepted).
"""

from __future__ import annotations

import torch

from eaglet.executor.request import Request
from eaglet.spec.tree import DraftTree


def _draft_paths(tree: DraftTree, b: int, tokens: list[list[int]], paths: list[list[list[int]]]) -> list[list[int]]:
    """Per node of request b, the draft tokens from the root's child down to it (the root itself
    is emitted already)."""
    return [[tokens[b][n] for n in path[1:]] for path in paths[b]]


def cut_rejected_drafts(tree: DraftTree, requests: list[Request]) -> DraftTree:
    """The tree without the columns after the last node whose path some request's grammar takes
    (no request without a grammar: those keep every node)."""
    if any(r.grammar is None for r in requests):
        return tree
    tokens, paths = tree.tokens.tolist(), tree.node_paths()
    width = 1
    for b, req in enumerate(requests):
        drafts = _draft_paths(tree, b, tokens, paths)
        kept = [j for j, path in enumerate(drafts) if req.grammar.valid_prefix(path) == len(path)]
        width = max(width, kept[-1] + 1)
    if width == tree.num_nodes:
        return tree
    return DraftTree(tree.tokens[:, :width], tree.parents[:, :width], tree.depths[:, :width])


def mask_verify_logits(logits: torch.Tensor, tree: DraftTree, requests: list[Request]) -> torch.Tensor:
    """``logits`` [B, N, V] with each grammar request's disallowed tokens at -inf at every node
    whose path the grammar takes (the others are never accepted, so their logits are never read)."""
    grammars = [(b, r.grammar) for b, r in enumerate(requests) if r.grammar is not None]
    if not grammars:
        return logits
    tokens, paths = tree.tokens.tolist(), tree.node_paths()
    out = logits.clone()
    for b, grammar in grammars:
        for j, allowed in enumerate(grammar.path_masks(_draft_paths(tree, b, tokens, paths))):
            if allowed is not None:
                out[b, j].masked_fill_(~allowed.to(out.device), float("-inf"))
    return out
