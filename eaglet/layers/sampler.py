"""Turns the logits of a batch into next tokens: greedy, or temperature / min-p / top-k / top-p sampling.

The caller runs ``eaglet.layers.logits_processor.process_logits`` first (min_tokens, logit_bias,
repetition / frequency / presence penalties), so greedy rows take the argmax of the PROCESSED
logits, and sampled rows shape the processed logits with ``shaped_probs``. Speculative verification
uses the same two functions on the verify logits, so both paths draw from the same distribution.

Each sampling request draws from its own torch.Generator, so its tokens depend on its seed only,
never on which other requests share the batch.
"""

from __future__ import annotations

import torch

from eaglet.backends.base import SamplingOps
from eaglet.sampling_params import SamplingParams

__all__ = ["sample", "shaped_probs"]


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None], ops: SamplingOps
) -> torch.Tensor:
    """logits [B, V] float32 (already processed) -> token ids [B].

    Greedy rows (temperature 0 or top_k 1): ``ops.argmax``, first index on ties. Other rows: one
    ``torch.multinomial`` draw from ``shaped_probs`` with the row's own generator (None: the global RNG).
    """
    tokens = ops.argmax(logits)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
    probs = shaped_probs(logits[rows], [params[i] for i in sampled_rows])
    for j, i in enumerate(sampled_rows):  # the only per-row loop: each request's own RNG
        tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i]).squeeze(0)
    return tokens


def shaped_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Per-row sampling distribution [B, V] from (processed) logits [B, V].

    Order, as vLLM v1 (``vllm/v1/sample/sampler.py``, ``Sampler.sample``: apply_temperature, then the
    argmax-invariant logits processors = ``MinPLogitsProcessor``, then ``apply_top_k_top_p``):

    1. temperature: ``logits / T`` (a row with T == 0 gets a one-hot at its argmax);
    2. min-p: drop tokens whose probability (softmax after temperature) is < min_p * max prob;
    3. top-k: keep tokens whose logit is >= the k-th largest (ties at the k-th value are kept);
    4. top-p: over the distribution left by 1-3, keep the smallest descending-probability prefix
       whose mass reaches top_p (a token is kept if the mass strictly before it is < top_p);
    renormalised. Min-p commutes with top-k (the max token survives top-k and ratios to it are
    unchanged) but not with top-p: top-p here sees the min-p-truncated, renormalised distribution.
    """
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0.0]
    temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype)
    logits = logits / temperature.to(logits.device)[:, None]

    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)[:, None]
    if (min_p > 0).any():
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)[:, None].clamp(max=vocab)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)

    # Only rows with top_p < 1: a cumsum that rounds up to 1.0 must not cut a top_p == 1 row's tail,
    # and a row's result must not depend on whether other rows use top-p (batch invariance).
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1]
    if top_p_rows:
        rows = torch.tensor(top_p_rows, dtype=torch.long, device=probs.device)
        top_p = torch.tensor([params[i].top_p for i in top_p_rows], dtype=probs.dtype, device=probs.device)[:, None]
        sorted_probs, order = probs[rows].sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        kept = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
        probs[rows] = kept / kept.sum(-1, keepdim=True)

    if greedy_rows:
        rows = torch.tensor(greedy_rows, dtype=torch.long, device=probs.device)
        one_hot = torch.zeros(len(greedy_rows), probs.shape[-1], dtype=probs.dtype, device=probs.device)
        one_hot.scatter_(1, logits[rows].argmax(dim=-1, keepdim=True), 1.0)
        probs[rows] = one_hot
    return probs

