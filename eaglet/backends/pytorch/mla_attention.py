"""MLA attention over the paged latent cache in PyTorch ops.

An attention object writes the new tokens' latents to its pool and attends; model code calls only
``forward``, so the C++ kernel's version (``eaglet.backends.cpu.mla_attention``) replaces this one
without touching it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from eaglet.backends.pytorch.gemm_rows import MIN_BMM_ROWS, MIN_GEMM_ROWS, rows_at_least
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.runtime.kv_cache import KVCacheManager, LatentKVPool

MIN_SOFTMAX_KEYS = 16


class MLALayer(Protocol):
    """What attention reads of an MLA layer (``eaglet.layers.mla.MLAAttention``)."""

    layer_id: int
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scaling: float
    w_uk: torch.Tensor  # [H, P, L] float32
    w_uv_t: torch.Tensor  # [H, L, V] float32
    absorbed_projections: tuple[torch.Tensor, ...]

    def decompress(self, latent: torch.Tensor) -> torch.Tensor:
        """kv_b_proj of cached latents [S, L]: [S, H * (P + V)]."""
        ...


class MLAAttentionBackend(Protocol):
    def forward(
        self,
        layer: MLALayer,
        q_nope: torch.Tensor,  # [T, H, P]
        q_pe: torch.Tensor,  # [T, H, R] roped
        c_kv: torch.Tensor,  # [T, L] normalized latent of the new tokens
        k_pe: torch.Tensor,  # [T, R] roped shared key of the new tokens
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H, V]
        ...


class TorchMLAAttention:
    """Plain PyTorch MLA.

    EXTEND batches attend in the decompressed form (kv_b_proj applied to each request's cached
    latents; cheap per query when many new tokens share the keys). DECODE batches attend in the
    absorbed form: queries are projected into the latent space, so each cached token is read as
    kv_lora_rank + qk_rope_head_dim values and never decompressed. Batches with a ``custom_mask``
    (tree verify, draft tree steps) also attend in the absorbed form. ``absorbed_extend`` forces the
    absorbed form for EXTEND too (used to check the two forms against each other).
    """

    def __init__(self, cache: KVCacheManager, pool: LatentKVPool | None = None, absorbed_extend: bool = False) -> None:
        self.cache = cache
        self.pool = pool if pool is not None else cache.target
        self.absorbed_extend = absorbed_extend

    def forward(
        self,
        layer: MLALayer,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        self._write(layer, batch, c_kv, k_pe)
        if self._attends_absorbed(batch):
            return self._absorbed(layer, q_nope, q_pe, batch)
        return self._decompressed(layer, q_nope, q_pe, batch)

    def _write(self, layer: MLALayer, batch: ForwardBatch, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        self.pool.write(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)

    def _attends_absorbed(self, batch: ForwardBatch) -> bool:
        return batch.mode != ForwardMode.EXTEND or batch.custom_mask is not None or self.absorbed_extend

    def _decompressed(
        self, layer: MLALayer, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        kv_cache = self.pool.kv[layer.layer_id]
        rows = batch.req_pool_indices.tolist()
        heads, nope, latent = layer.num_heads, layer.qk_nope_head_dim, layer.kv_lora_rank
        out = q_nope.new_empty(q_nope.shape[0], heads, layer.v_head_dim)
        start = 0
        for row, prefix_len, num_new in zip(rows, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu):
            seq_len = prefix_len + num_new
            cached = kv_cache[self.cache.req_to_token[row, :seq_len]]  # [S, L+R]
            kv = layer.decompress(cached[:, :latent]).view(seq_len, heads, -1)
            k_nope, v = kv.split([nope, layer.v_head_dim], dim=-1)
            k_pe = cached[:, None, latent:].expand(seq_len, heads, layer.qk_rope_head_dim)
            k = torch.cat([k_nope, k_pe], dim=-1)
            q = torch.cat([q_nope[start : start + num_new], q_pe[start : start + num_new]], dim=-1)
            query_index = torch.arange(prefix_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= query_index[:, None]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=layer.scaling
            )
            out[start : start + num_new] = o.transpose(0, 1)
            start += num_new
        return out

    def _absorbed(
        self, layer: MLALayer, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Attention in the latent space, in float32 whatever the cache dtype.

        q_latent = q_nope W_UK per head; scores over [latent | k_pe] keys; the probability-weighted
        latent goes through W_UV. The gathered keys, the key mask and the batch-to-token map are the
        same for every layer of a forward, so they are derived once per forward (``batch._memo``).

        When every request has the same number n of new tokens (decode n = 1, verify, draft tree
        steps), a request's n * H query rows attend to its keys in one batched product: the keys
        are read once per request, not copied once per token.
        """
        latent = layer.kv_lora_rank
        num_tokens, heads = q_nope.shape[0], layer.num_heads
        batch_size = batch.batch_size
        max_len = max(batch.seq_lens_cpu)
        slots = self._slots(batch, max_len)  # [B * S]
        cached = self.pool.kv[layer.layer_id].index_select(0, slots)
        cached = cached.view(batch_size, max_len, -1).float()  # [B, S, L+R]
        per_request = batch.new_tokens_per_request()
        grouped = per_request is not None
        if not grouped:
            cached = cached.index_select(0, batch.token_to_request())  # [T, S, L+R]

        # Padded row counts keep each token's bits independent of how many tokens this pass holds
        # (gemm_rows.py): a verify pass then matches plain decoding.
        q_nope_by_head = rows_at_least(q_nope.float().transpose(0, 1), MIN_BMM_ROWS, dim=1)
        q_latent = torch.bmm(q_nope_by_head, layer.w_uk)[:, :num_tokens].transpose(0, 1)  # [T, H, L]
        q = torch.cat([q_latent, q_pe.float()], dim=-1)  # [T, H, L+R]
        if grouped:
            q = q.view(batch_size, per_request * heads, -1)  # [B, n*H, L+R]
        scores = torch.bmm(rows_at_least(q, MIN_GEMM_ROWS, dim=1), cached.transpose(1, 2))[:, : q.shape[1]]
        scores.mul_(layer.scaling)
        if not self._all_keys_visible(batch, max_len):
            mask = batch.attention_mask(max_len)  # [T, S]
            if grouped:
                scores = scores.view(batch_size, per_request, heads, max_len)
                scores.masked_fill_(~mask.view(batch_size, per_request, 1, max_len), float("-inf"))
            else:
                scores.masked_fill_(~mask[:, None, :], float("-inf"))
        # softmax rounds rows shorter than MIN_SOFTMAX_KEYS differently from longer ones (scalar
        # vs vector loop): padded with -inf keys, a token's probabilities do not depend on the
        # longest row of its batch.
        if max_len < MIN_SOFTMAX_KEYS:
            scores = F.pad(scores, (0, MIN_SOFTMAX_KEYS - max_len), value=float("-inf"))
        probs = scores.softmax(dim=-1)[..., :max_len].reshape(q.shape[0], q.shape[1], max_len)
        o_latent = torch.bmm(probs, cached[:, :, :latent]).view(num_tokens, heads, latent)  # [T, H, L]
        o_latent_by_head = rows_at_least(o_latent.transpose(0, 1), MIN_BMM_ROWS, dim=1)
        out = torch.bmm(o_latent_by_head, layer.w_uv_t)[:, :num_tokens].transpose(0, 1)  # [T, H, V]
        return out.to(q_nope.dtype)

    def _slots(self, batch: ForwardBatch, max_len: int) -> torch.Tensor:
        """Cache slots of row indices 0..max_len-1 of every request, flattened: [B * max_len]."""
        key = ("slots", id(self.cache.req_to_token), max_len)
        if key not in batch._memo:
            batch._memo[key] = self.cache.req_to_token[:, :max_len].index_select(0, batch.req_pool_indices).reshape(-1)
        return batch._memo[key]

    @staticmethod
    def _all_keys_visible(batch: ForwardBatch, max_len: int) -> bool:
        """A plain decode step over requests of one length sees every key: no mask needed."""
        return batch.mode == ForwardMode.DECODE and batch.custom_mask is None and min(batch.seq_lens_cpu) == max_len
