"""Row counts that keep PyTorch's float32 products batch invariant on CPU.

MKL's float32 products round a row differently depending on how many rows they multiply: a single
row, and (for some layouts) 2-15 rows against 16 or more, take different kernels
(tests/test_layer_fast_paths.py). Greedy speculation is lossless only if a verify pass gives each
token the bits plain decoding gives it, so the float32 products whose row count differs between
the two (absorbed attention, routing, small experts) run at no fewer rows than these. The
thresholds depend on the CPU MKL dispatches for: on AVX512 Xeons one row differs from two or
more, on an AVX512 EPYC (Zen 4) 1-3 rows differ from four or more, in bmm and F.linear alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_BMM_ROWS = 4  # [H, T, K] x [H, K, N] with row-major operands
MIN_GEMM_ROWS = 16  # F.linear, and bmm against a transposed operand (attention scores)


def rows_at_least(x: torch.Tensor, minimum: int, dim: int = 0) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to ``minimum`` entries; ``x`` itself when it has as many."""
    missing = minimum - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, missing]
    return F.pad(x, pad)
