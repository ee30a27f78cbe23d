"""Quantization at load time (``--quantization int4`` / ``int8``): a plain checkpoint's matrices
become int4 in Kimi-K2.5's published form (symmetric, one bfloat16 scale per 32 columns), or int8
by the same rule, the same ``QuantizedMatrix`` a quantized checkpoint loads, multiplied by the same
methods.

``layers`` says which: ``experts`` (the routed experts, as Kimi-K2.5 ships) or ``all`` (every linear
layer of the language model, lm_head included, as llama.cpp's 4-bit files do; the vision tower,
the router, an lm_head tied to the embeddings and a matrix whose input width is not a multiple of
the group stay as loaded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from eaglet.backends.quantized_matrix import QuantizedMatrix, quantize_int4, quantize_int8
from eaglet.errors import ConfigError
from eaglet.layers.moe import RoutedExperts
from eaglet.layers.quantized_weight import QuantizableWeight

QUANTIZERS = {"int4": quantize_int4, "int8": quantize_int8}
LOAD_TIME_FORMATS = tuple(QUANTIZERS)
QUANTIZED_LAYERS = ("experts", "all")
GROUP_SIZE = 32

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadTimeQuantization:
    format: str  # one of LOAD_TIME_FORMATS
    layers: str = "experts"  # one of QUANTIZED_LAYERS

    def __post_init__(self) -> None:
        if self.format not in LOAD_TIME_FORMATS:
            raise ConfigError(
                f"quantization {self.format!r} is not supported at load time; choose one of {LOAD_TIME_FORMATS}"
            )
        if self.layers not in QUANTIZED_LAYERS:
            raise ConfigError(f"quantized_layers={self.layers!r}: choose one of {QUANTIZED_LAYERS}")


def quantize_at_load(model: nn.Module, quantize: LoadTimeQuantization) -> None:
    """``model``'s plain matrices that ``quantize.layers`` names quantized to ``quantize.format``
    (those the checkpoint stores quantized stay as stored). Runs after the weights are read, before
    the modules prepare them."""
    language_model = getattr(model, "language_model", model)
    for module in language_model.modules():
        if isinstance(module, RoutedExperts) and not module.quantized_parts:
            for suffix, weight in module.checkpoint_weights("").items():
                module.hold_quantized(suffix, _quantized(weight, suffix, quantize.format))
    if quantize.layers == "all":
        tied = _tied_modules(model)
        kept = []
        for name, module in language_model.named_modules():
            if isinstance(module, QuantizableWeight) and module.quantized_weight is None and module not in tied:
                if module.weight.shape[-1] % GROUP_SIZE:
                    kept.append(name)
                else:
                    module.hold_quantized(QUANTIZERS[quantize.format](module.weight.detach(), GROUP_SIZE))
        if kept:
            logger.warning(
                "--quantized-layers all: %d matrices kept as loaded, their input widths not a multiple of the group of "
                "%d: %s", len(kept), GROUP_SIZE, ", ".join(kept),
            )


def _quantized(weight: torch.Tensor, name: str, fmt: str) -> QuantizedMatrix:
    if weight.shape[-1] % GROUP_SIZE:
        raise ConfigError(
            f"--quantization {fmt}: {name} has {weight.shape[-1]} input columns, not a multiple of the group of {GROUP_SIZE}"
        )
    return QUANTIZERS[fmt](weight, GROUP_SIZE)


def _tied_modules(model: nn.Module) -> set[nn.Module]:
    """Modules whose weight is another module's parameter (an lm_head tied to the embeddings)."""
    tied: set[nn.Module] = set()
    for module in model.modules():
        if hasattr(module, "tied_weights"):
            for alias in module.tied_weights():
                tied.add(module.get_submodule(alias.rpartition(".")[0]))
    return tied
