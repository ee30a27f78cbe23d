"""Tree verification: greedy is exact, sampling is lossless (chi-square), both batch-invariant."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from eaglet import kernels
from eaglet.backends import Backend, cpu_backend, torch_backend
from eaglet.backends.pytorch.spec_ops import _verify_chain, _verify_tree, build_tree_index
from eaglet.layers.sampler import shaped_probs
from eaglet.sampling_params import SamplingParams
from eaglet.spec.verify import VerifyResult, verify_greedy, verify_greedy_ids, verify_sampling

TORCH_OPS = torch_backend().spec


def _verify_greedy_chain(tokens: torch.Tensor, target: torch.Tensor) -> VerifyResult:
    return VerifyResult(_verify_chain(tokens, target))


def _verify_greedy_tree(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor) -> VerifyResult:
    return VerifyResult(_verify_tree(tokens, parents, target))

# --------------------------------------------------------------------------- statistics helpers


def _chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: 1 - P(df/2, x/2) (regularised gamma)."""
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    # series for the lower regularised gamma; converges for every z, accurate enough here (z < 200)
    term = 1.0 / a
    total = term
    n = 1
    while term > total * 1e-16:
        term *= z / (a + n)
        total += term
        n += 1
    lower = math.exp(a * math.log(z) - z - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def _chi2_critical(df: int, alpha: float = 1e-3) -> float:
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if _chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def _chi2(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson statistic of observed ``counts`` against probabilities ``expected`` (all > 0)."""
    unexpected = set(counts) - set(expected)
    assert not unexpected, f"outcomes of zero target probability were emitted: {sorted(unexpected)[:5]}"
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected.items())
    return stat, len(expected) - 1


def _tv(counts: Counter, expected: dict, n: int) -> float:
    keys = set(counts) | set(expected)
    return 0.5 * sum(abs(counts.get(k, 0) / n - expected.get(k, 0.0)) for k in keys)


def test_chi2_helper_matches_tables() -> None:
    # chi-square critical values at p = 1e-3 from standard tables
    for df, table in [(1, 10.828), (4, 18.467), (5, 20.515), (10, 29.588), (30, 59.703)]:
        assert _chi2_critical(df) == pytest.approx(table, abs=2e-3)


# --------------------------------------------------------------------------- tree helpers


def _path_context(tokens: list[int], parents: list[int], node: int) -> tuple[int, ...]:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(reversed(path))


def _node_probs(tokens: list[int], parents: list[int], target) -> torch.Tensor:
    """[N, V] the target's next-token distribution at each node (a function of its context)."""
    return torch.stack([target(_path_context(tokens, parents, n)) for n in range(len(tokens))])


def _expected_emissions(tokens: list[int], parents: list[int], target) -> dict:
    """Exact distribution of the emitted sequence (accepted path + bonus) under lossless verification.

    The emitted sequence is target sampling truncated after the first token that leaves the tree:
    P(seq) = product of the target probabilities along it."""
    out: dict = {}

    def walk(node: int, prefix: tuple, prob: float) -> None:
        p = target(_path_context(tokens, parents, node)).double()
        kids = [j for j in range(len(tokens)) if parents[j] == node]
        for y in range(p.shape[0]):
            py = float(p[y])
            if py <= 0:
                continue
            child = next((j for j in kids if tokens[j] == y), None)  # first duplicate wins
            if child is None:
                out[prefix + (y,)] = out.get(prefix + (y,), 0.0) + prob * py
            else:
                walk(child, prefix + (y,), prob * py)

    walk(0, (), 1.0)
    return out


def _rows(result: VerifyResult, tokens: torch.Tensor) -> list[tuple[int, ...]]:
    emitted = result.emitted_tokens(tokens)
    lengths = (result.num_accepted + 1).tolist()
    return [tuple(row[:n]) for row, n in zip(emitted.tolist(), lengths)]


def _run_sampling(tokens: list[int], parents: list[int], target, n: int, seed0: int = 0):
    """Runs verify_sampling on a batch of ``n`` copies of one tree, one seeded generator per row."""
    tok = torch.tensor(tokens).expand(n, -1).contiguous()
    par = torch.tensor(parents).expand(n, -1).contiguous()
    probs = _node_probs(tokens, parents, target).expand(n, -1, -1).contiguous()
    gens = [torch.Generator().manual_seed(seed0 + i) for i in range(n)]
    result = verify_sampling(tok, par, probs, gens)
    return _rows(result, tok)


def _reference_walk(tokens, parents, probs, rng: random.Random, renormalise=True, bonus_from_residual=True):
    """Scalar reference of the tree sampler; the flags switch on deliberately WRONG variants."""
    kids = {n: [j for j in range(len(tokens)) if parents[j] == n] for n in range(len(tokens))}
    node, out = 0, []
    while True:
        p = [float(v) for v in probs[node]]
        r = list(p)
        nxt = None
        for child in kids[node]:
            x = tokens[child]
            mass = sum(r) if renormalise else 1.0
            if mass > 0 and rng.random() * mass < r[x]:
                nxt = child
                break
            r[x] = 0.0
        if nxt is None:
            w = r if bonus_from_residual else p
            out.append(rng.choices(range(len(w)), weights=w)[0])
            return tuple(out)
        out.append(tokens[nxt])
        node = nxt


# A fixed tree over V = 6: root with 3 children (token 2 twice), the first child with 2 children
# (one of zero target probability), the second with 1 child.
V = 6
TREE_TOKENS = [0, 2, 4, 2, 1, 5, 3]
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2]
_FIXED = {
    (0,): [0.30, 0.00, 0.25, 0.10, 0.20, 0.15],  # token 1 cut (top-k-like zero)
    (0, 2): [0.10, 0.40, 0.00, 0.20, 0.30, 0.00],  # draft token 5 has probability 0
    (0, 4): [0.20, 0.10, 0.10, 0.35, 0.00, 0.25],
    (0, 2, 1): [0.25, 0.15, 0.20, 0.00, 0.10, 0.30],
    (0, 2, 5): [0.50, 0.50, 0.00, 0.00, 0.00, 0.00],
    (0, 4, 3): [0.05, 0.30, 0.20, 0.15, 0.10, 0.20],
}


def _fixed_target(context: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(_FIXED[context], dtype=torch.float32)


N_DRAWS = 40_000


@pytest.fixture(scope="module")
def fixed_tree_draws() -> list[tuple[int, ...]]:
    return _run_sampling(TREE_TOKENS, TREE_PARENTS, _fixed_target, N_DRAWS)


# --------------------------------------------------------------------------- greedy


def _onehot_logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), vocab) * 0.1
    for n, t in enumerate(argmaxes):
        logits[n, t] = 5.0
    return logits


