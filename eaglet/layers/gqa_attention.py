"""Grouped-query attention layers (Llama layout), for Llama-style EAGLE-3 drafts.

The draft keeps its own K/V buffers (``eaglet.runtime.kv_cache.GQAKVPool``) indexed by the slot
space the target uses, so a slot's draft entry and target entry describe the same position. The
attention itself is ``eaglet.backends.pytorch.gqa_attention.TorchGQAAttention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from eaglet.backends.base import WeightMethods
from eaglet.backends.pytorch.gqa_attention import TorchGQAAttention
from eaglet.backends.pytorch.layer_ops import TorchLayerOps
from eaglet.layers.linear import Linear
from eaglet.layers.rotary import RopeConfig, RotaryEmbedding
from eaglet.runtime.forward_batch import ForwardBatch


@dataclass(frozen=True)
class LlamaRopeConfig:
    """RoPE of a Llama-style layer: plain ("default") or Llama-3.1 frequency scaling ("llama3")."""

    theta: float
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def llama_inv_freq(head_dim: int, rope: LlamaRopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32), with Llama-3.1 scaling when rope_type is llama3."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type != "llama3":
        raise ValueError(f"rope type {rope.rope_type!r} (default or llama3)")
    original = rope.original_max_position_embeddings
    low_freq_wavelen = original / rope.low_freq_factor  # longer wavelengths: fully interpolated
    high_freq_wavelen = original / rope.high_freq_factor  # shorter wavelengths: untouched
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class LlamaRotaryEmbedding(RotaryEmbedding):
    """Rotate-half RoPE (Llama layout: pairs (i, i + D/2)) with Llama-3.1 scaling support."""

    def __init__(self, head_dim: int, rope: LlamaRopeConfig) -> None:
        # Llama attention rotates q and k separately, in PyTorch ops (the kernels rotate MLA's).
        super().__init__(head_dim, RopeConfig(theta=rope.theta, rope_type="default"), interleave=False, ops=TorchLayerOps())
        self.inv_freq = llama_inv_freq(head_dim, rope)


class GQAAttention(nn.Module):
    """q/k/v/o projections of one Llama attention layer (checkpoint names, [out, in] layout).

    ``input_size`` is 2*hidden_size in an EAGLE-3 draft (the concatenated embedding and hidden).
    """

    def __init__(
        self,
        *,
        layer_id: int,
        input_size: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        rotary: LlamaRotaryEmbedding,
        weights: WeightMethods,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5
        self.rotary = rotary
        self.q_proj = Linear(input_size, num_heads * head_dim, bias, weights)
        self.k_proj = Linear(input_size, num_kv_heads * head_dim, bias, weights)
        self.v_proj = Linear(input_size, num_kv_heads * head_dim, bias, weights)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias, weights)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        attention: TorchGQAAttention,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = self.rotary(q, cos, sin)
        k = self.rotary(k, cos, sin)
        out = attention.forward(self, q, k, v, batch)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
