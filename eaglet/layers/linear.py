"""x @ W^T for the model's [out, in] weights, with the GEMM form that is fastest on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.backends.cpu_caps import has_native_bf16, packs_float32

# Row counts for which float32 `W @ x^T` beats F.linear: decode / verify batches of a few requests.
# One row is a GEMV (F.linear is as fast); from about 64 rows on F.linear's blocking wins.
SMALL_BATCH_ROWS = range(8, 33)

# oneDNN picks the blocked layout of a packed weight for a typical row count; any row count runs on it.
PACK_ROWS_HINT = 16
# Row counts a packed GEMM runs at exactly: up to EXACT_ROWS (decode and verify batches of a few
# requests) and above PADDED_MAX_ROWS (prefill chunks, where the GEMM outweighs compiling its kernel
# and padding would only add work); see padded_rows.
EXACT_ROWS = 16
PADDED_MAX_ROWS = 1024
_PACKED = "_eaglet_packed"  # attribute of a weight tensor: (its oneDNN-packed copy, weight._version then)
AMX_PACKED = "_eaglet_amx"  # attribute of a weight tensor: (its AMX tile-layout copy, weight._version then)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the weight's AMX copy (``pack_weight_for_amx``) or
    oneDNN-packed copy (``pack_weight``) where one was made.

    Without one: computed as ``(W @ x^T)^T`` for small float32 batches, since MKL's float32 GEMM for
    F.linear's [rows, in] x [in, out] form is slow for a handful of rows while the transposed
    product streams W row by row (measured 1.3-4x faster on an AVX2 EPYC). A column-major weight
    (the float32 lm_head, deepseek_v3.py) is already in the layout F.linear streams.
    """
    tiles = _amx_tiles_for(x, weight, bias)
    if tiles is not None:
        return torch.ops.eaglet.amx_linear(x, tiles, weight.shape[0], bias)
    packed = getattr(weight, _PACKED, None)
    if packed is not None and packed[1] == weight._version and not torch.is_grad_enabled():
        rows = x.shape[0] if x.dim() == 2 else 0
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, packed[0], bias, "none", [], "")
        x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, packed[0], bias, "none", [], "")[:rows]
    if weight.dtype == torch.float32 and x.dim() == 2 and x.shape[0] in SMALL_BATCH_ROWS and weight.is_contiguous():
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def logits_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, weight, bias).float()`` (an lm_head's logits): through the AMX copy, the kernel
    writes the bfloat16 results as float32 itself (the same values, without a bfloat16 tensor and a
    conversion pass over [rows, vocab])."""
    tiles = _amx_tiles_for(x, weight, bias)
    if tiles is not None:
        return torch.ops.eaglet.amx_linear(x, tiles, weight.shape[0], bias, True)
    return linear(x, weight, bias).float()


def logits_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``logits_linear(x, weight, bias).argmax(-1)`` in one tile-layout kernel that never writes the
    logits (for an lm_head of 32000 columns at 16 rows: a 2 MB float32 tensor and a pass over it saved), or
    None where the weight has no AMX copy: the caller then takes the logits."""
    tiles = _amx_tiles_for(x, weight, bias)
    if tiles is None:
        return None
    return torch.ops.eaglet.amx_linear_argmax(x, tiles, weight.shape[0], bias)


def _amx_tiles_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The weight's AMX copy where ``linear`` multiplies on it: inference, 2-D inputs of the weight's
    dtype, at most PADDED_MAX_ROWS rows (prefill chunks above take F.linear: as fast there, and no
    verify pass has to reproduce their bits)."""
    tiles = amx_tiles(weight)
    if (tiles is not None and x.dim() == 2 and x.shape[0] <= PADDED_MAX_ROWS
            and x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype) and not torch.is_grad_enabled()):
        return tiles
    return None


def amx_tiles(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's AMX tile-layout copy (``pack_weight_for_amx``), or None when it has none or
    was changed in place since."""
    packed = getattr(weight, AMX_PACKED, None)
    return packed[0] if packed is not None and packed[1] == weight._version else None


def padded_rows(rows: int) -> int:
    """The row count a packed GEMM of ``rows`` rows runs at: exact up to EXACT_ROWS and above
    PADDED_MAX_ROWS, in between rounded up to one of four steps per power of two (at most 25% padding).

    oneDNN compiles a kernel for every new row count (about 0.5 ms, and 0.6-1.6 MB that stays in its
    primitive cache) and keeps the 1024 used last; draft-extend batches and the tokens routed to each
    expert take hundreds of row counts, enough to evict and recompile in steady decoding. Padding
    moves a GEMM to the kernel of another row count, as sharing a batch does; at the sizes the tests
    build both give the same bits per row (tests/test_layer_fast_paths.py), while for K = 7168 oneDNN
    rounds differently above 32 rows than below. Prefill chunks above PADDED_MAX_ROWS run once
    each: they are the entries the cache evicts first.
    """
    if rows <= EXACT_ROWS or rows > PADDED_MAX_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def pack_weight(weight: torch.Tensor) -> None:
    """Attaches a oneDNN-blocked copy of a bfloat16 or float32 [out, in] weight, which ``linear``
    then uses.

    On CPUs with AMX / AVX512-BF16, F.linear reorders a bfloat16 weight on every call; the packed
    copy runs the same GEMM (bit-identical results, tests/test_layer_fast_paths.py) 1.1-2.1x faster
    for decode-sized batches (benchmarks/bench_linear.py). A float32 copy runs oneDNN's GEMM in
    place of MKL's (``cpu_caps.packs_float32``): values within float32 rounding of F.linear's, a
    row's the same at any row count at the tested widths. It costs a second copy of the weight. A
    weight changed in place afterwards (an optimizer step) bumps its version and is read directly again.
    """
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    setattr(weight, _PACKED, (packed, weight._version))


def should_pack(dtype: torch.dtype) -> bool:
    """bfloat16 where the CPU multiplies it natively, float32 where oneDNN beats MKL (``packs_float32``)."""
    native = (dtype == torch.bfloat16 and has_native_bf16()) or (dtype == torch.float32 and packs_float32())
    return native and torch.backends.mkldnn.is_available()


def pack_for_inference(model: nn.Module) -> int:
    """Packs the bfloat16 matrices that inference reads through ``linear`` (see ``pack_weight``),
    when this CPU multiplies bfloat16 natively. Each module lists its own in ``packable_weights()``.
    Returns the number of matrices packed."""
    count = 0
    for module in model.modules():
        for weight in module.packable_weights() if hasattr(module, "packable_weights") else ():
            if weight.dim() == 2 and should_pack(weight.dtype) and not hasattr(weight, _PACKED):
                pack_weight(weight)
                count += 1
    return count


def pack_weight_for_amx(weight: torch.Tensor) -> None:
    """Attaches the tile-layout copy of a bfloat16 [out, in] weight that ``linear`` then multiplies
    with eaglet's tile-layout kernel (torch.ops.eaglet.amx_linear, eaglet/kernels) for any row count:
    each output row comes from its own tile row, so a token's bits do not depend on how many rows share
    the call. Replaces the oneDNN copy (``pack_weight``), whose rounding changes with the row count
    at some shapes."""
    packed = torch.ops.eaglet.amx_pack_weight(weight.detach())
    setattr(weight, AMX_PACKED, (packed, weight._version))
    if hasattr(weight, _PACKED):
        delattr(weight, _PACKED)