GREEDY_CASES = [
    # name, tokens, parents, argmax at each node, expected accepted nodes, expected bonus
    ("chain_full", [7, 1, 2, 3], [-1, 0, 1, 2], [1, 2, 3, 6], [1, 2, 3], 6),
    ("chain_partial", [7, 1, 2, 3], [-1, 0, 1, 2], [1, 5, 3, 6], [1], 5),
    ("no_match", [7, 1, 2, 3], [-1, 0, 0, 1], [4, 0, 0, 0], [], 4),
    ("second_sibling_right", [7, 5, 3, 4, 2], [-1, 0, 0, 2, 1], [3, 2, 4, 6, 0], [2, 3], 6),
    ("branch_deeper_under_second", [0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 4], [2, 3, 4, 0, 5, 1], [2, 4, 5], 1),
    ("duplicate_sibling_deeper", [0, 3, 3, 4], [-1, 0, 0, 2], [3, 4, 4, 6], [2, 3], 6),
    ("root_only", [5], [-1], [2], [], 2),
]


@pytest.mark.parametrize("name,tokens,parents,argmaxes,path,bonus", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_hand_built(name, tokens, parents, argmaxes, path, bonus, backend: Backend) -> None:
    res = verify_greedy(torch.tensor([tokens]), torch.tensor([parents]), _onehot_logits(argmaxes)[None], backend.spec)
    depth = build_tree_index(torch.tensor([parents])).max_depth
    assert res.accepted_nodes.shape == (1, depth)
    assert res.accepted_nodes[0].tolist() == path + [-1] * (depth - len(path))
    assert res.num_accepted.tolist() == [len(path)]
    assert res.bonus_tokens.tolist() == [bonus]
    assert res.emitted_tokens(torch.tensor([tokens]))[0, : len(path) + 1].tolist() == [tokens[j] for j in path] + [bonus]


def test_greedy_argmax_ties_take_first_index(backend: Backend) -> None:
    logits = torch.zeros(1, 3, 6)
    logits[0, 0, [1, 4]] = 3.0  # tie: argmax is 1
    logits[0, 1, 2] = 1.0
    logits[0, 2, 5] = 1.0
    res = verify_greedy(torch.tensor([[0, 4, 1]]), torch.tensor([[-1, 0, 0]]), logits, backend.spec)
    assert res.accepted_nodes.tolist() == [[2]] and res.bonus_tokens.tolist() == [5]


def _pad(rows: list[list[int]], fill: int) -> torch.Tensor:
    n = max(len(r) for r in rows)
    return torch.tensor([r + [fill] * (n - len(r)) for r in rows])


def test_greedy_batch_equals_alone(backend: Backend) -> None:
    torch.manual_seed(1)
    cases = [c for c in GREEDY_CASES]
    n = max(len(c[1]) for c in cases)
    tokens = _pad([c[1] for c in cases], 0)
    parents = _pad([c[2] for c in cases], -1)  # padding nodes: parent -1
    logits = torch.randn(len(cases), n, 8)
    for b, c in enumerate(cases):
        logits[b, : len(c[3])] = _onehot_logits(c[3])
    batched = verify_greedy(tokens, parents, logits, backend.spec)
    for b, (_, tok, par, _, path, bonus) in enumerate(cases):
        alone = verify_greedy(torch.tensor([tok]), torch.tensor([par]), logits[b : b + 1, : len(tok)], backend.spec)
        k = int(alone.num_accepted)
        assert int(batched.num_accepted[b]) == k == len(path)
        assert batched.accepted_nodes[b, :k].tolist() == alone.accepted_nodes[0, :k].tolist() == path
        assert (batched.accepted_nodes[b, k:] == -1).all()
        assert int(batched.bonus_tokens[b]) == int(alone.bonus_tokens[0]) == bonus
    # permuting the batch permutes the results
    perm = torch.randperm(len(cases))
    permuted = verify_greedy(tokens[perm], parents[perm], logits[perm], backend.spec)
    assert torch.equal(permuted.bonus_tokens, batched.bonus_tokens[perm])
    assert torch.equal(permuted.accepted_nodes, batched.accepted_nodes[perm])


def _random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(j) for j in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return tokens, parents


def test_greedy_equals_autoregressive_greedy_on_random_trees(backend: Backend) -> None:
    vocab = 4

    def target_logits(context: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(context) % (2**31))
        return torch.randn(vocab, generator=g)

    rng = random.Random(0)
    trees = [_random_tree(rng, rng.randrange(1, 12), vocab) for _ in range(200)]
    tokens = _pad([t for t, _ in trees], 0)
    parents = _pad([p for _, p in trees], -1)
    logits = torch.zeros(len(trees), tokens.shape[1], vocab)
    for b, (tok, par) in enumerate(trees):
        logits[b, : len(tok)] = _node_probs(tok, par, target_logits)
    res = verify_greedy(tokens, parents, logits, backend.spec)
    emitted = _rows(res, tokens)
    total_accepted = 0
    for b, (tok, par) in enumerate(trees):
        context = (tok[0],)
        for _ in range(len(emitted[b])):
            context += (int(target_logits(context).argmax()),)
        assert emitted[b] == context[1:], b  # exactly what plain greedy decoding emits
        # and it is the LONGEST accepted path: no node of the tree extends it
        depth = len(emitted[b]) - 1
        total_accepted += depth
        for j in range(len(tok)):
            ctx = _path_context(tok, par, j)
            assert not (len(ctx) - 1 > depth and ctx[1:] == context[1 : len(ctx)])
    assert total_accepted > 50  # the trees do get accepted paths


# --------------------------------------------------------------------------- sampling: lossless


def test_sampling_lossless_full_emission(fixed_tree_draws) -> None:
    expected = _expected_emissions(TREE_TOKENS, TREE_PARENTS, _fixed_target)
    assert sum(expected.values()) == pytest.approx(1.0)
    counts = Counter(fixed_tree_draws)
    stat, df = _chi2(counts, expected, N_DRAWS)
    print(f"full emission: chi2={stat:.2f} df={df} critical={_chi2_critical(df):.2f} tv={_tv(counts, expected, N_DRAWS):.4f}")
    assert stat < _chi2_critical(df)
    assert _tv(counts, expected, N_DRAWS) < 0.02


def test_sampling_first_token_marginal(fixed_tree_draws) -> None:
    p_root = _FIXED[(0,)]
    expected = {x: p for x, p in enumerate(p_root) if p > 0}
    counts = Counter(row[0] for row in fixed_tree_draws)
    stat, df = _chi2(counts, expected, N_DRAWS)
    print(f"first token: chi2={stat:.2f} df={df} critical={_chi2_critical(df):.2f}")
    assert stat < _chi2_critical(df)
    assert _tv(counts, expected, N_DRAWS) < 0.01


@pytest.mark.parametrize("first", [2, 4])
def test_sampling_second_token_given_accepted_first(fixed_tree_draws, first) -> None:
    # tokens 2 and 4 are root children: once emitted they were accepted (a rejected one is removed
    # from the residual), so a second token always follows, from the target after (0, first).
    rows = [row for row in fixed_tree_draws if row[0] == first]
    assert all(len(r) >= 2 for r in rows)
    expected = {x: p for x, p in enumerate(_FIXED[(0, first)]) if p > 0}
    counts = Counter(r[1] for r in rows)
    stat, df = _chi2(counts, expected, len(rows))
    print(f"second | first={first}: chi2={stat:.2f} df={df} critical={_chi2_critical(df):.2f} n={len(rows)}")
    assert stat < _chi2_critical(df)


@pytest.mark.parametrize(
    "renormalise,bonus_from_residual", [(True, True), (False, True), (True, False)], ids=["reference", "no_renorm", "bonus_from_p"]
)
def test_chi2_separates_right_and_wrong_rules(renormalise, bonus_from_residual) -> None:
    """The scalar reference passes the same test; each deliberately wrong rule fails it."""
    probs = _node_probs(TREE_TOKENS, TREE_PARENTS, _fixed_target).tolist()
    rng = random.Random(0)
    draws = [
        _reference_walk(TREE_TOKENS, TREE_PARENTS, probs, rng, renormalise, bonus_from_residual) for _ in range(N_DRAWS)
    ]
    expected = _expected_emissions(TREE_TOKENS, TREE_PARENTS, _fixed_target)
    counts = Counter(draws)
    unexpected = set(counts) - set(expected)  # e.g. a rejected token re-emitted as the bonus
    stat, df = _chi2(counts, expected, N_DRAWS) if not unexpected else (math.inf, len(expected) - 1)
    critical = _chi2_critical(df)
    tv = _tv(counts, expected, N_DRAWS)
    first_expected = {x: p for x, p in enumerate(_FIXED[(0,)]) if p > 0}
    first_stat, first_df = _chi2(Counter(d[0] for d in draws), first_expected, N_DRAWS)
    first_critical = _chi2_critical(first_df)
    print(
        f"renorm={renormalise} bonus_from_residual={bonus_from_residual}: full chi2={stat:.2f} (crit {critical:.2f}, "
        f"{sum(counts[k] for k in unexpected)} impossible) tv={tv:.4f}; first-token chi2={first_stat:.2f} (crit {first_critical:.2f})"
    )
    if renormalise and bonus_from_residual:
        assert stat < critical and first_stat < first_critical and tv < 0.02
    else:
        assert stat > critical and first_stat > first_critical and tv > 0.02


def _shaped_target(vocab: int, params: SamplingParams):
    def target(context: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(context) % (2**31))
        logits = torch.randn(1, vocab, generator=g) * 2.0
        return shaped_probs(logits, [params])[0]

    return target


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=1.3, top_p=0.8)],
    ids=["temp_topk", "temp_topp"],
)
def test_sampling_lossless_shaped_random_tree(params) -> None:
    vocab = 8
    target = _shaped_target(vocab, params)
    # a tree that follows the target's likely tokens (so deep paths get accepted), plus a duplicate
    # sibling and a token outside the top-k / top-p support
    tokens, parents = [3], [-1]

    def add(parent: int, rank: int) -> int:
        p = target(_path_context(tokens, parents, parent))
        tokens.append(int(p.argsort(descending=True)[rank]))
        parents.append(parent)
        return len(tokens) - 1

    a, b = add(0, 0), add(0, 1)
    add(0, 0)  # duplicate of a
    add(0, vocab - 1)  # least likely token: zero probability after top-k / top-p
    aa = add(a, 0)
    add(a, 1)
    add(b, 0)
    add(aa, 0)
    add(aa, 2)
    n = 20_000
    draws = _run_sampling(tokens, parents, target, n, seed0=10_000)
    expected = _expected_emissions(tokens, parents, target)
    # pool categories with small expected counts so the chi-square approximation holds
    small = {k for k, p in expected.items() if p * n < 5}
    pooled_expected = {k: p for k, p in expected.items() if k not in small}
    pooled_counts = Counter()
    for row in draws:
        pooled_counts["rest" if row in small else row] += 1
    if small:
        pooled_expected["rest"] = sum(expected[k] for k in small)
    assert not set(Counter(draws)) - set(expected)
    stat, df = _chi2(pooled_counts, pooled_expected, n)
    print(f"{params}: chi2={stat:.2f} df={df} critical={_chi2_critical(df):.2f}")
    assert stat < _chi2_critical(df)
    assert max(len(r) for r in draws) >= 3  # the test exercises accepted paths


