"""Rotary position embedding for the rope part of MLA heads, with YaRN scaling."""

import math
from dataclasses import dataclass

import torch
from torch import nn

from eaglet.backends.base import LayerOps
from eaglet.backends.pytorch.layer_ops import rotate

@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """(P+R)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


def _yarn_inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Rotates the last dimension of q/k by position (``interleave``: see ``backends.pytorch.layer_ops.rotate``)."""

    def __init__(self, dim: int, rope: RopeConfig, interleave: bool, ops: LayerOps) -> None:
        super().__init__()
        if rope.rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(dim, rope)
        else:
            inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.attention_factor = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = interleave
        self.ops = ops
        self._tables: dict[torch.dtype, torch.Tensor] = {}  # cos_sin_as's, per dtype

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_sin_as(positions, torch.float32)

    def cos_sin_as(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position's angles (times the attention factor) in the dtype of the
        tensors they rotate, looked up in a table of every position so far: one op per forward
        instead of ten, and the same values for a position whichever batch it is in."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self.table_as(needed, dtype).index_select(0, positions.reshape(-1)).unbind(1)
        return cos, sin

    def table_as(self, num_positions: int, dtype: torch.dtype) -> torch.Tensor:
        """cos_sin_as's table in ``dtype`` ([P, 2, dim / 2], P >= num_positions), grown by doubling."""
        table = self._tables.get(dtype)
        if table is None or table.shape[0] < num_positions:
            table = self._table(max(num_positions, 2 * (table.shape[0] if table is not None else 1024)), dtype)
            self._tables[dtype] = table
        return table

    def _table(self, num_positions: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_positions, 2, dim / 2]: cos and sin at positions 0 .. num_positions - 1."""
        freqs = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)[:, None] * self.inv_freq[None, :]
        return torch.stack([freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor], dim=1).to(dtype)

    def rotate_query_and_key(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's per-head q_pe [T, H, dim] and shared k_pe [T, dim], rotated in one call."""
        return self.ops.rope_query_key(q_pe, k_pe, cos, sin, self.interleave)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., dim]; cos/sin: [T, dim/2], float32 or already in x's dtype (``cos_sin_as``)."""
        return rotate(x, cos, sin, self.interleave)
