"""MLA attention in eaglet's C++ kernels: the absorbed form in one call per layer
(``torch.ops.eaglet.mla_absorbed_attention``), which reads each request's latents straight from
the paged cache and computes every token on its own, with no padding; the new tokens' latents go
into the pool in one call too (``mla_cache_write``)."""

from __future__ import annotations

import torch

from eaglet.backends.pytorch.mla_attention import MLALayer, TorchMLAAttention
from eaglet.runtime.forward_batch import ForwardBatch

# Extends with at least this many cached keys per new token attend absorbed (see _attends_absorbed).
ABSORBED_EXTEND_KEYS_PER_NEW_TOKEN = 4


class CpuMLAAttention(TorchMLAAttention):
    """TorchMLAAttention with the absorbed form and the cache write in the kernels. EXTEND
    batches keep the decompressed form unless they add few tokens to many cached ones."""

    def _write(self, layer: MLALayer, batch: ForwardBatch, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        torch.ops.eaglet.mla_cache_write(self.pool.kv[layer.layer_id], batch.out_cache_loc, c_kv, k_pe)

    def _attends_absorbed(self, batch: ForwardBatch) -> bool:
        # An extend of a few tokens against many cached ones (the draft's extend after each verify)
        # attends absorbed too: decompressing every cached latent costs more there.
        return super()._attends_absorbed(batch) or all(
            n * ABSORBED_EXTEND_KEYS_PER_NEW_TOKEN <= s for n, s in zip(batch.extend_seq_lens_cpu, batch.seq_lens_cpu)
        )

    def _absorbed(
        self, layer: MLALayer, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        slots, kv_lens, token_starts, custom_mask = self._attention_metadata(batch)
        return torch.ops.eaglet.mla_absorbed_attention(
            q_nope, q_pe, self.pool.kv[layer.layer_id], layer.w_uk, layer.w_uv_t, slots, kv_lens, token_starts,
            custom_mask, layer.scaling, *layer.amx_projections,
        )

    def absorbed_inputs(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, ...] | None:
        """What the decoder stack (the C++ decoder stack) takes for a batch this backend
        attends absorbed: (the pool's cache [layers, slots, L + R], out_cache_loc, slots, kv_lens,
        token_starts, custom_mask); None for a batch it attends decompressed."""
        if not self._attends_absorbed(batch):
            return None
        return (self.pool.kv, batch.out_cache_loc, *self._attention_metadata(batch))

    def _attention_metadata(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, ...]:
        """mla_absorbed_attention's (slots [B, S], kv_lens, token_starts, custom_mask)."""
        max_len = max(batch.seq_lens_cpu)
        slots = self._slots(batch, max_len).view(batch.batch_size, max_len)
        return slots, batch.seq_lens, batch.token_starts(), batch.custom_mask