# --------------------------------------------------------------------------- sampling: edge cases


def test_duplicate_and_covering_siblings_no_nan() -> None:
    # root's support is {1, 2}; its children are 1, 1 (duplicate), 2: they cover the support
    tokens = torch.tensor([[0, 1, 1, 2]]).expand(4000, -1).contiguous()
    parents = torch.tensor([[-1, 0, 0, 0]]).expand(4000, -1).contiguous()
    probs = torch.zeros(4000, 4, 5)
    probs[:, 0, 1], probs[:, 0, 2] = 0.5, 0.5
    probs[:, 1:, 3] = 1.0
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    res = verify_sampling(tokens, parents, probs, gens)
    first = res.emitted_tokens(tokens)[:, 0]
    # the duplicate (node 2) is never accepted; when token 1 is rejected, token 2 must be accepted
    assert set(res.accepted_nodes[:, 0].tolist()) == {1, 3}
    assert (res.num_accepted == 1).all() and (res.bonus_tokens == 3).all()
    assert abs((first == 1).float().mean().item() - 0.5) < 0.05


def test_degenerate_zero_distribution_is_guarded() -> None:
    tokens = torch.tensor([[0, 1, 2]])
    parents = torch.tensor([[-1, 0, 0]])
    probs = torch.zeros(1, 3, 4)  # no mass anywhere: never accept, bonus is still a valid token
    res = verify_sampling(tokens, parents, probs, [torch.Generator().manual_seed(0)])
    assert res.num_accepted.tolist() == [0]
    assert 0 <= int(res.bonus_tokens) < 4


