"""Logits processing that changes which token wins, applied identically with and without speculation.

``process_logits`` runs BEFORE greedy argmax and before the sampling shape (temperature, min-p,
top-k, top-p in ``eaglet/layers/sampler.py``). Order, as vLLM v1's sampler
(``vllm/v1/sample/sampler.py``, ``Sampler.forward``: non-argmax-invariant logits processors
``MinTokensLogitsProcessor`` then ``LogitBiasLogitsProcessor``, then ``apply_penalties`` =
repetition, frequency, presence as in ``vllm/model_executor/layers/utils.py::apply_penalties``):

1. min_tokens: while ``len(output_token_ids) < min_tokens``, EOS ids and ``stop_token_ids`` get
   -inf (regardless of ``ignore_eos``, as vLLM, whose ``all_stop_token_ids`` always holds EOS);
2. logit_bias: ``logit += bias``;
3. repetition_penalty ``p`` over every token of prompt + output (each distinct token once):
   ``logit / p`` if ``logit > 0`` else ``logit * p``;
4. frequency_penalty ``f``: ``logit -= f * count`` of the token in the output;
5. presence_penalty ``q``: ``logit -= q`` for every token present in the output.

Under speculation, a verify row for tree node ``n`` must see the history up to ``n``: the caller
passes ``output_token_ids`` = committed output + the draft tokens on the path from the root to ``n``
(contract 12). Then the processed target distribution at every node equals the one non-speculative
decoding would compute after the same tokens, so verification stays lossless (contract 11).

The work is sparse: it touches only the (row, token) entries named by each row's history, bias and
stop ids, in one gather/scatter per processor for the whole batch; rows needing none of it cost
nothing, and a batch with no such row returns ``logits`` itself. Python loops run over rows only
to build the index tensors.

``logprobs_of`` computes logprobs from the RAW model logits (log_softmax before any processing
here or in the sampler), which is what vLLM v1 returns by default (``logprobs_mode="raw_logprobs"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglet.errors import InvalidRequestError
from eaglet.sampling_params import SamplingParams

__all__ = ["LogitsRow", "process_logits", "logprobs_of"]


@dataclass
class LogitsRow:
    """One row of logits to process."""

    params: SamplingParams
    prompt_token_ids: list[int]
    # Generated history INCLUDING the earlier draft tokens on this row's tree path.
    output_token_ids: list[int]


def _row_needs(row: LogitsRow) -> bool:
    p = row.params
    return bool(
        (p.min_tokens > 0 and len(row.output_token_ids) < p.min_tokens)
        or p.logit_bias
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


class _Tensors:
    """Per-call cache of token-id lists as tensors, keyed by list identity: the rows of one request's
    tree share the same prompt list, so it is converted once per call."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, bool], tuple[list[int], torch.Tensor]] = {}

    def of(self, ids: list[int], distinct: bool = False) -> torch.Tensor:
        """``ids`` as a tensor; with ``distinct``, its distinct values (sorted)."""
        key = (id(ids), distinct)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is ids:
            return hit[1]
        t = torch.as_tensor(ids, dtype=torch.long) if len(ids) else torch.empty(0, dtype=torch.long)
        if distinct:
            t = t.unique()
        self._cache[key] = (ids, t)
        return t


