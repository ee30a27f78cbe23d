"""x @ W^T for the model's [out, in] weights, with the GEMM form that is fastest on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row counts for which float32 `W @ x^T` beats F.linear: decode / verify batches of a few requests.
# One row is a GEMV (F.linear is as fast); from about 64 rows on F.linear's blocking wins.
SMALL_BATCH_ROWS = range(8, 33)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D ``x``, computed as ``(W @ x^T)^T`` for small float32 batches.

    MKL's float32 GEMM for F.linear's [rows, in] x [in, out] form is slow for a handful of rows,
    while the transposed product streams W row by row (measured 1.3-4x faster on an AVX2 EPYC).
    """
    if weight.dtype == torch.float32 and x.shape[0] in SMALL_BATCH_ROWS and x.dim() == 2:
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)