def test_zero_probability_draft_never_accepted() -> None:
    n = 2000
    tokens = torch.tensor([[0, 3, 1]]).expand(n, -1).contiguous()
    parents = torch.tensor([[-1, 0, 0]]).expand(n, -1).contiguous()
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).expand(n, 3, -1).contiguous()
    res = verify_sampling(tokens, parents, probs, [torch.Generator().manual_seed(i) for i in range(n)])
    assert not (res.accepted_nodes == 1).any()
    assert set(res.emitted_tokens(tokens)[:, 0].tolist()) <= {0, 1}


# --------------------------------------------------------------------------- reproducibility


def _mixed_batch():
    rng = random.Random(3)
    trees = [(TREE_TOKENS, TREE_PARENTS)] + [_random_tree(rng, rng.randrange(1, 9), V) for _ in range(7)]
    target = _shaped_target(V, SamplingParams(temperature=1.0, top_k=4))
    tokens = _pad([t for t, _ in trees], 0)
    parents = _pad([p for _, p in trees], -1)
    probs = torch.rand(len(trees), tokens.shape[1], V)  # padding rows: junk, never read
    for b, (t, p) in enumerate(trees):
        probs[b, : len(t)] = _node_probs(t, p, target)
    return trees, tokens, parents, probs


def test_sampling_reproducible_and_batch_invariant() -> None:
    trees, tokens, parents, probs = _mixed_batch()
    seeds = [11 * b + 5 for b in range(len(trees))]

    def run(rows: list[int]) -> VerifyResult:
        return verify_sampling(tokens[rows], parents[rows], probs[rows], [torch.Generator().manual_seed(seeds[b]) for b in rows])

    everything = list(range(len(trees)))
    a, b = run(everything), run(everything)
    assert torch.equal(a.accepted_nodes, b.accepted_nodes) and torch.equal(a.bonus_tokens, b.bonus_tokens)
    assert torch.equal(a.num_accepted, b.num_accepted)
    emitted = _rows(a, tokens)
    for i, (tok, par) in enumerate(trees):
        n = len(tok)
        alone = verify_sampling(
            torch.tensor([tok]), torch.tensor([par]), probs[i : i + 1, :n], [torch.Generator().manual_seed(seeds[i])]
        )
        assert _rows(alone, torch.tensor([tok]))[0] == emitted[i]
        k = int(alone.num_accepted)
        assert alone.accepted_nodes[0, :k].tolist() == a.accepted_nodes[i, :k].tolist()
    perm = [5, 2, 7, 0, 1, 6, 3, 4]
    c = run(perm)
    assert _rows(c, tokens[perm]) == [emitted[i] for i in perm]


