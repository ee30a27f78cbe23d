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


def auto_dtype(flags: frozenset[str] | None = None, tile_gemm: bool = False) -> torch.dtype:
    """bfloat16 where the CPU multiplies it natively (AMX / AVX512-BF16) or eaglet's tile GEMM
    does (``tile_gemm``: AVX2 widens bfloat16 in registers), else float32.

    Emulated by oneDNN without native support a bfloat16 GEMM runs several times slower than
    float32 (measured 10-17 vs 85 GFLOP/s on an AVX2-only EPYC); natively or on the tile GEMM,
    bfloat16 halves the bytes each decode step reads and decodes faster than float32.
    """
    return torch.bfloat16 if tile_gemm or has_native_bf16(flags) else torch.float32
