"""What this CPU runs fast: the default dtype policy for CPU inference."""

from __future__ import annotations

import torch

from eaglet.kernels.cpu_info import cpu_flags, cpu_vendor

# Instruction-set flags (as /proc/cpuinfo spells them) with which oneDNN runs bfloat16 GEMMs natively.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def packs_float32(vendor: str | None = None) -> bool:
    """Whether float32 weights get a oneDNN-packed copy (``backends.pytorch.weights.OneDnnLinear``): on AMD CPUs, where
    MKL's float32 GEMMs are slow (EPYC Zen 4: the 32000 x 512 lm_head at 16 rows 10.1 ms column-major
    through F.linear, 3.6 ms packed; 1.4-1.8x on the 512-wide projections at 16-64 rows, medians
    in one process). On Intel CPUs MKL keeps them (not measured against oneDNN there)."""
    return (cpu_vendor() if vendor is None else vendor) == "AuthenticAMD"


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return any(flag in (cpu_flags() if flags is None else flags) for flag in NATIVE_BF16_FLAGS)


def auto_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """bfloat16 where the CPU multiplies it natively (AMX / AVX512-BF16), else float32.

    Without native support a bfloat16 GEMM is emulated and runs several times slower than float32
    (measured 10-17 vs 85 GFLOP/s on an AVX2-only EPYC); with it, bfloat16 halves the bytes each
    decode step reads and its GEMMs are faster than float32's.
    """
    return torch.bfloat16 if has_native_bf16(flags) else torch.float32
