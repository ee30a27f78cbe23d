"""Quantized weights (``QuantizedMatrix``) multiplied by eaglet's C++ kernels: ``int4_linear`` and
``fp8_linear`` unpack the checkpoint's codes in registers and multiply in float32, each output one
product chain in k order, so a row's bits never depend on its batch (csrc/gemm_quant.cpp); with
``int8_activations`` int4 matrices run ``int4_linear_a8`` (W4A8, csrc/gemm_int4_a8.cpp).
Under autograd the PyTorch form of the same matrix runs instead.
"""

from __future__ import annotations

import torch

from eaglet.backends.pytorch.quantized_weights import DequantizingLinear


class KernelQuantizedLinear(DequantizingLinear):
    def apply_float(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or torch.is_grad_enabled():
            return super().apply_float(x)
        weight = self.weight
        if self.int8_activations:
            out = torch.ops.eaglet.int4_linear_a8(x, weight.codes, weight.scales, weight.group_size)
        elif weight.format == "int4":
            out = torch.ops.eaglet.int4_linear(x, weight.codes, weight.scales, weight.group_size)
        else:
            out = torch.ops.eaglet.fp8_linear(x, weight.codes.view(torch.uint8), weight.scales, weight.group_size)
        return out if self.bias is None else out + self.bias.float()
