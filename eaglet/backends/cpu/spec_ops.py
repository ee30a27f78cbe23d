"""A speculative round's tree selection, verification and commit in eaglet's C++ kernels
(``SpecOps``): each one call instead of a list walk and its host copies. Greedy verification
reduces only the logits of nodes on matching paths (a chain's up to its first rejection)."""

from __future__ import annotations

import torch

from eaglet.backends.pytorch.spec_ops import TorchSpecOps


def _long(t: torch.Tensor) -> torch.Tensor:
    """``t.long()`` without the op call where it is int64 already (a round's inputs are)."""
    return t if t.dtype == torch.long else t.long()


class CpuSpecOps:
    def __init__(self, fallback: TorchSpecOps) -> None:
        self.fallback = fallback

    def select_draft_tree(
        self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
        root_tokens: torch.Tensor, num_nodes: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if scores.dtype != torch.float32:
            return self.fallback.select_draft_tree(tokens, scores, parents, depths, root_tokens, num_nodes)
        tokens_out, parents_out, depths_out = torch.ops.eaglet.select_draft_tree(tokens, scores, parents, depths, root_tokens, num_nodes)
        return tokens_out, parents_out, depths_out

    def tree_attention_mask(self, parents: torch.Tensor, prefix_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
        return torch.ops.eaglet.tree_attention_mask(parents, prefix_lens, num_keys)

    def verify_tree_greedy(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype not in (torch.float32, torch.bfloat16) or logits.device.type != "cpu":
            return self.fallback.verify_tree_greedy(tokens, parents, logits)
        return torch.ops.eaglet.verify_tree_greedy(_long(tokens), _long(parents), logits)

    def verify_tree_greedy_ids(self, tokens: torch.Tensor, parents: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        if target_ids.device.type != "cpu":
            return self.fallback.verify_tree_greedy_ids(tokens, parents, target_ids)
        return torch.ops.eaglet.verify_tree_greedy_ids(_long(tokens), _long(parents), _long(target_ids))

    def commit_table(
        self, table: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if tokens.device.type != "cpu":
            return self.fallback.commit_table(table, tokens, slots, prefix)
        entries, per_request, entry_starts = torch.ops.eaglet.commit_table(table, _long(tokens), slots, prefix)
        return entries, per_request, entry_starts
