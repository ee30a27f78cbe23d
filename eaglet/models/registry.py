"""Which model class runs which checkpoint, and how to build and load one.

A target architecture is one model file plus one line in ``MODELS``: its ``model_type`` (as
config.json spells it), the class (built by ``from_model_config``), the config.json parser, and the
weight loader (the shared one, ``loader.load_weights``, unless the model needs its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eaglet.backends.base import Backend
from eaglet.backends.cpu_caps import auto_dtype
from eaglet.distributed.tensor_parallel import TensorParallel
from eaglet.errors import ConfigError
from eaglet.models.config import ModelConfig, read_config_json
from eaglet.models.deepseek_v3 import DeepseekV3ForCausalLM, parse_deepseek_v3_config
from eaglet.models.kimi_k25 import KimiK25ForConditionalGeneration, parse_kimi_k25_config
from eaglet.models.load_time_quantization import LoadTimeQuantization
from eaglet.models.loader import load_weights, skip_init


@dataclass(frozen=True)
class ModelEntry:
    model_class: type[nn.Module]  # with a from_model_config(ModelConfig, Backend, TensorParallel) constructor
    parse_config: Callable[[dict], ModelConfig]
    load_weights: Callable[..., None] = load_weights


MODELS: dict[str, ModelEntry] = {
    "deepseek_v3": ModelEntry(DeepseekV3ForCausalLM, parse_deepseek_v3_config),
    "kimi_k2": ModelEntry(DeepseekV3ForCausalLM, parse_deepseek_v3_config),
    "kimi_k25": ModelEntry(KimiK25ForConditionalGeneration, parse_kimi_k25_config),
}

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def entry_for(raw: dict) -> ModelEntry:
    model_type = raw.get("model_type")
    if model_type not in MODELS:
        raise ConfigError(f"unsupported model_type {model_type!r}; eaglet runs {', '.join(MODELS)}")
    return MODELS[model_type]


def parse_model_config(raw: dict) -> ModelConfig:
    """The ModelConfig of a config.json's contents, by its model_type's parser."""
    return entry_for(raw).parse_config(raw)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    return parse_model_config(read_config_json(model_dir))


def resolve_dtype(dtype: str | torch.dtype, tile_gemm: bool = False) -> torch.dtype:
    """A supported torch dtype from its name; ``"auto"`` picks what this CPU runs fastest
    (cpu_caps; ``tile_gemm``: the engine's backend multiplies bfloat16 on eaglet's tile GEMM)."""
    if dtype == "auto":
        return auto_dtype(tile_gemm=tile_gemm)
    if isinstance(dtype, torch.dtype):
        if dtype not in SUPPORTED_DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
        return dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose 'auto' or one of {sorted(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[dtype]


def build_model(config: ModelConfig, dtype: torch.dtype, backend: Backend, tp: TensorParallel | None = None) -> nn.Module:
    """The model's modules (this tensor-parallel rank's share of them), weights uninitialised."""
    with skip_init(dtype):
        model = MODELS[config.architecture].model_class.from_model_config(config, backend, tp)
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "bfloat16", *, backend: Backend, show_progress: bool = True,
    quantize: LoadTimeQuantization | None = None, tp: TensorParallel | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """The model of a checkpoint directory, loaded; ``quantize``: its plain matrices quantized at
    load time (``load_time_quantization``); ``tp``: only this tensor-parallel rank's slices are read."""
    raw = read_config_json(model_dir)
    entry = entry_for(raw)
    config = entry.parse_config(raw)
    model = build_model(config, resolve_dtype(dtype), backend, tp)
    entry.load_weights(model, model_dir, show_progress=show_progress, quantization=config.quantization, quantize=quantize)
    return model, config
