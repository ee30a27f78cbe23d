"""Turns the logits of a batch into next tokens: greedy, or temperature / top-k / top-p sampling.

Each sampling request draws from its own torch.Generator, so its tokens depend on its seed only,
never on which other requests share the batch.
"""

from __future__ import annotations

import torch

from eaglet.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B]."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows, dtype=torch.long)
    probs = shaped_probs(logits[rows], [params[i] for i in sampled_rows])
    for j, i in enumerate(sampled_rows):
        tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i]).squeeze(0)
    return tokens


def shaped_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Applies temperature, top-k and top-p per row; returns probabilities [B, V]."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k])[:, None].clamp(max=vocab)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)[:, None]
    if (top_p < 1).any():
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
