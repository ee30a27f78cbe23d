"""Draft tree selection and the verify tree mask: the CPU backend's kernels (``select_draft_tree``,
``tree_attention_mask``) against the PyTorch backend's, on random recorded candidate sets with
equal scores, and their messages for malformed input."""

from __future__ import annotations

import pytest
import torch

from eaglet import kernels
from eaglet.backends import Backend, cpu_backend, torch_backend
from eaglet.spec.tree import CandidateRecorder, DraftTree, tree_attention_mask

pytestmark = pytest.mark.skipif(not kernels.available(), reason="eaglet CPU kernels unavailable")


def _record_round(g: torch.Generator, batch: int, k: int, steps: int) -> CandidateRecorder:
    """Candidates as EagleWorker._draft_tree records them: k at depth 1 under the root, then k * k
    per step, children of that step's frontier (k earlier candidates per request). Log-probabilities
    are multiples of 1/4, so equal scores are common."""
    recorder = CandidateRecorder()

    def logprobs(*shape: int) -> torch.Tensor:
        return -torch.randint(0, 6, shape, generator=g).float() / 4

    scores = logprobs(batch, k)
    ids = recorder.add(torch.randint(0, 500, (batch, k), generator=g), scores, torch.full((batch, k), -1), depth=1)
    frontier_ids, frontier_scores = ids.expand(batch, k), scores
    for step in range(1, steps):
        child_scores = (frontier_scores[:, :, None] + logprobs(batch, k, k)).view(batch, k * k)
        parents = frontier_ids[:, :, None].expand(-1, -1, k).reshape(batch, k * k)
        child_ids = recorder.add(torch.randint(0, 500, (batch, k * k), generator=g), child_scores, parents, depth=step + 1)
        best = child_scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        frontier_ids, frontier_scores = child_ids[best], child_scores.gather(1, best)
    return recorder


@pytest.mark.parametrize("k,steps", [(1, 4), (2, 4), (3, 3), (4, 5)])
def test_tree_selection_kernel_matches_the_pytorch_path(k, steps):
    kernel_ops, torch_ops = cpu_backend().spec, torch_backend().spec
    g = torch.Generator().manual_seed(100 * k + steps)
    num_candidates = k + (steps - 1) * k * k
    for trial in range(40):
        batch = 1 + trial % 7
        recorder = _record_round(g, batch, k, steps)
        roots = torch.randint(0, 500, (batch,), generator=g)
        num_nodes = 2 + trial % num_candidates
        fast = recorder.build_tree(roots, num_nodes, kernel_ops)
        slow = recorder.build_tree(roots, num_nodes, torch_ops)
        slow_mask = tree_attention_mask(slow, torch.arange(batch) * 3 + 1, 3 * batch + num_nodes, torch_ops)
        for name in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
        assert torch.equal(tree_attention_mask(fast, torch.arange(batch) * 3 + 1, 3 * batch + num_nodes, kernel_ops), slow_mask)
        # Every kept node's parent is kept, earlier, and one level up.
        parents, depths = fast.parents, fast.depths
        assert (parents[:, 0] == -1).all() and (parents[:, 1:] < torch.arange(1, num_nodes)).all()
        assert torch.equal(depths[:, 1:], depths.gather(1, parents[:, 1:].clamp(min=0)) + 1)


def test_tree_mask_on_a_known_tree(backend: Backend):
    # root -> 1, 2; 1 -> 3; 3 -> 4
    tree = DraftTree(tokens=torch.zeros(1, 5, dtype=torch.long), parents=torch.tensor([[-1, 0, 0, 1, 3]]),
                     depths=torch.tensor([[0, 1, 1, 2, 3]]))
    mask = tree_attention_mask(tree, torch.tensor([2]), 8, backend.spec)
    expected = torch.tensor([
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 1, 0],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_tree_kernels_reject_malformed_input():
    ops = torch.ops.eaglet
    tokens, parents = torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 0, 0]])
    depths, roots = torch.tensor([1, 1, 1]), torch.zeros(1, dtype=torch.long)
    scores = torch.tensor([[0.0, -1.0, -2.0]])
    with pytest.raises(RuntimeError, match="nodes from 3 candidates"):
        ops.select_draft_tree(tokens, scores, torch.full((1, 3), -1), depths, roots, 5)
    with pytest.raises(RuntimeError, match="float32 scores"):
        ops.select_draft_tree(tokens, scores.double(), torch.full((1, 3), -1), depths, roots, 3)
    with pytest.raises(RuntimeError, match="without its parent"):  # candidate 1's parent 2 scores lower
        ops.select_draft_tree(tokens, scores, torch.tensor([[-1, 2, -1]]), depths, roots, 3)
    with pytest.raises(RuntimeError, match="earlier node"):
        ops.tree_attention_mask(torch.tensor([[-1, 2, 0]]), torch.tensor([0]), 4)
    with pytest.raises(RuntimeError, match="past 4 keys"):
        ops.tree_attention_mask(parents, torch.tensor([2]), 4)
