"""Backends: one object per engine that decides what computes (``base.Backend``).

``select_backend`` picks eaglet's C++ kernels where they build on this machine and the engine asks
for them, else PyTorch ops; either way every caller goes through the same interfaces.
"""

from __future__ import annotations

import functools
import logging

from eaglet import kernels
from eaglet.backends.base import Backend
from eaglet.backends.cpu.cache_ops import CpuCacheOps
from eaglet.backends.cpu.decoder_stack import build_decoder_stack
from eaglet.backends.cpu.layer_ops import CpuLayerOps
from eaglet.backends.cpu.mla_attention import CpuMLAAttention
from eaglet.backends.cpu.quantized_weights import KernelQuantizedExperts, KernelQuantizedLinear
from eaglet.backends.cpu.sampling_ops import CpuSamplingOps
from eaglet.backends.cpu.spec_ops import CpuSpecOps
from eaglet.backends.cpu.weights import CpuWeightMethods
from eaglet.backends.pytorch.cache_ops import TorchCacheOps
from eaglet.backends.pytorch.layer_ops import TorchLayerOps
from eaglet.backends.pytorch.mla_attention import TorchMLAAttention
from eaglet.backends.pytorch.sampling_ops import TorchSamplingOps
from eaglet.backends.pytorch.spec_ops import TorchSpecOps
from eaglet.backends.pytorch.quantized_weights import QuantizedWeightMethods
from eaglet.backends.pytorch.weights import TorchWeightMethods
from eaglet.backends.stack import DecoderStack, StackConfig, StackLayer

__all__ = ["Backend", "cpu_backend", "select_backend", "torch_backend"]

logger = logging.getLogger(__name__)


@functools.cache
def torch_backend(fallback_reason: str | None = None, int8_activations: bool = False) -> Backend:
    """PyTorch ops for everything (``fallback_reason``: why an engine runs them instead of the kernels;
    ``int8_activations``: int4 weights meet activations quantized to int8, W4A8)."""
    sampling = TorchSamplingOps()
    return Backend(
        name="pytorch", layers=TorchLayerOps(), sampling=sampling, spec=TorchSpecOps(sampling), cache=TorchCacheOps(),
        weights=QuantizedWeightMethods(TorchWeightMethods(), int8_activations=int8_activations),
        mla_attention=TorchMLAAttention, decoder_stack=_no_stack, fallback_reason=fallback_reason,
        int8_activations=int8_activations,
    )


def _no_stack(config: StackConfig, layers: list[StackLayer]) -> DecoderStack | None:
    return None


@functools.cache
def cpu_backend(int8_activations: bool = False) -> Backend:
    """eaglet's C++ kernels (they must be available: ``eaglet.kernels.available()``): bfloat16
    matrices in tile layout where the build has a tile GEMM, the decoder stack; PyTorch ops where a
    kernel does not take an input (autograd, another dtype or device). ``int8_activations``: int4
    weights meet activations quantized to int8 (W4A8)."""
    if not kernels.available():
        raise RuntimeError(f"eaglet CPU kernels unavailable: {kernels.unavailable_reason()}")
    torch_ops = torch_backend()
    return Backend(
        name="cpu", layers=CpuLayerOps(torch_ops.layers), sampling=CpuSamplingOps(torch_ops.sampling),
        spec=CpuSpecOps(torch_ops.spec), cache=CpuCacheOps(torch_ops.cache),
        weights=QuantizedWeightMethods(
            CpuWeightMethods(torch_ops.weights.inner, tiles=kernels.tile_backend() is not None), KernelQuantizedLinear,
            int8_activations=int8_activations, experts=KernelQuantizedExperts,
        ),
        mla_attention=CpuMLAAttention, decoder_stack=build_decoder_stack, tile_gemm=kernels.tile_backend() is not None,
        int8_activations=int8_activations,
    )


def select_backend(cpu_kernels: bool = True, int8_activations: bool = False) -> Backend:
    """The C++ kernels when asked for and they build here, else PyTorch ops (saying why)."""
    if not cpu_kernels:
        return torch_backend("turned off (cpu_kernels=False)", int8_activations)
    if not kernels.available():
        reason = f"eaglet CPU kernels unavailable: {kernels.unavailable_reason()}"
        logger.warning("%s; running PyTorch ops", reason)
        return torch_backend(reason, int8_activations)
    return cpu_backend(int8_activations)