def test_sampling_seed_changes_outcome_and_global_rng_reproducible() -> None:
    tok = torch.tensor([TREE_TOKENS]).expand(64, -1).contiguous()
    par = torch.tensor([TREE_PARENTS]).expand(64, -1).contiguous()
    probs = _node_probs(TREE_TOKENS, TREE_PARENTS, _fixed_target).expand(64, -1, -1).contiguous()
    r1 = _rows(verify_sampling(tok, par, probs, [torch.Generator().manual_seed(i) for i in range(64)]), tok)
    r2 = _rows(verify_sampling(tok, par, probs, [torch.Generator().manual_seed(i + 64) for i in range(64)]), tok)
    assert r1 != r2
    torch.manual_seed(99)
    g1 = _rows(verify_sampling(tok, par, probs, [None] * 64), tok)
    torch.manual_seed(99)
    g2 = _rows(verify_sampling(tok, par, probs, [None] * 64), tok)
    assert g1 == g2


def test_input_validation() -> None:
    with pytest.raises(ValueError):
        build_tree_index(torch.tensor([[0, 0]]))  # root must have parent -1
    with pytest.raises(ValueError):
        build_tree_index(torch.tensor([[-1, 2, 0]]))  # parent after child
    with pytest.raises(ValueError):
        verify_sampling(torch.tensor([[0, 1]]), torch.tensor([[-1, 0]]), torch.rand(1, 2, 4), [])


