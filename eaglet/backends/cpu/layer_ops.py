"""A decoder layer's elementwise and per-token work in eaglet's C++ kernels (``LayerOps``).

The kernels do not record autograd graphs: under autograd (draft training) and for inputs they do
not take, the PyTorch ops run.
"""

from __future__ import annotations

import torch

from eaglet.backends.pytorch.layer_ops import TorchLayerOps


class CpuLayerOps:
    def __init__(self, fallback: TorchLayerOps) -> None:
        self.fallback = fallback

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != weight.dtype or torch.is_grad_enabled():
            return self.fallback.rms_norm(x, weight, eps)
        return torch.ops.eaglet.rms_norm(x, weight, eps)

    def rope_query_key(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not q_pe.dtype == cos.dtype == sin.dtype or torch.is_grad_enabled():
            return self.fallback.rope_query_key(q_pe, k_pe, cos, sin, interleave)
        return torch.ops.eaglet.rope_query_key(q_pe, k_pe, cos, sin, interleave)

    def noaux_route(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
        norm_topk_prob: bool, routed_scaling_factor: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled():
            return self.fallback.noaux_route(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
        return torch.ops.eaglet.noaux_route(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
