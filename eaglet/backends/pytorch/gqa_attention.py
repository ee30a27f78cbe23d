"""Grouped-query attention over the paged cache in PyTorch ops (a Llama EAGLE-3 draft's)."""

from __future__ import annotations

from typing import Protocol

import torch

from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.runtime.kv_cache import GQAKVPool, KVCacheManager


class GQALayer(Protocol):
    """What attention reads of a GQA layer (``eaglet.layers.gqa_attention.GQAAttention``)."""

    layer_id: int
    num_kv_heads: int
    scaling: float


class TorchGQAAttention:
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
        layer: GQALayer,
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
