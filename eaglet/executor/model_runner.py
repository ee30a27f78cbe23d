"""Builds the ragged ForwardBatch for a set of requests and runs the model over it."""

from __future__ import annotations

import torch
from torch import nn

from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
from eaglet.errors import DistributedError
from eaglet.executor.request import Request, record_prompt_logprobs
from eaglet.executor.tp_followers import Followers
from eaglet.models.config import ModelConfig
from eaglet.models.deepseek_v3 import ForwardOutput
from eaglet.multimodal.embedding import merge_image_features
from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.runtime.kv_cache import KVCacheManager


class ModelRunner:
    """Under tensor parallelism this is rank 0's: each forward of the target and each move of its
    cache entries goes to the other ranks (``followers``) before it runs here."""

    def __init__(
        self, model: nn.Module, config: ModelConfig, cache: KVCacheManager, attention: MLAAttentionBackend,
        followers: Followers | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.cache = cache
        self.attention = attention
        self.followers = followers

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """The target model over ``batch``."""
        if self.followers is None:
            return self.model(batch, self.attention)
        self.followers.forward(batch, self.cache)
        try:
            return self.model(batch, self.attention)
        except DistributedError as exc:
            self.followers.failed = exc
            raise
        except BaseException as exc:  # an error or Ctrl-C mid-forward: the other ranks are left in its collectives
            self.followers.failed = DistributedError(f"rank 0's forward stopped midway ({type(exc).__name__}: {exc})")
            if isinstance(exc, Exception):
                raise self.followers.failed from exc
            raise

    def copy_target_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Moves the target's cache entries from slots ``src`` to ``dst`` (an accepted tree path)."""
        if self.followers is not None:
            self.followers.copy_slots(src, dst)
        self.cache.copy_slots(self.cache.target, src, dst)

    @torch.inference_mode()
    def extend(
        self,
        requests: list[Request],
        num_new_tokens: list[int],
        *,
        capture_layers: tuple[int, ...] = (),
        all_logits: bool = False,
        greedy_ids_only: bool = False,
    ) -> tuple[ForwardBatch, ForwardOutput]:
        """Runs the next ``num_new_tokens[i]`` uncached tokens of each request (prefill chunk or decode).

        Grows each request's cache row, writes the latents, and returns logits at each request's
        last new token (at every new token with ``all_logits``, for prompt logprobs); with
        ``greedy_ids_only`` (a decode step of requests whose ``greedy_ids_suffice``), possibly only
        their argmax (``ForwardOutput.greedy_ids``).
        """
        input_ids: list[int] = []
        prefix_lens: list[int] = []
        # Prompt logprobs need the logits of every prompt position in the chunk.
        wants_prompt = [r.needs_prompt_logprobs for r in requests]
        for req, num_new in zip(requests, num_new_tokens):
            start = req.num_cached_tokens
            input_ids.extend(req.token_ids(start, start + num_new))
            prefix_lens.append(start)
        out_cache_loc = self.cache.grow_rows(
            [r.req_pool_idx for r in requests], [start + num_new for start, num_new in zip(prefix_lens, num_new_tokens)]
        )
        batch = ForwardBatch.build(
            input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in requests],
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=list(num_new_tokens),
            out_cache_loc=out_cache_loc,
            logits_indices=torch.arange(len(input_ids)) if all_logits or any(wants_prompt) else None,
            capture_layers=capture_layers,
            greedy_ids_only=greedy_ids_only,
        )
        batch.input_embeds = self.merged_embeddings(requests, batch)
        output = self.forward(batch)
        if any(wants_prompt) and not all_logits:
            for req, start, num, wants in zip(requests, batch.extend_start_loc.tolist(), num_new_tokens, wants_prompt):
                if wants:
                    record_prompt_logprobs(req, req.num_cached_tokens, output.logits[start : start + num])
            output.logits = output.logits[ForwardBatch.last_token_indices(batch.extend_start_loc, batch.extend_seq_lens)]
        for req, num_new in zip(requests, num_new_tokens):
            req.num_cached_tokens += num_new
        return batch, output

    def image_features(self, req: Request) -> torch.Tensor:
        """The request's image features, one row per placeholder, encoded on first use."""
        mm = req.mm_inputs
        if mm.features is None:
            mm.features = self.model.encode_images(mm.pixel_values, mm.grid_thws)
        return mm.features

    def merged_embeddings(self, requests: list[Request], batch: ForwardBatch) -> torch.Tensor | None:
        """Token embeddings with image features at placeholder rows, or None for a text-only batch."""
        rows: list[torch.Tensor] = []
        features: list[torch.Tensor] = []
        for i, req in enumerate(requests):
            mm = req.mm_inputs
            if mm is None:
                continue
            start = batch.extend_prefix_lens_cpu[i]
            offsets, feature_ids = mm.feature_rows(start, start + batch.extend_seq_lens_cpu[i])
            if feature_ids.numel() == 0:
                continue
            rows.append(offsets + int(batch.extend_start_loc[i]))
            features.append(self.image_features(req)[feature_ids])
        if not rows:
            return None
        return merge_image_features(self.model.embed_tokens, batch.input_ids, torch.cat(rows), torch.cat(features))
