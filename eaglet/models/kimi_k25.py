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

from eaglet.config import ModelConfig
from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.layers.attention_backend import AttentionBackend
from eaglet.models.deepseek_v3 import DeepseekV3ForCausalLM, ForwardOutput
from eaglet.models.kimi_k25_vision import KimiProjector, KimiVisionTower


class KimiK25ForConditionalGeneration(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = KimiVisionTower(config.vision)
        self.mm_projector = KimiProjector(config.vision)
        self.language_model = DeepseekV3ForCausalLM(config.text)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def ignored_checkpoint_tensors(self) -> tuple[re.Pattern, ...]:
        return self.language_model.ignored_checkpoint_tensors("language_model.")

    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """Features for every placeholder token of the given images, in order: [N, text_hidden]."""
        dtype = self.mm_projector.proj[0].weight.dtype
        return self.mm_projector(self.vision_tower(pixel_values.to(dtype), grid_thws))

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> ForwardOutput:
        return self.language_model(batch, backend)
