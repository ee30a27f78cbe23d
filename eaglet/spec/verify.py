"""Verification of EAGLE draft trees against the target model, vectorised over a batch of requests.

Tree representation, for B requests of N nodes each:

    tokens  [B, N] int64  token id of each node; node 0 is the root (the last committed token)
    parents [B, N] int64  parent node index, -1 for the root

Nodes are ordered parents before children, and siblings are tried in increasing node index (the
drafter's preference). A node j > 0 whose parent is -1 is padding: it is not part of the tree, so a
batch may mix trees of different sizes by padding them to the same N.

The target's output at node n is its distribution over the token that FOLLOWS node n:
logits [B, N, V] (greedy) or probs [B, N, V] (sampling, already shaped by the sampler:
temperature, top-k, top-p, ... are applied before verification and taken as given here).

Greedy: accept the longest root-to-leaf path whose every token equals the target argmax at its
parent; the bonus token is the argmax at the last accepted node (the root when none is accepted).
This emits exactly the tokens non-speculative greedy decoding would (ties: first index, as
``logits.argmax(-1)`` in eaglet's sampler).

Sampling (lossless tree speculative sampling, drafts treated as one-hot proposals): starting at the
root with r = p_root, try the children in sibling order; accept child x with probability
r(x) / sum(r); on rejection set r(x) = 0 and try the next sibling; on acceptance move to the child
with r = p_child. When a node has no child left to try, the bonus token is sampled from r
(normalised). Every emitted token is then distributed exactly as if sampled from the target.

Randomness: request b draws ``n_b`` uniforms (n_b = its number of non-padding nodes) from its own
generator, in one call, before anything else: one uniform per draft node for its acceptance test and
one for the bonus token. The draws therefore depend only on the request's own tree and generator,
never on the other requests in the batch or on its position in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglet.backends.base import SpecOps
from eaglet.backends.pytorch.spec_ops import build_tree_index, check_tree_inputs

__all__ = ["VerifyResult", "CommitTable", "verify_greedy", "verify_greedy_ids", "verify_sampling"]


@dataclass
class VerifyResult:
    """Per request: how many draft nodes it accepts, the token after them and the nodes, as the
    columns of one [B, D + 2] int64 table (the commit reads it in one kernel call)."""

    table: torch.Tensor  # [B, D + 2]: num_accepted, bonus token, accepted nodes

    @classmethod
    def of(cls, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, bonus_tokens: torch.Tensor) -> "VerifyResult":
        return cls(torch.cat([num_accepted[:, None], bonus_tokens[:, None], accepted_nodes], dim=1).long())

    @property
    def accepted_nodes(self) -> torch.Tensor:
        """[B, D] node indices of the accepted path below the root, -1 padded."""
        return self.table[:, 2:]

    @property
    def num_accepted(self) -> torch.Tensor:
        """[B] number of accepted draft nodes (0..D)."""
        return self.table[:, 0]

    @property
    def bonus_tokens(self) -> torch.Tensor:
        """[B] the token that follows the accepted path."""
        return self.table[:, 1]

    def emitted_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, D + 1]: the accepted path's tokens followed by the bonus token, padded with -1.

        Row b holds ``num_accepted[b] + 1`` valid tokens (the accept length including the bonus).
        """
        batch, depth = self.accepted_nodes.shape
        out = torch.full((batch, depth + 1), -1, dtype=torch.long, device=tokens.device)
        if depth:
            path_tokens = tokens.gather(1, self.accepted_nodes.clamp(min=0))
            out[:, :depth] = torch.where(self.accepted_nodes >= 0, path_tokens, -1)
        out.scatter_(1, self.num_accepted[:, None], self.bonus_tokens[:, None])
        return out

    def with_rows(self, rows: torch.Tensor, other: "VerifyResult") -> "VerifyResult":
        """This result with ``rows`` replaced by ``other``'s rows (sampled requests of a greedy
        batch). Their trees may all be shallower than the batch's deepest: ``other`` may have
        fewer node columns, and the rest are padding."""
        table = self.table.clone()
        table[rows] = -1
        table[rows, : other.table.shape[1]] = other.table
        return VerifyResult(table)

    def commit_table(self, tokens: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor, ops: SpecOps) -> "CommitTable":
        """The round's commit for requests whose tree nodes sit at ``slots`` [B, S] (node j at
        slots[b, j]) after a prefix of ``prefix`` [B] tokens (see ``CommitTable``)."""
        return CommitTable(*ops.commit_table(self.table, tokens, slots, prefix))


@dataclass
class CommitTable:
    """What a round commits, per request's path (the root, then its accepted nodes; T entries in
    all, request after request), from one kernel call: the entries, and the draft extend's
    per-request vectors over them."""

    # [5, T] per entry: the slot that holds the node's entries, the slot they belong in (slots[b, i]
    # for the path's i-th entry), the position prefix[b] + i, the node's row of the [B * N] verify
    # features, and the path's next token (the bonus after the last): the draft extend's id there.
    entries: torch.Tensor
    # [3, B]: num_accepted + 1 (the path's entries), prefix + num_accepted + 1, each request's last entry.
    per_request: torch.Tensor
    entry_starts: torch.Tensor  # [B + 1]: each request's first entry, then T


