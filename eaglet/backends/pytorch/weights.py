"""Weight formats in PyTorch ops (``WeightMethods``): plain matrices, and oneDNN-packed copies where
this CPU multiplies them faster.

A packed copy is made from the parameter when the method is made and used while the parameter is
unchanged (an in-place change, an optimizer step, bumps its version) and no gradient is needed
(draft training multiplies the parameter itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglet.backends.base import LinearMethod
from eaglet.backends.cpu_caps import has_native_bf16, packs_float32
from eaglet.backends.pytorch.gemm_rows import MIN_BMM_ROWS, rows_at_least

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
# Routed experts that together fit in cache run every expert on every token of a decode-sized batch
# (two batched matmuls) instead of routing's sort / gather / scatter.
DENSE_MAX_WEIGHT_BYTES = 1 << 20
DENSE_MAX_TOKENS = 64


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), as ``(W @ x^T)^T`` for small float32 batches: MKL's float32 GEMM
    for F.linear's [rows, in] x [in, out] form is slow for a handful of rows while the transposed
    product streams W row by row (1.3-4x faster on an AVX2 EPYC). A column-major weight (the float32
    lm_head, deepseek_v3.py) is already in the layout F.linear streams."""
    if weight.dtype == torch.float32 and x.dim() == 2 and x.shape[0] in SMALL_BATCH_ROWS and weight.is_contiguous():
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


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


def should_pack(dtype: torch.dtype) -> bool:
    """bfloat16 where the CPU multiplies it natively, float32 where oneDNN beats MKL (``packs_float32``)."""
    native = (dtype == torch.bfloat16 and has_native_bf16()) or (dtype == torch.float32 and packs_float32())
    return native and torch.backends.mkldnn.is_available()


class DenseLinear:
    """The matrix as it is, through ``dense_linear`` (reads the parameter at every call)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x).float()

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        return None


class OneDnnLinear(DenseLinear):
    """A oneDNN-blocked copy of a bfloat16 or float32 weight.

    Where the CPU multiplies bfloat16 natively, F.linear reorders a bfloat16 weight on every call;
    the packed copy runs the same GEMM (bit-identical results, tests/test_layer_fast_paths.py)
    1.1-2.1x faster for decode-sized batches. A float32 copy runs oneDNN's GEMM in place of MKL's
    (``cpu_caps.packs_float32``): values within float32 rounding of F.linear's, a row's the same at
    any row count at the tested widths. It costs a second copy of the weight.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        self.version = weight._version

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight._version != self.version or torch.is_grad_enabled():
            return super().apply(x)
        rows = x.shape[0] if x.dim() == 2 else 0
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]


class TorchSwiGLU:
    """down(silu(gate(x)) * up(x)), gate;up and down each multiplied by its own linear method."""

    def __init__(self, gate_up: LinearMethod, down: LinearMethod) -> None:
        self.gate_up, self.down = gate_up, down

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.apply(x).chunk(2, dim=-1)
        return self.down.apply(F.silu(gate) * up)


class TorchExperts:
    """Routed experts in PyTorch ops: tokens grouped by expert (one sort), then each active expert
    runs one matmul over its tokens.

    When all experts together are small (at most ``DENSE_MAX_WEIGHT_BYTES``: they stay in cache) a
    decode-sized batch instead runs every expert on every token in two batched matmuls and
    combines them with the routing weights (zero for unchosen experts): the extra arithmetic costs
    less than routing's sort / gather / scatter (2-3x faster for the demo model's 4 experts of
    128 x 128 at 4-16 tokens, slower for 8 experts of 512 x 256). ``dense_when_small=False`` turns
    that off where a token's bits must not depend on its batch (batched products block by its size).
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, linear: type[DenseLinear], dense_when_small: bool = True) -> None:
        self.w13, self.w2 = w13, w2
        self.num_experts = w13.shape[0]
        self.per_expert = [(linear(a), linear(b)) for a, b in zip(w13.unbind(0), w2.unbind(0))]
        self.w13_t = self.w2_t = None
        if dense_when_small and (w13.numel() + w2.numel()) * w13.element_size() <= DENSE_MAX_WEIGHT_BYTES:
            self.w13_t = w13.transpose(1, 2).contiguous()  # [E, hidden, 2 * inter]
            self.w2_t = w2.transpose(1, 2).contiguous()  # [E, inter, hidden]

    def apply(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = expert_ids.shape
        if self.w13_t is not None and num_tokens <= DENSE_MAX_TOKENS and not torch.is_grad_enabled():
            return self._dense(x, weights, expert_ids)
        if num_tokens == 1:
            return self._one_token(x, weights, expert_ids)
        flat_ids = expert_ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        token_of = order // top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        sorted_x = x[token_of]
        sorted_w = weights.reshape(-1)[order].to(x.dtype)
        sorted_out = torch.empty_like(sorted_x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            w13, w2 = self.per_expert[expert]
            gate, up = w13.apply(sorted_x[start:end]).chunk(2, dim=-1)
            sorted_out[start:end] = w2.apply(F.silu(gate) * up)
            start = end
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, sorted_out * sorted_w[:, None])
        return out

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        combine = torch.zeros(num_tokens, 1, self.num_experts, dtype=x.dtype)
        combine.scatter_(2, expert_ids[:, None, :], weights[:, None, :].to(x.dtype))  # [T, 1, E]
        x = rows_at_least(x, MIN_BMM_ROWS)  # float32 bmm: a few rows take another kernel than more
        gate, up = torch.bmm(x.expand(self.num_experts, *x.shape), self.w13_t).chunk(2, dim=-1)
        expert_out = torch.bmm(F.silu(gate) * up, self.w2_t)[:, :num_tokens]  # [E, T, hidden]
        return torch.bmm(combine, expert_out.transpose(0, 1)).squeeze(1)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Batch-1 decode: the token's experts one after another, without the sort / gather / scatter.
        Sums in ascending expert id, the order in which ``apply``'s index_add_ accumulates."""
        ids = expert_ids[0].tolist()
        scale = weights[0].to(x.dtype)
        out = torch.zeros_like(x)
        for k in sorted(range(len(ids)), key=ids.__getitem__):
            w13, w2 = self.per_expert[ids[k]]
            gate, up = w13.apply(x).chunk(2, dim=-1)
            out += w2.apply(F.silu(gate) * up) * scale[k]
        return out


class TorchWeightMethods:
    """Each matrix plain, or oneDNN-packed where ``should_pack`` says this CPU gains from it."""

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> DenseLinear:
        return self._linear_class(weight.dtype)(weight, bias)

    def swiglu(self, gate_up: torch.Tensor, down: torch.Tensor) -> TorchSwiGLU:
        return TorchSwiGLU(self.linear(gate_up), self.linear(down))

    def experts(self, w13: torch.Tensor, w2: torch.Tensor) -> TorchExperts:
        return TorchExperts(w13, w2, self._linear_class(w13.dtype))

    def absorbed_projections(self, w_uk: torch.Tensor, w_uv_t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return ()

    @staticmethod
    def _linear_class(dtype: torch.dtype) -> type[DenseLinear]:
        return OneDnnLinear if should_pack(dtype) else DenseLinear
