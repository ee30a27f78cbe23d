"""DeepSeek-V3 feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts."""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.backends.base import LayerOps
from eaglet.backends.pytorch.gemm_rows import MIN_BMM_ROWS, rows_at_least
from eaglet.layers.linear import linear


class MoEConfig(Protocol):
    """What the MoE block reads of a model's config (DeepSeek-V3's TextConfig has it)."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # [2 * intermediate, hidden], set after loading
        # (gate_up, down) in AMX tile layout for torch.ops.eaglet.amx_swiglu (eaglet.kernels.use_cpu_kernels)
        self.amx_weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def process_weights_after_loading(self) -> None:
        """Stacks gate and up into one matrix (one GEMM per call); the named parameters become views of it."""
        inter = self.gate_proj.weight.shape[0]
        fused = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])
        self.gate_proj.weight.data = fused[:inter]
        self.up_proj.weight.data = fused[inter:]
        self.gate_up_weight = fused

    def packable_weights(self) -> list[torch.Tensor]:
        gate_up = [self.gate_up_weight] if self.gate_up_weight is not None else [self.gate_proj.weight, self.up_proj.weight]
        return [*gate_up, self.down_proj.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx_weights is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and not torch.is_grad_enabled():
            return torch.ops.eaglet.amx_swiglu(x, *self.amx_weights, self.down_proj.weight.shape[1])
        if self.gate_up_weight is None or torch.is_grad_enabled():
            # Not prepared for inference, or being trained (draft training): the fused copy carries no
            # gradient, so read the parameters themselves.
            gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
        else:
            gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj.weight)


class NoAuxRouter(nn.Module):
    """Sigmoid scores, selection biased by e_score_correction_bias within the best expert groups."""

    def __init__(self, config: MoEConfig, ops: LayerOps) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.ops = ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, k] float32, expert ids [T, k])."""
        return self.ops.noaux_route(
            x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
            self.norm_topk_prob, self.routed_scaling_factor,
        )


DENSE_MAX_WEIGHT_BYTES = 1 << 20
DENSE_MAX_TOKENS = 64


class RoutedExperts(nn.Module):
    """All routed experts' SwiGLU weights stacked: w13 = [gate; up] per expert, w2 = down.

    Tokens are grouped by expert (one sort), then each active expert runs one matmul over its tokens.
    When all experts together are small (at most ``DENSE_MAX_WEIGHT_BYTES``: they stay in cache) a
    decode-sized batch instead runs every expert on every token in two batched matmuls and
    combines them with the routing weights (zero for unchosen experts): the extra arithmetic costs
    less than routing's sort / gather / scatter (2-3x faster for the demo model's 4 experts of
    128 x 128 at 4-16 tokens, slower for 8 experts of 512 x 256; measured on CPU).
    The checkpoint stores each expert separately; :meth:`checkpoint_weights` maps those names onto
    slices of the stacked tensors.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        # Per-expert views of w13 / w2, made once after loading so that packed copies stay attached.
        self.w13_per_expert: list[torch.Tensor] = []
        self.w2_per_expert: list[torch.Tensor] = []
        # [E, hidden, 2 * inter] and [E, inter, hidden] copies for the dense path, when it applies.
        self.w13_t: torch.Tensor | None = None
        self.w2_t: torch.Tensor | None = None
        # Every expert's w13 / w2 in AMX tile layout, stacked [E, ...], for
        # torch.ops.eaglet.moe_routed_experts (eaglet.kernels.use_cpu_kernels); None: the PyTorch path.
        self.amx_weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def process_weights_after_loading(self) -> None:
        self.w13_per_expert = list(self.w13.detach().unbind(0))
        self.w2_per_expert = list(self.w2.detach().unbind(0))
        weight_bytes = (self.w13.numel() + self.w2.numel()) * self.w13.element_size()
        if weight_bytes <= DENSE_MAX_WEIGHT_BYTES:
            self.w13_t = self.w13.detach().transpose(1, 2).contiguous()
            self.w2_t = self.w2.detach().transpose(1, 2).contiguous()

    def packable_weights(self) -> list[torch.Tensor]:
        return self.w13_per_expert + self.w2_per_expert

    def _expert(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.w13_per_expert:
            return self.w13_per_expert[expert], self.w2_per_expert[expert]
        return self.w13[expert], self.w2[expert]

    def checkpoint_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        inter = self.intermediate_size
        views: dict[str, torch.Tensor] = {}
        for e in range(self.num_experts):
            views[f"{prefix}{e}.gate_proj.weight"] = self.w13.data[e, :inter]
            views[f"{prefix}{e}.up_proj.weight"] = self.w13.data[e, inter:]
            views[f"{prefix}{e}.down_proj.weight"] = self.w2.data[e]
        return views

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = expert_ids.shape
        if self.amx_weights is not None and x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
            w13, w2 = self.amx_weights
            return torch.ops.eaglet.moe_routed_experts(x, w13, w2, weights, expert_ids, self.intermediate_size)
        if self.w13_t is not None and num_tokens <= DENSE_MAX_TOKENS and not torch.is_grad_enabled():
            return self._forward_dense(x, weights, expert_ids)
        if num_tokens == 1:
            return self._forward_one_token(x, weights, expert_ids)
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
            w13, w2 = self._expert(expert)
            gate, up = linear(sorted_x[start:end], w13).chunk(2, dim=-1)
            sorted_out[start:end] = linear(F.silu(gate) * up, w2)
            start = end
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, sorted_out * sorted_w[:, None])
        return out

    def _forward_dense(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        combine = torch.zeros(num_tokens, 1, self.num_experts, dtype=x.dtype)
        combine.scatter_(2, expert_ids[:, None, :], weights[:, None, :].to(x.dtype))  # [T, 1, E]
        x = rows_at_least(x, MIN_BMM_ROWS)  # float32 bmm: a few rows take another kernel than more
        gate, up = torch.bmm(x.expand(self.num_experts, *x.shape), self.w13_t).chunk(2, dim=-1)
        expert_out = torch.bmm(F.silu(gate) * up, self.w2_t)[:, :num_tokens]  # [E, T, hidden]
        return torch.bmm(combine, expert_out.transpose(0, 1)).squeeze(1)

    def _forward_one_token(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Batch-1 decode: the token's experts one after another, without the sort / gather / scatter.

        Sums in ascending expert id, the order in which ``forward``'s index_add_ accumulates.
        """
        ids = expert_ids[0].tolist()
        scale = weights[0].to(x.dtype)
        out = torch.zeros_like(x)
        for k in sorted(range(len(ids)), key=ids.__getitem__):
            w13, w2 = self._expert(ids[k])
            gate, up = linear(x, w13).chunk(2, dim=-1)
            out += linear(F.silu(gate) * up, w2) * scale[k]
        return out


class MoE(nn.Module):
    def __init__(self, config: MoEConfig, ops: LayerOps) -> None:
        super().__init__()
        self.gate = NoAuxRouter(config, ops)
        self.experts = RoutedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (
            SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        out = self.experts(x, weights, expert_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
