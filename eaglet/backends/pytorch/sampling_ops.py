"""Vocabulary-wide reductions of logits in PyTorch ops (``SamplingOps``)."""

from __future__ import annotations

import torch

# Vocabulary-wide reductions read the logits in blocks of this many columns: a max per block first
# (one vectorised pass), then only the winning blocks. CPU torch's max(dim) / topk over a whole row
# are 2x (max) to 2-3x (topk) slower than that for the [rows, 32000+] logits of a verify or draft step.
VOCAB_BLOCK = 128
# Below this vocabulary the blocked reductions cost more ops than they save (measured: 1024 entries
# 3x slower than argmax / log_softmax + topk, 8192 on par, 32000 2x faster).
BLOCKED_MIN_VOCAB = 8192


class TorchSamplingOps:
    def argmax(self, logits: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        # The first block holding the row maximum, then the first maximum inside it, is argmax's
        # answer; max(dim) keeps the first maximal index as argmax does (tests/test_sampling.py
        # checks ties and NaNs against argmax).
        vocab = logits.shape[-1]
        if vocab % VOCAB_BLOCK or vocab < BLOCKED_MIN_VOCAB or not logits.is_contiguous():
            ids = logits.max(dim=-1).indices
        else:
            blocks = logits.view(*logits.shape[:-1], vocab // VOCAB_BLOCK, VOCAB_BLOCK)
            best_block = blocks.amax(dim=-1).max(dim=-1, keepdim=True).indices  # [..., 1]
            inside = blocks.gather(-2, best_block[..., None].expand(*best_block.shape, VOCAB_BLOCK)).squeeze(-2)
            ids = best_block.squeeze(-1) * VOCAB_BLOCK + inside.max(dim=-1).indices
        return ids if offsets is None else ids + offsets[ids]

    def topk_logprobs(
        self, logits: torch.Tensor, k: int, offsets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The top k entries of a row lie in the k blocks with the largest block maxima, so topk runs
        # over those k blocks only. (log_softmax normalises: torch's logsumexp runs an exp that is
        # 40x slower on arguments below -87, which a confident draft's logits reach.)
        logprobs = logits.log_softmax(dim=-1)
        rows, vocab = logprobs.shape
        if vocab % VOCAB_BLOCK or vocab < max(BLOCKED_MIN_VOCAB, 4 * VOCAB_BLOCK * k):
            top = logprobs.topk(k, dim=-1)
            values, ids = top.values, top.indices
        else:
            blocks = logprobs.view(rows, vocab // VOCAB_BLOCK, VOCAB_BLOCK)
            top_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [R, k]
            candidates = blocks.gather(1, top_blocks[:, :, None].expand(rows, k, VOCAB_BLOCK)).view(rows, k * VOCAB_BLOCK)
            top = candidates.topk(k, dim=-1)
            values = top.values
            ids = top_blocks.gather(1, top.indices // VOCAB_BLOCK) * VOCAB_BLOCK + top.indices % VOCAB_BLOCK
        return values, ids if offsets is None else ids + offsets[ids]