@pytest.mark.parametrize("num_nodes", [1, 2, 4, 6])
def test_chain_fast_path_equals_the_tree_walk(num_nodes):
    """verify_greedy recognises a chain and skips the tree walk; both give the same result."""
    g = torch.Generator().manual_seed(num_nodes)
    for _ in range(50):
        batch = int(torch.randint(1, 6, (1,), generator=g))
        target = torch.randint(0, 3, (batch, num_nodes), generator=g)  # 3 values: many matches
        tokens = torch.randint(0, 3, (batch, num_nodes), generator=g)
        parents = (torch.arange(num_nodes) - 1).expand(batch, num_nodes)
        fast, walked = _verify_greedy_chain(tokens, target), _verify_greedy_tree(tokens, parents, target)
        assert torch.equal(fast.accepted_nodes, walked.accepted_nodes)
        assert torch.equal(fast.num_accepted, walked.num_accepted)
        assert torch.equal(fast.bonus_tokens, walked.bonus_tokens)


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="eaglet CPU kernels unavailable")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_nodes", [1, 2, 5])
def test_chain_verify_kernel_equals_the_python_walk(num_nodes, dtype):
    """The tree kernel on chains (argmax up to the first rejection, then the run) against argmax +
    the list walk, on logits with ties and NaNs, and on non-contiguous logits."""
    g = torch.Generator().manual_seed(num_nodes)
    for trial in range(40):
        batch, vocab = int(torch.randint(1, 7, (1,), generator=g)), [3, 17, 300][trial % 3]
        logits = torch.randint(0, 3, (batch, num_nodes, vocab), generator=g).to(dtype)  # many ties
        if trial % 5 == 0:
            logits[0, -1, vocab // 2] = float("nan")
        picks = logits.float().argmax(-1)
        # Draft tokens that mostly agree with the target, so runs of every length occur.
        tokens = torch.randint(0, vocab, (batch, num_nodes), generator=g)
        agree = torch.rand(batch, num_nodes, generator=g) < 0.7
        tokens[:, 1:] = torch.where(agree[:, 1:], picks[:, :-1], tokens[:, 1:])
        wide = torch.zeros(batch, num_nodes, 2 * vocab, dtype=dtype)
        wide[..., :vocab] = logits
        parents = (torch.arange(num_nodes) - 1).expand(batch, num_nodes)
        for view in (logits, wide[..., :vocab]):
            got = verify_greedy(tokens, parents, view, cpu_backend().spec)
            expected = _verify_greedy_chain(tokens, picks)
            for field in ("accepted_nodes", "num_accepted", "bonus_tokens"):
                assert torch.equal(getattr(got, field), getattr(expected, field)), field
    chain = torch.tensor([[-1, 0, 1]])
    with pytest.raises(RuntimeError, match="matching the tokens"):
        verify_greedy(torch.zeros(1, 3, dtype=torch.long), chain, torch.zeros(1, 3, 0), cpu_backend().spec)
    with pytest.raises(RuntimeError, match="int64 tokens"):
        torch.ops.eaglet.verify_tree_greedy(torch.zeros(1, 3, dtype=torch.int32), chain, torch.zeros(1, 3, 4))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        torch.ops.eaglet.verify_tree_greedy(torch.zeros(1, 3, dtype=torch.long), chain, torch.zeros(1, 3, 4, dtype=torch.float64))


def test_verify_from_greedy_ids_equals_verify_from_logits(backend: Backend):
    """A forward that returns only the target's greedy ids (the fused lm_head + argmax) verifies
    exactly as its logits do, on random trees, chains and padded trees; malformed trees are refused."""
    g = torch.Generator().manual_seed(3)
    for trial in range(80):
        batch, n, vocab = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g)), 4
        parents = torch.full((batch, n), -1, dtype=torch.long)
        for j in range(1, n):
            parents[:, j] = torch.randint(0, j, (batch,), generator=g)
        if trial % 3 == 0:
            parents = (torch.arange(n) - 1).expand(batch, n).clone()
        elif trial % 3 == 1 and n > 2:
            parents[0, -1] = -1  # padding
        logits = torch.randn(batch, n, vocab, generator=g)
        tokens = torch.randint(0, vocab, (batch, n), generator=g)  # 4 ids: many accepted paths
        from_logits = verify_greedy(tokens, parents, logits, backend.spec)
        from_ids = verify_greedy_ids(tokens, parents, logits.argmax(-1), backend.spec)
        assert torch.equal(from_ids.table, from_logits.table)
    error = RuntimeError if backend.kernels else ValueError
    with pytest.raises(error):
        verify_greedy_ids(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 2, 0]]), torch.zeros(1, 3, dtype=torch.long), backend.spec)
    with pytest.raises(error):
        verify_greedy_ids(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 0, 1]]), torch.zeros(1, 2, dtype=torch.long), backend.spec)