def process_logits(
    logits: torch.Tensor, rows: list[LogitsRow], eos_token_ids: set[int] | frozenset[int], *, inplace: bool = False
) -> torch.Tensor:
    """logits [R, V] -> processed logits [R, V] (see the module docstring for what and in which order).

    Returns ``logits`` unchanged (the same tensor) when no row needs processing; otherwise a new
    tensor, or ``logits`` modified in place when ``inplace`` (and ``logits`` is contiguous; a
    non-contiguous input is copied). Compute ``logprobs_of`` first if logits are processed in place.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if len(rows) != num_rows:
        raise ValueError(f"{num_rows} rows of logits but {len(rows)} LogitsRow entries")
    need = [i for i, row in enumerate(rows) if _row_needs(row)]
    if not need:
        return logits
    out = logits if inplace and logits.is_contiguous() else logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    device = out.device
    tensors = _Tensors()

    def keys_of(row_ids: list[int], token_lists: list[torch.Tensor]) -> torch.Tensor:
        """Flat indices row * V + token for each row's tokens (tokens outside [0, V) dropped)."""
        if not row_ids:
            return torch.empty(0, dtype=torch.long)
        lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
        tokens = torch.cat(token_lists) if token_lists else torch.empty(0, dtype=torch.long)
        base = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long) * vocab, lengths)
        keys = base + tokens
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            keys = keys[(tokens >= 0) & (tokens < vocab)]
        return keys

    # 1. min_tokens: EOS and stop ids -> -inf while the output is shorter than min_tokens.
    mt_rows, mt_tokens = [], []
    for i in need:
        p = rows[i].params
        if p.min_tokens > 0 and len(rows[i].output_token_ids) < p.min_tokens:
            stops = sorted(set(eos_token_ids) | set(p.stop_token_ids))
            if stops:
                mt_rows.append(i)
                mt_tokens.append(torch.tensor(stops, dtype=torch.long))
    if mt_rows:
        flat.index_fill_(0, keys_of(mt_rows, mt_tokens).to(device), float("-inf"))

    # 2. logit_bias: add.
    lb_rows, lb_tokens, lb_values = [], [], []
    for i in need:
        bias = rows[i].params.logit_bias
        if bias:
            ids = list(bias.keys())
            if max(ids) >= vocab:
                raise InvalidRequestError(
                    f"logit_bias token ids must be in [0, {vocab}) (the vocabulary size), got {max(ids)}"
                )
            lb_rows.append(i)
            lb_tokens.append(torch.tensor(ids, dtype=torch.long))
            lb_values.extend(bias.values())
    if lb_rows:
        keys = keys_of(lb_rows, lb_tokens).to(device)  # distinct: dict keys, one row each
        values = torch.tensor(lb_values, dtype=out.dtype, device=device)
        flat[keys] = flat[keys] + values

    # 3. repetition penalty over the distinct tokens of prompt + output.
    rp_rows, rp_tokens = [], []
    for i in need:
        if rows[i].params.repetition_penalty != 1.0:
            rp_rows.append(i)
            rp_tokens.append(tensors.of(rows[i].prompt_token_ids, distinct=True))
            rp_tokens.append(tensors.of(rows[i].output_token_ids))
    if rp_rows:
        # A token in both prompt and output (or repeated in the output) appears more than once in
        # ``keys``: every copy gathers the same ORIGINAL value and writes back the same penalised
        # value, so each distinct token is penalised exactly once without sorting all the keys.
        keys = keys_of([i for i in rp_rows for _ in range(2)], rp_tokens).to(device)
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in range(num_rows)], dtype=out.dtype)
        penalty = penalty.to(device)[keys // vocab]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)

    # 4 + 5. frequency then presence penalty over the output tokens.
    fp_rows, fp_tokens = [], []
    for i in need:
        p = rows[i].params
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and rows[i].output_token_ids:
            fp_rows.append(i)
            fp_tokens.append(tensors.of(rows[i].output_token_ids))
    if fp_rows:
        keys, counts = keys_of(fp_rows, fp_tokens).unique(return_counts=True)
        keys, counts = keys.to(device), counts.to(device)
        row_of = keys // vocab
        freq = torch.tensor([rows[i].params.frequency_penalty for i in range(num_rows)], dtype=out.dtype)
        pres = torch.tensor([rows[i].params.presence_penalty for i in range(num_rows)], dtype=out.dtype)
        values = flat[keys]
        values = values - freq.to(device)[row_of] * counts.to(out.dtype)
        values = values - pres.to(device)[row_of]
        flat[keys] = values
    return out


def logprobs_of(
    logits: torch.Tensor, chosen: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the RAW model logits (log_softmax before any processing, vLLM v1's default
    ``raw_logprobs``; temperature, penalties, bias, top-k/top-p/min-p do not change them).

    logits [R, V], chosen [R] -> (chosen_logprob [R] float32, top_ids [R, num_top] int64,
    top_logprobs [R, num_top] float32), top entries in descending order.
    """
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_logprob = logprobs.gather(1, chosen.long().to(logprobs.device)[:, None])[:, 0]
    k = min(num_top, logprobs.shape[-1])
    if k == 0:
        rows = logprobs.shape[0]
        return (
            chosen_logprob,
            torch.empty(rows, 0, dtype=torch.long, device=logprobs.device),
            torch.empty(rows, 0, dtype=logprobs.dtype, device=logprobs.device),
        )
    top = logprobs.topk(k, dim=-1)
    return chosen_logprob, top.indices, top.values
