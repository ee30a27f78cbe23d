"""Grouped-query attention (Llama layout) over the paged cache, for Llama-style EAGLE-3 drafts.

The draft keeps its own K/V buffers (:class:`GQAKVPool`) indexed by the slot space the target uses
(see ``eaglet/runtime/kv_cache.py``), so a slot's draft entry and target entry describe the same
position. :class:`TorchNativeGQABackend` writes the new tokens' K/V and attends over each request's
row of the request-to-slots table, vectorised over requests (queries and keys padded per request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.runtime.kv_cache import KVCacheManager
from eaglet.layers.linear import linear
from eaglet.layers.rotary import RopeConfig, RotaryEmbedding


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
        super().__init__(head_dim, RopeConfig(theta=rope.theta, rope_type="default"), interleave=False)
        self.inv_freq = llama_inv_freq(head_dim, rope)


class GQAKVPool:
    """One model's K and V buffers [num_layers, num_slots, num_kv_heads, head_dim] over the shared slots."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.k = torch.zeros(num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)

    def write(self, layer_id: int, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer_id][out_cache_loc] = k.to(self.k.dtype)
        self.v[layer_id][out_cache_loc] = v.to(self.v.dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


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
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        backend: TorchNativeGQABackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = linear(x, self.q_proj.weight, self.q_proj.bias).view(num_tokens, self.num_heads, self.head_dim)
        k = linear(x, self.k_proj.weight, self.k_proj.bias).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = linear(x, self.v_proj.weight, self.v_proj.bias).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = self.rotary(q, cos, sin)
        k = self.rotary(k, cos, sin)
        out = backend.forward(self, q, k, v, batch)  # [T, Hq, D]
        return linear(out.reshape(num_tokens, self.num_heads * self.head_dim), self.o_proj.weight, self.o_proj.bias)

    def packable_weights(self) -> list[torch.Tensor]:
        return [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.o_proj.weight]


class TorchNativeGQABackend:
    """Plain PyTorch GQA over the paged cache.

    Writes the new tokens' K/V to ``pool`` at ``batch.out_cache_loc``, then each token attends to the
    cache entries of its request's row under ``batch.attention_mask`` (causal, or ``custom_mask``).
    Requests are batched by padding queries to the longest extend and keys to the longest sequence;
    scores and softmax run in float32.
    """

    def __init__(self, cache: KVCacheManager, pool: GQAKVPool) -> None:
        self.cache = cache
        self.pool = pool

    def forward(
        self,
        layer: GQAAttention,
        q: torch.Tensor,  # [T, Hq, D] roped
        k: torch.Tensor,  # [T, Hkv, D] roped
        v: torch.Tensor,  # [T, Hkv, D]
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, Hq, D]
        self.pool.write(layer.layer_id, batch.out_cache_loc, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = layer.num_kv_heads
        group = num_heads // num_kv_heads
        batch_size = batch.batch_size
        max_len = max(batch.seq_lens_cpu)
        max_new = max(batch.extend_seq_lens_cpu)
        device = q.device

        slots = self.cache.req_to_token[batch.req_pool_indices, :max_len]  # [B, S]
        keys = self.pool.k[layer.layer_id][slots].permute(0, 2, 1, 3)  # [B, Hkv, S, D]
        values = self.pool.v[layer.layer_id][slots].permute(0, 2, 1, 3)

        # Scatter the flat tokens into a [B, max_new] grid: (request, offset within its extend).
        token_req = batch.token_to_request()
        offset = torch.arange(num_tokens, device=device) - batch.extend_start_loc[token_req]
        q_grid = q.new_zeros(batch_size, max_new, num_heads, head_dim)
        q_grid[token_req, offset] = q
        mask = batch.attention_mask(max_len) & (
            torch.arange(max_len, device=device)[None, :] < batch.seq_lens[token_req][:, None]
        )
        mask_grid = torch.ones(batch_size, max_new, max_len, dtype=torch.bool, device=device)  # pad rows: finite
        mask_grid[token_req, offset] = mask

        # [B, max_new, Hkv, G, D] -> [B, Hkv, G * max_new, D]: query heads kv*G .. kv*G+G-1 share kv head kv.
        q_grid = q_grid.view(batch_size, max_new, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q_grid = q_grid.reshape(batch_size, num_kv_heads, group * max_new, head_dim)
        scores = torch.matmul(q_grid, keys.transpose(-1, -2)).float() * layer.scaling  # [B, Hkv, G*N, S]
        scores = scores.view(batch_size, num_kv_heads, group, max_new, max_len)
        scores.masked_fill_(~mask_grid[:, None, None], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype).view(batch_size, num_kv_heads, group * max_new, max_len)
        out = torch.matmul(probs, values)  # [B, Hkv, G*N, D]
        out = out.view(batch_size, num_kv_heads, group, max_new, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(batch_size, max_new, num_heads, head_dim)
        return out[token_req, offset]
