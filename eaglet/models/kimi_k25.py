"""Kimi-K2.5: MoonViT vision tower + projector + DeepSeek-V3 language model.

Images are encoded separately (``encode_images``); the caller merges the features into the token
embeddings at the placeholder positions (``eaglet.multimodal.embedding``) and passes them as
``batch.input_embeds``, so the merged embeddings exist as their own tensor (the EAGLE-3 draft
reads a copy of them).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from eaglet.backends.base import Backend
from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
from eaglet.distributed.tensor_parallel import TensorParallel
from eaglet.errors import ConfigError
from eaglet.models.config import ModelConfig, parse_text_config
from eaglet.models.deepseek_v3 import DeepseekV3ForCausalLM, ForwardOutput
from eaglet.models.kimi_k25_vision import KimiProjector, KimiVisionConfig, KimiVisionTower
from eaglet.models.quantization import parse_text_and_top_quantization
from eaglet.runtime.forward_batch import ForwardBatch


def parse_kimi_k25_config(raw: dict) -> ModelConfig:
    """A Kimi-K2.5 config.json: the DeepSeek-V3 ``text_config``, the vision tower's, the placeholder id."""
    text_raw = raw.get("text_config")
    if not isinstance(text_raw, dict):
        raise ConfigError("kimi_k25 config: 'text_config' must be an object")
    quantization = parse_text_and_top_quantization(raw, text_raw)
    text = parse_text_config(text_raw, where="text_config")
    image_token_id = raw.get("media_placeholder_token_id", raw.get("image_token_id"))
    if image_token_id is None:
        image_token_id = text_raw.get("media_placeholder_token_id")
    if not isinstance(image_token_id, int) or not 0 <= image_token_id < text.vocab_size:
        raise ConfigError(
            f"kimi_k25 config: media_placeholder_token_id / image_token_id must be a token id "
            f"below vocab_size {text.vocab_size}, got {image_token_id!r}"
        )
    vision = KimiVisionConfig.from_hf(raw)
    if vision.text_hidden_size != text.hidden_size:
        raise ConfigError(
            f"kimi_k25 config: projector output size {vision.text_hidden_size} != "
            f"text hidden_size {text.hidden_size}"
        )
    return ModelConfig("kimi_k25", text, vision, image_token_id, raw, quantization)


class KimiK25ForConditionalGeneration(nn.Module):
    """Under tensor parallelism the vision tower and projector live on rank 0 only, which merges
    image features into the embeddings it hands the other ranks."""

    def __init__(self, config: ModelConfig, backend: Backend, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.config = config
        self.encodes_images = tp.rank == 0
        if self.encodes_images:
            self.vision_tower = KimiVisionTower(config.vision)
            self.mm_projector = KimiProjector(config.vision)
        self.language_model = DeepseekV3ForCausalLM(config.text, backend, tp)

    @classmethod
    def from_model_config(
        cls, config: ModelConfig, backend: Backend, tp: TensorParallel | None = None
    ) -> KimiK25ForConditionalGeneration:
        return cls(config, backend, tp)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def ignored_checkpoint_tensors(self) -> tuple[re.Pattern, ...]:
        vision = () if self.encodes_images else (re.compile(r"(vision_tower|mm_projector)\."),)
        return self.language_model.ignored_checkpoint_tensors("language_model.") + vision

    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """Features for every placeholder token of the given images, in order: [N, text_hidden]."""
        dtype = self.mm_projector.proj[0].weight.dtype
        return self.mm_projector(self.vision_tower(pixel_values.to(dtype), grid_thws))

    def forward(self, batch: ForwardBatch, attention: MLAAttentionBackend) -> ForwardOutput:
        return self.language_model(batch, attention)
