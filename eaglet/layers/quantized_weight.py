"""Layers' weights that a checkpoint may store quantized (``QuantizedMatrix``).

A module whose weight the checkpoint stores quantized keeps the quantized matrix as
``quantized_weight`` and its ``weight`` parameter becomes a meta tensor: the logical shape and the
model's dtype, no memory. Its parent hands ``loaded_weight()`` to the backend's weight methods,
which multiply either form.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglet.backends.quantized_matrix import QuantizedMatrix, cat_rows
from eaglet.distributed.tensor_parallel import TensorShard


class QuantizableWeight:
    """Mixin for an ``nn.Linear`` whose weight may arrive quantized."""

    quantized_weight: QuantizedMatrix | None = None
    weight: nn.Parameter
    # Under tensor parallelism: the slice of the checkpoint's weight (and, split by rows, bias) this
    # rank holds; None holds it whole.
    tensor_shard: TensorShard | None = None

    def hold_quantized(self, matrix: QuantizedMatrix) -> None:
        self.quantized_weight = matrix
        self.weight = meta_parameter(self.weight)

    def loaded_weight(self) -> torch.Tensor | QuantizedMatrix:
        """The weight as the checkpoint gave it: its quantized form, else the parameter."""
        return self.quantized_weight if self.quantized_weight is not None else self.weight.detach()


class WeightHolder(QuantizableWeight, nn.Linear):
    """A parameter holder that its parent multiplies, alone or fused with others (SwiGLU's gate, up
    and down, MLA's two down-projections)."""


def sharded(module: QuantizableWeight, shard: TensorShard | None) -> QuantizableWeight:
    """``module``, loading only ``shard`` of its checkpoint weight."""
    module.tensor_shard = shard
    return module


def meta_parameter(param: torch.Tensor) -> nn.Parameter:
    """A stand-in with ``param``'s shape and dtype and no storage."""
    return nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)


def cat_weights(parts: list[torch.Tensor | QuantizedMatrix]) -> torch.Tensor | QuantizedMatrix:
    """Weights stacked by rows, all plain or all quantized alike."""
    if all(isinstance(p, QuantizedMatrix) for p in parts):
        return cat_rows(parts)
    if any(isinstance(p, QuantizedMatrix) for p in parts):
        raise ValueError("matrices multiplied as one are quantized all alike or not at all")
    return torch.cat(parts)
