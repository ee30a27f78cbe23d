"""Quantized weights (``QuantizedMatrix``) multiplied by eaglet's C++ kernels: ``int4_linear`` and
``fp8_linear`` unpack the checkpoint's codes in registers and multiply in float32, each output one
product chain in k order, so a row's bits never depend on its batch (csrc/gemm_quant.cpp); with
``int8_activations`` int4 matrices run ``int4_linear_a8`` (W4A8, csrc/gemm_int4_a8.cpp); int8
matrices (made at load time) run ``int8_linear`` / ``int8_linear_a8`` (csrc/gemm_int8.cpp). A MoE
layer's routed experts run in one call (``quantized_routed_experts``, csrc/quant_layers.cpp: the
ops of ``QuantizedExperts`` in the same order, so the same bits). Under autograd the PyTorch form
of the same matrix runs instead.
"""

from __future__ import annotations

import torch

from eaglet.backends.pytorch.quantized_weights import DequantizingLinear, QuantizedExperts


class KernelQuantizedLinear(DequantizingLinear):
    def apply_float(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or torch.is_grad_enabled():
            return super().apply_float(x)
        weight = self.weight
        if weight.format == "int4":
            op = torch.ops.eaglet.int4_linear_a8 if self.int8_activations else torch.ops.eaglet.int4_linear
            out = op(x, weight.codes, weight.scales, weight.group_size)
        elif weight.format == "int8":
            op = torch.ops.eaglet.int8_linear_a8 if self.int8_activations else torch.ops.eaglet.int8_linear
            out = op(x, weight.codes, weight.scales, weight.group_size)
        else:
            out = torch.ops.eaglet.fp8_linear(x, weight.codes.view(torch.uint8), weight.scales, weight.group_size)
        return out if self.bias is None else out + self.bias.float()


class KernelQuantizedExperts(QuantizedExperts):
    def apply(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().apply(x, weights, expert_ids)
        w13, w2 = self.w13, self.w2
        codes = (w13.codes, w2.codes) if w13.format != "fp8" else (w13.codes.view(torch.uint8), w2.codes.view(torch.uint8))
        return torch.ops.eaglet.quantized_routed_experts(
            x, codes[0], w13.scales, codes[1], w2.scales, w13.group_size, w13.format, self.int8_activations, weights,
            expert_ids,
        )
