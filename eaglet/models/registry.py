"""Which model class runs which checkpoint, and how to build and load one."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from eaglet.config import ModelConfig, load_model_config
from eaglet.layers.cpu_policy import auto_dtype
from eaglet.models.loader import load_weights, skip_init

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A supported torch dtype from its name; ``"auto"`` picks what this CPU runs fastest (cpu_policy)."""
    if dtype == "auto":
        return auto_dtype()
    if isinstance(dtype, torch.dtype):
        if dtype not in SUPPORTED_DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
        return dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose 'auto' or one of {sorted(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[dtype]


def build_model(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    with skip_init(dtype):
        if config.architecture == "kimi_k25":
            from eaglet.models.kimi_k25 import KimiK25ForConditionalGeneration

            model: nn.Module = KimiK25ForConditionalGeneration(config)
        else:
            from eaglet.models.deepseek_v3 import DeepseekV3ForCausalLM

            model = DeepseekV3ForCausalLM(config.text)
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "bfloat16", show_progress: bool = True) -> tuple[nn.Module, ModelConfig]:
    config = load_model_config(model_dir)
    model = build_model(config, resolve_dtype(dtype))
    load_weights(model, model_dir, show_progress=show_progress)
    return model, config
