"""Quantization at load time (``--quantization int4``): a plain checkpoint's routed experts become
int4 matrices in Kimi-K2.5's published form (symmetric, one bfloat16 scale per 32 columns), the
same ``QuantizedMatrix`` a quantized checkpoint loads, multiplied by the same methods."""

from __future__ import annotations

from torch import nn

from eaglet.backends.quantized_matrix import quantize_int4
from eaglet.errors import ConfigError
from eaglet.layers.moe import RoutedExperts

LOAD_TIME_FORMATS = ("int4",)
INT4_GROUP_SIZE = 32


def quantize_routed_experts(model: nn.Module, fmt: str) -> None:
    """Every plain routed expert of ``model`` quantized to ``fmt`` (experts the checkpoint stores
    quantized stay as stored). Runs after the weights are read, before the modules prepare them."""
    if fmt not in LOAD_TIME_FORMATS:
        raise ConfigError(f"quantization {fmt!r} is not supported at load time; choose one of {LOAD_TIME_FORMATS}")
    for module in model.modules():
        if isinstance(module, RoutedExperts) and not module.quantized_parts:
            for suffix, weight in module.checkpoint_weights("").items():
                if weight.shape[-1] % INT4_GROUP_SIZE:
                    raise ConfigError(
                        f"--quantization int4: {suffix} has {weight.shape[-1]} input columns, not a multiple of "
                        f"the group of {INT4_GROUP_SIZE}"
                    )
                module.hold_quantized(suffix, quantize_int4(weight, INT4_GROUP_SIZE))
