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

from eaglet import kernels
from eaglet.layers.sampler import greedy_tokens

__all__ = ["VerifyResult", "CommitTable", "TreeIndex", "build_tree_index", "verify_greedy", "verify_greedy_ids", "verify_sampling"]


def _long(t: torch.Tensor) -> torch.Tensor:
    """``t.long()`` without the op call where it is int64 already (the kernels' inputs in a round are)."""
    return t if t.dtype == torch.long else t.long()


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

    def commit_table(self, tokens: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor) -> "CommitTable":
        """The round's commit for requests whose tree nodes sit at ``slots`` [B, S] (node j at
        slots[b, j]) after a prefix of ``prefix`` [B] tokens (see ``CommitTable``)."""
        if tokens.device.type == "cpu" and kernels.loaded():
            return CommitTable(*torch.ops.eaglet.commit_table(self.table, _long(tokens), slots, prefix))
        n = tokens.shape[1]
        tokens_l, slots_l, prefix_l = tokens.tolist(), slots.tolist(), prefix.tolist()
        columns: list[list[int]] = []
        extend_lens, seq_lens, last, starts = [], [], [], [0]
        for b, (a, bonus, *nodes) in enumerate(self.table.tolist()):
            path = [0] + nodes[:a]
            next_ids = [tokens_l[b][node] for node in path[1:]] + [bonus]
            columns.extend(
                [slots_l[b][node], slots_l[b][i], prefix_l[b] + i, b * n + node, next_ids[i]] for i, node in enumerate(path)
            )
            extend_lens.append(a + 1)
            seq_lens.append(prefix_l[b] + a + 1)
            last.append(starts[-1] + a)
            starts.append(starts[-1] + a + 1)
        return CommitTable(
            entries=torch.tensor(columns, dtype=torch.long).view(-1, 5).t().contiguous(),
            per_request=torch.tensor([extend_lens, seq_lens, last], dtype=torch.long).view(3, -1),
            entry_starts=torch.tensor(starts, dtype=torch.long),
        )


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


@dataclass
class TreeIndex:
    valid: torch.Tensor  # [B, N] bool: node is part of the tree (root included)
    depth: torch.Tensor  # [B, N] depth of each node (root 0; padding 0)
    children: torch.Tensor  # [B, N, K] k-th child (sibling order) of each node, -1 if none
    max_depth: int  # D: the largest depth over the batch
    children_lists: list[list[list[int]]]  # [B][N]: the same children, as lists


def build_tree_index(parents: torch.Tensor) -> TreeIndex:
    """Validates ``parents`` and derives node depths and the per-node child table.

    Trees hold a few nodes per request, so this runs over Python lists (one pass per request)
    and converts the results once."""
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


def _check_inputs(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, name: str) -> None:
    if tokens.shape != parents.shape or tokens.dim() != 2:
        raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must both be [B, N]")
    if scores.dim() != 3 or scores.shape[:2] != tokens.shape:
        raise ValueError(f"{name} must be [B, N, V] matching tokens {tuple(tokens.shape)}, got {tuple(scores.shape)}")


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


def _verify_greedy_chain(tokens: torch.Tensor, target: torch.Tensor) -> VerifyResult:
    """``verify_greedy`` for chains: the accepted nodes are the run of leading nodes whose token is
    the target's pick after the node before. A chain holds a few nodes per request, so the run is
    found over Python lists (the vectorised form costs about ten tensor ops)."""
    batch, n = tokens.shape
    depth = n - 1
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
    return _greedy_result(accepted, num, bonus, depth, tokens.device)


def _greedy_result(accepted: list[list[int]], num: list[int], bonus: list[int], depth: int, device: torch.device) -> VerifyResult:
    """The result of a walk over lists, in one host-to-tensor copy (each copy of a small list
    costs about 10 us inside a round)."""
    table = torch.tensor([[n, b, *nodes] for n, b, nodes in zip(num, bonus, accepted)], dtype=torch.long)
    return VerifyResult(table.view(len(num), depth + 2).to(device))


def verify_greedy(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> VerifyResult:
    """Accepts the longest path whose tokens equal the target argmax at their parents: one kernel
    call where the CPU kernels are loaded (it reduces only the logits of nodes on matching paths,
    so a chain's only up to its first rejection; bad trees raise RuntimeError there, ValueError here)."""
    if kernels.loaded() and logits.dtype in (torch.float32, torch.bfloat16) and logits.device.type == "cpu":
        return VerifyResult(torch.ops.eaglet.verify_tree_greedy(_long(tokens), _long(parents), logits))
    _check_inputs(tokens, parents, logits, "logits")
    return _verify_greedy_picks(tokens.long(), parents.long(), greedy_tokens(logits))


def verify_greedy_ids(tokens: torch.Tensor, parents: torch.Tensor, target_ids: torch.Tensor) -> VerifyResult:
    """``verify_greedy`` given the target's greedy token after every node, [B, N] (a forward that
    returned ``greedy_ids``), instead of its logits."""
    if kernels.loaded() and target_ids.device.type == "cpu":
        return VerifyResult(torch.ops.eaglet.verify_tree_greedy_ids(_long(tokens), _long(parents), _long(target_ids)))
    if tokens.shape != parents.shape or tokens.shape != target_ids.shape or tokens.dim() != 2:
        raise ValueError(f"tokens, parents and target_ids must all be [B, N], got {tuple(tokens.shape)}, "
                         f"{tuple(parents.shape)}, {tuple(target_ids.shape)}")
    return _verify_greedy_picks(tokens.long(), parents.long(), target_ids)


def _verify_greedy_picks(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor) -> VerifyResult:
    """The list walk of ``verify_greedy`` given the target's next token after each node [B, N]."""
    batch, n = tokens.shape
    if torch.equal(parents, (torch.arange(n, device=tokens.device) - 1).expand(batch, n)):  # a chain
        return _verify_greedy_chain(tokens, target)
    return _verify_greedy_tree(tokens, parents, target)


def _verify_greedy_tree(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor) -> VerifyResult:
    """``verify_greedy`` for any tree, given the target's pick after each node.

    A tree holds a few nodes per request, so the walk runs over Python lists (a handful of tensor
    ops would cost more): the accepted path is the deepest one whose every node's token is the
    target's pick after its parent; among equally deep ones (only possible with duplicate sibling
    tokens, whose paths then carry identical tokens) the one ending at the lowest node index."""
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
    return _greedy_result(accepted, num, bonus, tree.max_depth, tokens.device)


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
    _check_inputs(tokens, parents, probs, "probs")
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