@needs_kernels
def test_commit_table_kernel_equals_the_python_table():
    """Per path entry (the root, then the accepted nodes) of every request: source and destination
    slots, position, feature row and the draft extend's id, from random trees' verification."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        batch, n = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        parents = torch.full((batch, n), -1, dtype=torch.long)
        for j in range(1, n):
            parents[:, j] = torch.randint(0, j, (batch,), generator=g)
        if trial % 2:  # chains
            parents = (torch.arange(n) - 1).expand(batch, n).clone()
        tokens = torch.randint(0, 4, (batch, n), generator=g)
        logits = torch.randn(batch, n, 4, generator=g)
        logits.scatter_(2, tokens.roll(-1, 1)[:, :, None], 5.0)  # the target mostly agrees
        result = verify_greedy(tokens, parents, logits, TORCH_OPS)
        scratch = n + int(torch.randint(0, 3, (1,), generator=g))
        slots = torch.randperm(1000, generator=g)[: batch * scratch].view(batch, scratch)
        prefix = torch.randint(0, 50, (batch,), generator=g)
        kernel = result.commit_table(tokens, slots, prefix, cpu_backend().spec)
        python = result.commit_table(tokens, slots, prefix, TORCH_OPS)
        for name in ("entries", "per_request", "entry_starts"):
            assert torch.equal(getattr(kernel, name), getattr(python, name)), name
        # The hand-written meaning of each row, request by request.
        columns = kernel.entries.t().tolist()
        first = 0
        for b in range(batch):
            a = int(result.num_accepted[b])
            path = [0] + result.accepted_nodes[b, :a].tolist()
            mine, columns = columns[: a + 1], columns[a + 1 :]
            next_ids = [int(tokens[b, j]) for j in path[1:]] + [int(result.bonus_tokens[b])]
            assert mine == [[int(slots[b, j]), int(slots[b, i]), int(prefix[b]) + i, b * n + j, next_ids[i]] for i, j in enumerate(path)]
            assert kernel.per_request[:, b].tolist() == [a + 1, int(prefix[b]) + a + 1, first + a]
            assert int(kernel.entry_starts[b]) == first
            first += a + 1
        assert columns == [] and int(kernel.entry_starts[batch]) == first
    bad = VerifyResult.of(torch.tensor([[7]]), torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="accepted node 7 outside"):
        bad.commit_table(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                         cpu_backend().spec)


def test_merging_sampled_rows_pads_their_shallower_paths():
    greedy = VerifyResult.of(torch.tensor([[1, 2, 3], [1, -1, -1], [2, 4, -1]]), torch.tensor([3, 1, 2]), torch.tensor([7, 8, 9]))
    sampled = VerifyResult.of(torch.tensor([[2], [-1]]), torch.tensor([1, 0]), torch.tensor([5, 6]))
    merged = greedy.with_rows(torch.tensor([0, 2]), sampled)
    assert merged.table.tolist() == [[1, 5, 2, -1, -1], [1, 8, 1, -1, -1], [0, 6, -1, -1, -1]]
    assert greedy.num_accepted.tolist() == [3, 1, 2]  # unchanged


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verify_kernel_equals_the_python_walk(dtype):
    """Random trees with padding nodes, duplicate sibling tokens (equally deep paths) and ties in
    the logits: the kernel against argmax + the list walk; and the trees it rejects."""
    g = torch.Generator().manual_seed(1)
    for trial in range(300):
        batch, n, vocab = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)), 3
        parents = torch.full((batch, n), -1, dtype=torch.long)
        for b in range(batch):
            valid = [0]
            for j in range(1, n):
                if torch.rand(1, generator=g) < 0.8:  # else padding
                    parents[b, j] = valid[int(torch.randint(0, len(valid), (1,), generator=g))]
                    valid.append(j)
        tokens = torch.randint(0, vocab, (batch, n), generator=g)
        logits = torch.randint(0, 2, (batch, n, vocab), generator=g).to(dtype)
        got = verify_greedy(tokens, parents, logits, cpu_backend().spec)
        expected = _verify_greedy_tree(tokens, parents, logits.float().argmax(-1))
        assert torch.equal(got.table, expected.table), (tokens, parents)
    for bad, message in (([[0, 0]], "root"), ([[-1, 2, 0]], "earlier node"), ([[-1, -1, 1]], "padding node")):
        bad_parents = torch.tensor(bad)
        with pytest.raises(RuntimeError, match=message):
            verify_greedy(torch.zeros_like(bad_parents), bad_parents, torch.zeros(1, bad_parents.shape[1], 4), cpu_backend().spec)
        with pytest.raises(ValueError):
            build_tree_index(bad_parents)
