"""A linear layer whose matrix is multiplied in its backend's weight format.

The module keeps the checkpoint's parameters (``weight`` [out, in], ``bias``); after loading, the
backend's ``WeightMethods.linear`` makes the method that multiplies them (a packed copy, a tile
layout, the matrix as it is, or its quantized form). Before that, and under autograd (draft training), the module
multiplies the parameters themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglet.backends.base import LinearMethod, WeightMethods
from eaglet.backends.pytorch.weights import dense_linear
from eaglet.layers.quantized_weight import QuantizableWeight


class Linear(QuantizableWeight, nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, weights: WeightMethods) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.weights = weights
        self.method: LinearMethod | None = None

    def process_weights_after_loading(self) -> None:
        self.method = self.weights.linear(self.loaded_weight(), None if self.bias is None else self.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is None or torch.is_grad_enabled():
            return dense_linear(x, self.weight, self.bias)
        return self.method.apply(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``: an lm_head's logits."""
        if self.method is None or torch.is_grad_enabled():
            return self.forward(x).float()
        return self.method.logits(x)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """``logits(x).argmax(-1)`` without the logits where the weight format can; else None."""
        if self.method is None or torch.is_grad_enabled():
            return None
        return self.method.argmax(x)
