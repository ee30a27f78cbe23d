"""What a speculative round reads: the draft's per-request state and the round's cache rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftState:
    """What the draft extend leaves for requests' next rounds. The worker's table holds one row per
    request row (req_pool_idx) of the cache."""

    topk_tokens: torch.Tensor  # [R, k] target token ids proposed for the position after the root
    topk_logprobs: torch.Tensor  # [R, k] float32, for tree scores (not written with top-1 drafting)
    hidden: torch.Tensor  # [R, H] draft hidden at the root's draft slot, fed back at step 1


@dataclass
class RoundRows:
    """A round's view of its requests' cache rows."""

    rows: list[int]  # req_pool_idx per request
    prefix: list[int]  # committed tokens per request (row index of the root's slot)
    rows_t: torch.Tensor  # [B] rows, as a tensor
    prefix_t: torch.Tensor  # [B] prefix, as a tensor
    roots: torch.Tensor  # [B] each request's root token (its last output token, not yet cached)
    slots: torch.Tensor  # [B, scratch_len] cache slots of row indices prefix .. prefix + scratch_len - 1
    # Every request greedy, without logits processing or logprobs: the round skips their handling.
    greedy_only: bool
