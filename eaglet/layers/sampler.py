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

from eaglet import kernels
from eaglet.sampling_params import SamplingParams

__all__ = ["greedy_tokens", "sample", "shaped_probs", "top_k_logprobs"]


# Vocabulary-wide reductions read the logits in blocks of this many columns: a max per block first
# (one vectorised pass), then only the winning blocks. CPU torch's max(dim) / topk over a whole row
# are 2x (max) to 2-3x (topk) slower than that for the [rows, 32000+] logits of a verify or draft step.
VOCAB_BLOCK = 128
# Below this vocabulary the blocked reductions cost more ops than they save (measured: 1024 entries
# 3x slower than argmax / log_softmax + topk, 8192 on par, 32000 2x faster).
BLOCKED_MIN_VOCAB = 8192


def _use_kernels(logits: torch.Tensor) -> bool:
    return kernels.loaded() and logits.dtype in (torch.float32, torch.bfloat16) and logits.device.type == "cpu"


def greedy_tokens(logits: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)``: the first index of each row's maximum, NaN counting as the maximum;
    with ``offsets`` (an EAGLE-3 draft's d2t), each index i shifted to i + offsets[i].

    The first block holding the row maximum, then the first maximum inside it, is argmax's answer;
    ``max(dim)`` keeps the first maximal index as argmax does (tests/test_sampling.py checks ties and
    NaNs against argmax)."""
    if _use_kernels(logits):
        return torch.ops.eaglet.argmax_last_dim(logits, offsets)  # 4-10x faster than either form below
    ids = _argmax(logits)
    return ids if offsets is None else ids + offsets[ids]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    if vocab % VOCAB_BLOCK or vocab < BLOCKED_MIN_VOCAB or not logits.is_contiguous():
        return logits.max(dim=-1).indices
    blocks = logits.view(*logits.shape[:-1], vocab // VOCAB_BLOCK, VOCAB_BLOCK)
    best_block = blocks.amax(dim=-1).max(dim=-1, keepdim=True).indices  # [..., 1]
    inside = blocks.gather(-2, best_block[..., None].expand(*best_block.shape, VOCAB_BLOCK)).squeeze(-2)
    return best_block.squeeze(-1) * VOCAB_BLOCK + inside.max(dim=-1).indices


def top_k_logprobs(logits: torch.Tensor, k: int, offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, token ids) of the k most likely tokens of each row of [R, V] logits, in
    descending order: ``logits.log_softmax(-1).topk(k)``, for the draft's proposals and tree scores;
    with ``offsets`` (an EAGLE-3 draft's d2t), each id i shifted to i + offsets[i].

    The top k entries of a row lie in the k blocks with the largest block maxima, so topk runs over
    those k blocks only. (log_softmax normalises: torch's logsumexp runs an exp that is 40x slower
    on arguments below -87, which a confident draft's logits reach.) Where the CPU kernels are
    loaded, one call does it (float32 values within about 1e-6 of log_softmax's)."""
    if _use_kernels(logits):
        values, ids = torch.ops.eaglet.topk_logprobs(logits, k, offsets)
        return values, ids
    values, ids = _top_k_logprobs(logits, k)
    return values, ids if offsets is None else ids + offsets[ids]


def _top_k_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = logits.log_softmax(dim=-1)
    rows, vocab = logprobs.shape
    if vocab % VOCAB_BLOCK or vocab < max(BLOCKED_MIN_VOCAB, 4 * VOCAB_BLOCK * k):
        top = logprobs.topk(k, dim=-1)
        return top.values, top.indices
    blocks = logprobs.view(rows, vocab // VOCAB_BLOCK, VOCAB_BLOCK)
    top_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [R, k]
    candidates = blocks.gather(1, top_blocks[:, :, None].expand(rows, k, VOCAB_BLOCK)).view(rows, k * VOCAB_BLOCK)
    top = candidates.topk(k, dim=-1)
    token_ids = top_blocks.gather(1, top.indices // VOCAB_BLOCK) * VOCAB_BLOCK + top.indices % VOCAB_BLOCK
    return top.values, token_ids


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] float32 (already processed) -> token ids [B].

    Greedy rows (temperature 0 or top_k 1): argmax, first index on ties. Other rows: one
    ``torch.multinomial`` draw from ``shaped_probs`` with the row's own generator (None: the global RNG).
    """
    tokens = greedy_tokens(logits)
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

