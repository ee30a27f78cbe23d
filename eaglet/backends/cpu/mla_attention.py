"""MLA attention in eaglet's C++ kernels: the absorbed form in one call per layer
(``torch.ops.eaglet.mla_absorbed_attention``), which reads each request's latents straight from
the paged cache and computes every token on its own, with no padding; the new tokens' latents go
into the pool in one call too (``mla_cache_write``).

Every batch attends absorbed, prefill included: a token's keys are then read from the cache in
the same form and order whether they were written by this chunk, an earlier one or another
request (a prefix-cache hit), so its result does not depend on how its prompt was split."""

from __future__ import annotations

from typing import NamedTuple

import torch

from eaglet.backends.pytorch.mla_attention import MLALayer, TorchMLAAttention
from eaglet.runtime.forward_batch import ForwardBatch


class AttentionMetadata(NamedTuple):
    """Where a batch's keys are, for mla_absorbed_attention (its struct of the same name)."""

    slots: torch.Tensor  # [B, S] each request's cache slots by row index
    kv_lens: torch.Tensor  # [B] its number of keys
    token_starts: torch.Tensor  # [B + 1] its first token, then T
    custom_mask: torch.Tensor | None  # [T, S] bool, the keys each token sees; None: causal


class CpuMLAAttention(TorchMLAAttention):
    """TorchMLAAttention with the absorbed form, for every batch, and the cache write in the kernels."""

    def _write(self, layer: MLALayer, batch: ForwardBatch, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        torch.ops.eaglet.mla_cache_write(self.pool.kv[layer.layer_id], batch.out_cache_loc, c_kv, k_pe)

    def _attends_absorbed(self, batch: ForwardBatch) -> bool:
        return True

    def _absorbed(
        self, layer: MLALayer, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        # Positional, each argument named by what it is: keywords make every layer's op call slower.
        metadata = self._attention_metadata(batch)
        w_uk_packed, w_uv_packed = layer.absorbed_projections or (None, None)
        return torch.ops.eaglet.mla_absorbed_attention(
            q_nope, q_pe, self.pool.kv[layer.layer_id], layer.w_uk, layer.w_uv_t, metadata.slots, metadata.kv_lens,
            metadata.token_starts, metadata.custom_mask, layer.scaling, w_uk_packed, w_uv_packed,
        )

    def absorbed_inputs(self, batch: ForwardBatch) -> dict[str, torch.Tensor | None]:
        """What the C++ decoder stack takes for a batch, by name: the pool's cache kv
        [layers, slots, L + R], out_cache_loc, and the AttentionMetadata."""
        return {"kv": self.pool.kv, "out_cache_loc": batch.out_cache_loc, **self._attention_metadata(batch)._asdict()}

    def _attention_metadata(self, batch: ForwardBatch) -> AttentionMetadata:
        """Where this batch's keys are (mla_absorbed_attention's metadata, the same for every layer)."""
        max_len = max(batch.seq_lens_cpu)
        slots = self._slots(batch, max_len).view(batch.batch_size, max_len)
        return AttentionMetadata(slots, batch.seq_lens, batch.token_starts(), batch.custom_mask)
