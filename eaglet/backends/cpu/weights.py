"""Weight formats of eaglet's C++ kernels (``WeightMethods``): bfloat16 matrices in tile layout
(``amx_pack_weight``), multiplied by the build's tile GEMM (``eaglet.kernels.tile_backend()``:
AMX tiles, AVX512-BF16 or AVX2 dot products), and float32 matrices in 8-column panels
(``f32_pack_weight``, ``f32_linear``). For any row count each output row comes from its own
product chain, so a token's bits do not depend on how many rows share the call, or on how its
prompt was split into chunks.

Inputs the kernels do not take (another dtype, autograd: draft training) take the PyTorch form of
the same parameters.
"""

from __future__ import annotations

import torch

from eaglet.backends.base import ExpertsMethod, LinearMethod, SwiGLUMethod
from eaglet.backends.pytorch.weights import DenseLinear, TorchExperts, TorchSwiGLU, TorchWeightMethods, dense_linear


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.eaglet.amx_pack_weight(weight.detach().contiguous())


class TileLinear(DenseLinear):
    """A bfloat16 [out, in] weight (and bias) with its tile-layout copy ``tiles``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.tiles = _pack(weight)
        self.out_features = weight.shape[0]

    def _takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == self.weight.dtype and not torch.is_grad_enabled()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if not self._takes(x):
            return dense_linear(x, self.weight, self.bias)
        return torch.ops.eaglet.amx_linear(x, self.tiles, self.out_features, self.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel writes the bfloat16 results as float32 itself: the same values, without a
        # bfloat16 tensor and a conversion pass over [rows, vocab].
        if not self._takes(x):
            return dense_linear(x, self.weight, self.bias).float()
        return torch.ops.eaglet.amx_linear(x, self.tiles, self.out_features, self.bias, True)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        # An lm_head of 32000 columns at 16 rows: a 2 MB float32 tensor and a pass over it saved.
        if not self._takes(x):
            return None
        return torch.ops.eaglet.amx_linear_argmax(x, self.tiles, self.out_features, self.bias)


class PanelLinear(DenseLinear):
    """A float32 [out, in] weight (and bias) with its 8-column panel copy ``panels``: oneDNN's and
    MKL's float32 GEMMs block by the row count, so a row's bits would change with its batch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.panels = torch.ops.eaglet.f32_pack_weight(weight.detach())
        self.out_features = weight.shape[0]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_grad_enabled() or x.dim() == 0:
            return dense_linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.eaglet.f32_linear(rows, self.panels, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class TileSwiGLU:
    """gate_up [2I, H] and down [H, I] in tile layout, the whole MLP in one call (``amx_swiglu``)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, fallback: TorchWeightMethods) -> None:
        self.tiles = (_pack(gate_up), _pack(down))
        self.intermediate_size = down.shape[1]
        self.dtype = gate_up.dtype
        self.fallback = fallback.swiglu(gate_up, down)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.dim() != 2 or torch.is_grad_enabled():
            return self.fallback.apply(x)
        return torch.ops.eaglet.amx_swiglu(x, *self.tiles, self.intermediate_size)


class TileExperts:
    """Every routed expert's w13 / w2 in tile layout, stacked [E, ...], all of a layer's routed
    experts in one call (``moe_routed_experts``)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, fallback: TorchWeightMethods) -> None:
        self.tiles = (torch.stack([_pack(w) for w in w13.unbind(0)]), torch.stack([_pack(w) for w in w2.unbind(0)]))
        self.intermediate_size = w2.shape[2]
        self.dtype = w13.dtype
        self.fallback = fallback.experts(w13, w2)

    def apply(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or torch.is_grad_enabled():
            return self.fallback.apply(x, weights, expert_ids)
        return torch.ops.eaglet.moe_routed_experts(x, *self.tiles, weights, expert_ids, self.intermediate_size)


class CpuWeightMethods:
    """bfloat16 matrices in tile layout where this build has a tile GEMM (``tiles``), float32
    matrices in panels; others, and bfloat16 matrices without a tile GEMM, in the PyTorch
    backend's forms."""

    def __init__(self, fallback: TorchWeightMethods, tiles: bool) -> None:
        self.fallback = fallback
        self.tiles = tiles

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearMethod:
        if self._tiled(weight) and (bias is None or bias.dtype == weight.dtype):
            return TileLinear(weight, bias)
        if _panelled(weight) and (bias is None or bias.dtype == weight.dtype):
            return PanelLinear(weight, bias)
        return self.fallback.linear(weight, bias)

    def swiglu(self, gate_up: torch.Tensor, down: torch.Tensor) -> SwiGLUMethod:
        if self._tiled(gate_up):
            return TileSwiGLU(gate_up, down, self.fallback)
        if _panelled(gate_up):
            return TorchSwiGLU(PanelLinear(gate_up), PanelLinear(down))
        return self.fallback.swiglu(gate_up, down)

    def experts(self, w13: torch.Tensor, w2: torch.Tensor) -> ExpertsMethod:
        if self.tiles and w13.dtype == torch.bfloat16:
            return TileExperts(w13, w2, self.fallback)
        if w13.dtype == torch.float32:
            # Not every expert on every token: those batched products block by the token count.
            return TorchExperts(w13, w2, PanelLinear, dense_when_small=False)
        return self.fallback.experts(w13, w2)

    def absorbed_projections(self, w_uk: torch.Tensor, w_uv_t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # W_UK / W_UV come from the bfloat16 kv_b_proj: back in bfloat16 they are exact. The kernel's
        # tile projections need a latent that is a whole number of 16-wide tiles.
        if not self.tiles or dtype != torch.bfloat16 or w_uk.shape[-1] % 16:
            return ()
        return (
            torch.stack([_pack(w.t().bfloat16()) for w in w_uk]),  # [L, P] per head
            torch.stack([_pack(w.t().bfloat16()) for w in w_uv_t]),  # [V, L] per head
        )

    def _tiled(self, weight: torch.Tensor) -> bool:
        return self.tiles and weight.dtype == torch.bfloat16 and weight.dim() == 2


def _panelled(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.dim() == 2
