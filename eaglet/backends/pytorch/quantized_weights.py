"""Quantized weights (``QuantizedMatrix``) in PyTorch ops: each call dequantizes a tile of output
rows at a time and multiplies it in float32, so no full-precision
copy of the matrix exists and a row's result does not depend on the other rows of its call (the
rows are padded to ``MIN_GEMM_ROWS``, from which on MKL's float32 product rounds every row alike).
With ``int8_activations`` an int4 or int8 matrix meets x rounded to Q8_0's int8 values first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eaglet.backends.base import ExpertsMethod, LinearMethod, SwiGLUMethod, WeightMethods
from eaglet.backends.pytorch.gemm_rows import MIN_GEMM_ROWS, rows_at_least
from eaglet.backends.pytorch.weights import TorchSwiGLU
from eaglet.backends.quantized_matrix import INTEGER_FORMATS, QuantizedMatrix, int8_activation_values

# Output rows dequantized at a time: 128 rows of 7168 float32 values are 3.5 MB, about L2-L3 sized.
TILE_ROWS = 128


class DequantizingLinear:
    """x @ W^T (+ bias) for a 2-D quantized W, tile by tile in float32, rounded to x's dtype once."""

    def __init__(self, weight: QuantizedMatrix, bias: torch.Tensor | None = None, int8_activations: bool = False) -> None:
        if len(weight.shape) != 2:
            raise ValueError(f"a quantized linear takes a 2-D matrix, got shape {list(weight.shape)}")
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.int8_activations = int8_activations and weight.format in INTEGER_FORMATS

    def apply_float(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 product [T, out] (bias added in float32)."""
        rows = x.shape[0]
        x32 = rows_at_least(int8_activation_values(x) if self.int8_activations else x.float(), MIN_GEMM_ROWS)
        out = torch.empty(x32.shape[0], self.out_features)
        for start in range(0, self.out_features, TILE_ROWS):
            stop = min(start + TILE_ROWS, self.out_features)
            tile = self.weight.rows(start, stop).dequantize(torch.float32)
            torch.mm(x32, tile.t(), out=out[:, start:stop])
        out = out[:rows]
        return out if self.bias is None else out + self.bias.float()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_float(x).to(x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_float(x)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        return None


class QuantizedExperts:
    """Routed experts with quantized w13 [E, 2I, H] / w2 [E, H, I]: the tokens of each chosen expert
    in one product per matrix, then each token's experts summed in float32 in ascending expert id,
    an order that depends on the token's own routing only."""

    def __init__(
        self, w13: QuantizedMatrix, w2: QuantizedMatrix, linear: Callable[[QuantizedMatrix], LinearMethod],
        int8_activations: bool = False,
    ) -> None:
        if (w13.format, w13.group_size) != (w2.format, w2.group_size):
            raise ValueError("a layer's routed experts are quantized all alike")
        self.w13, self.w2 = w13, w2
        self.int8_activations = int8_activations and w13.format in INTEGER_FORMATS
        self.num_experts = w13.shape[0]
        self.per_expert = [
            TorchSwiGLU(linear(w13[e]), linear(w2[e])) for e in range(self.num_experts)
        ]

    def apply(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = expert_ids.shape
        if num_tokens == 1:
            return self._one_token(x, weights, expert_ids)
        # Each token's slots in ascending expert id: the order its outputs are summed in.
        slot_order = expert_ids.argsort(dim=1, stable=True)
        ids = expert_ids.gather(1, slot_order)
        scale = weights.float().gather(1, slot_order)
        flat_ids = ids.reshape(-1)
        expert_out = torch.empty(num_tokens * top_k, x.shape[1])
        for expert in flat_ids.unique().tolist():
            picks = (flat_ids == expert).nonzero().squeeze(1)
            expert_out[picks] = self.per_expert[expert].apply(x[picks // top_k]).float()
        expert_out = expert_out.view(num_tokens, top_k, -1)
        out = expert_out[:, 0] * scale[:, :1]
        for k in range(1, top_k):
            out = out + expert_out[:, k] * scale[:, k : k + 1]
        return out.to(x.dtype)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Batch-1 decode without the grouping: the same products and the same sum order."""
        ids, scale = expert_ids[0].tolist(), weights[0].float()
        out = None
        for k in sorted(range(len(ids)), key=ids.__getitem__):
            term = self.per_expert[ids[k]].apply(x).float() * scale[k]
            out = term if out is None else out + term
        return out.to(x.dtype)


class QuantizedWeightMethods:
    """``WeightMethods`` that multiply quantized matrices with ``linear`` (a class like
    ``DequantizingLinear``, its int4 matrices against int8 activations where ``int8_activations``)
    and routed experts with ``experts`` (like ``QuantizedExperts``), and hand every other matrix to
    ``inner``."""

    def __init__(
        self, inner: WeightMethods, linear: type = DequantizingLinear, int8_activations: bool = False,
        experts: type = QuantizedExperts,
    ) -> None:
        self.inner, self.linear_type, self.int8_activations = inner, linear, int8_activations
        self.experts_type = experts

    def linear_class(self, weight: QuantizedMatrix, bias: torch.Tensor | None = None) -> LinearMethod:
        return self.linear_type(weight, bias, int8_activations=self.int8_activations)

    def linear(self, weight: torch.Tensor | QuantizedMatrix, bias: torch.Tensor | None = None) -> LinearMethod:
        if isinstance(weight, QuantizedMatrix):
            return self.linear_class(weight, bias)
        return self.inner.linear(weight, bias)

    def swiglu(self, gate_up: torch.Tensor | QuantizedMatrix, down: torch.Tensor | QuantizedMatrix) -> SwiGLUMethod:
        if isinstance(gate_up, QuantizedMatrix) or isinstance(down, QuantizedMatrix):
            return TorchSwiGLU(self.linear(gate_up), self.linear(down))
        return self.inner.swiglu(gate_up, down)

    def experts(self, w13: torch.Tensor | QuantizedMatrix, w2: torch.Tensor | QuantizedMatrix) -> ExpertsMethod:
        if isinstance(w13, QuantizedMatrix) and isinstance(w2, QuantizedMatrix):
            return self.experts_type(w13, w2, self.linear_class, self.int8_activations)
        if isinstance(w13, QuantizedMatrix) or isinstance(w2, QuantizedMatrix):
            raise ValueError("a layer's routed experts are quantized all alike or not at all")
        return self.inner.experts(w13, w2)

    def absorbed_projections(self, w_uk: torch.Tensor, w_uv_t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.inner.absorbed_projections(w_uk, w_uv_t, dtype)