def _path_to(node: torch.Tensor, num: torch.Tensor, parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, D] node indices from depth 1 down to ``node`` (at depth ``num``), padded with -1."""
    batch = node.shape[0]
    out = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=node.device)  # +1: dump column
    cur = node.clone()
    for step in range(max_depth):  # the step-th ancestor of ``node`` sits at position num - 1 - step
        pos = num - 1 - step
        live = pos >= 0
        out.scatter_(1, torch.where(live, pos, max_depth)[:, None], cur[:, None])
        cur = parents.gather(1, cur[:, None])[:, 0].clamp(min=0)
    return out[:, :max_depth]


def verify_greedy(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, ops: SpecOps) -> VerifyResult:
    """Accepts the longest path whose tokens equal the target argmax at their parents (bad trees
    raise ValueError in the PyTorch ops, RuntimeError in the kernels)."""
    return VerifyResult(ops.verify_tree_greedy(tokens, parents, logits))


def verify_greedy_ids(tokens: torch.Tensor, parents: torch.Tensor, target_ids: torch.Tensor, ops: SpecOps) -> VerifyResult:
    """``verify_greedy`` given the target's greedy token after every node, [B, N] (a forward that
    returned ``greedy_ids``), instead of its logits."""
    return VerifyResult(ops.verify_tree_greedy_ids(tokens, parents, target_ids))


def _draw_uniforms(valid: torch.Tensor, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[B, N] float64 uniforms in [0, 1): request b draws exactly its number of tree nodes from its
    own generator (None: the global RNG), assigned to its nodes in index order; the root's slot is
    the bonus token's uniform."""
    batch, n = valid.shape
    if len(generators) != batch:
        raise ValueError(f"need one generator per request: {len(generators)} for {batch} requests")
    counts = valid.sum(1).tolist()
    draws = torch.zeros(batch, n, dtype=torch.float64)
    for b, gen in enumerate(generators):  # the only per-request loop: each request's own RNG
        if gen is None:
            u = torch.rand(counts[b], dtype=torch.float64)
        else:
            u = torch.rand(counts[b], dtype=torch.float64, generator=gen, device=gen.device)
        draws[b, : counts[b]] = u.cpu()
    draws = draws.to(device)
    rank = (valid.long().cumsum(1) - 1).clamp(min=0)
    return draws.gather(1, rank)


def _sample_from(weights: torch.Tensor, fallback: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of one token per row from unnormalised float64 ``weights`` [B, V] with
    uniforms ``u`` [B]. Rows of zero mass fall back to ``fallback`` (the node's unmodified target
    distribution), and to its argmax if that has no mass either."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1]
    empty = ~(total > 0)  # also catches NaN
    if empty.any():
        weights = torch.where(empty[:, None], fallback.double(), weights)
        cdf = weights.cumsum(-1)
        total = cdf[:, -1]
    # first index whose cdf exceeds u * total: it has positive weight, since u * total < total.
    token = torch.searchsorted(cdf, (u * total)[:, None].contiguous(), right=True)[:, 0]
    token = token.clamp(max=weights.shape[-1] - 1)
    still_empty = ~(total > 0)
    if still_empty.any():
        token = torch.where(still_empty, fallback.argmax(-1), token)
    return token


def verify_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
) -> VerifyResult:
    """Lossless tree speculative sampling with one-hot draft proposals (see the module docstring)."""
    check_tree_inputs(tokens, parents, probs, "probs")
    tokens, parents = tokens.long(), parents.long()
    tree = build_tree_index(parents)
    batch, n, vocab = probs.shape
    device = probs.device
    rows = torch.arange(batch, device=device)
    uniforms = _draw_uniforms(tree.valid, generators, device)  # [B, N] float64

    cur = torch.zeros(batch, dtype=torch.long, device=device)  # current node
    residual = probs[:, 0].double().clone()  # r: the current node's distribution, rejected tokens zeroed
    num = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)  # still walking down the tree
    num_ranks = tree.children.shape[2]
    for _depth in range(tree.max_depth):
        kids = tree.children[rows, cur]  # [B, K]
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        nxt = cur.clone()
        for k in range(num_ranks):
            child = kids[:, k]
            trying = active & ~moved & (child >= 0)
            if not trying.any():
                continue
            child_c = child.clamp(min=0)
            x = tokens.gather(1, child_c[:, None])  # [B, 1]
            rx = residual.gather(1, x)[:, 0]
            mass = residual.sum(-1)
            u = uniforms.gather(1, child_c[:, None])[:, 0]
            # accept with probability r(x) / sum(r). If x is the only token left, rx == mass and
            # u < 1 accepts for sure, so a rejection always leaves positive mass behind; r(x) == 0
            # (a zero-probability or duplicate, already rejected token) is always rejected.
            accept = trying & (u * mass < rx)
            reject = trying & ~accept
            residual.scatter_(1, x, torch.where(reject, 0.0, rx)[:, None])
            moved |= accept
            nxt = torch.where(accept, child, nxt)
        if not moved.any():
            break
        cur = nxt
        num = num + moved.long()
        residual = torch.where(moved[:, None], probs[rows, cur].double(), residual)
        active = moved
    bonus_u = uniforms[:, 0]
    bonus = _sample_from(residual, probs[rows, cur], bonus_u)
    accepted = _path_to(cur, num, parents, tree.max_depth)
    return VerifyResult.of(accepted, num, bonus)
