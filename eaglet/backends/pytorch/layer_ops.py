"""A decoder layer's elementwise and per-token work in PyTorch ops (``LayerOps``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglet.backends.pytorch.gemm_rows import MIN_GEMM_ROWS, rows_at_least


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, ..., dim] rotated by cos/sin [T, dim / 2] (float32 or already in x's dtype).

    With ``interleave`` the input pairs are (x0,x1),(x2,x3),...; the output is laid out as
    [rotated evens, rotated odds], which is what transformers produces. Only q.k matters, and q and
    k always go through the same layout, so the cached k_pe stays consistent.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos = cos.view(shape).to(x.dtype)
    sin = sin.view(shape).to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TorchLayerOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # F.rms_norm without a weight is x * rsqrt(mean(x^2) + eps) in float32, bit for bit
        # (tests/test_layer_fast_paths.py), in one op instead of five.
        normed = F.rms_norm(x.float(), weight.shape, eps=eps)
        return weight * normed.to(x.dtype)

    def rope_query_key(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # k_pe as an extra head: the same elementwise arithmetic, half the ops.
        heads = q_pe.shape[1]
        rotated = rotate(torch.cat([q_pe, k_pe[:, None, :]], dim=1), cos, sin, interleave)
        return rotated[:, :heads], rotated[:, heads]

    def noaux_route(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
        norm_topk_prob: bool, routed_scaling_factor: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Rows padded to a multiple of MIN_GEMM_ROWS, so a token's scores do not depend on how many
        # tokens are routed: MKL's product, and sigmoid, whose vector loop leaves a scalar tail past
        # its last whole pair of vectors (a different rounding for the last token of an odd count).
        padded_rows = -(-max(x.shape[0], 1) // MIN_GEMM_ROWS) * MIN_GEMM_ROWS
        scores = F.linear(rows_at_least(x.float(), padded_rows), weight).sigmoid()[: x.shape[0]]
        biased = scores + bias
        if topk_group < n_group:  # otherwise every group is kept
            num_tokens, num_experts = biased.shape
            grouped = biased.view(num_tokens, n_group, num_experts // n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            kept_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
            biased = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(num_tokens, num_experts)
        expert_ids = biased.topk(top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * routed_scaling_factor, expert_ids
