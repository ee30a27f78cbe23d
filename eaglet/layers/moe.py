"""DeepSeek-V3 feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts."""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.backends.base import Backend, ExpertsMethod, LayerOps, SwiGLUMethod, WeightMethods
from eaglet.backends.pytorch.weights import dense_linear
from eaglet.backends.quantized_matrix import QuantizedMatrix, stack
from eaglet.distributed.tensor_parallel import TensorParallel, TensorShard
from eaglet.layers.quantized_weight import WeightHolder, cat_weights, meta_parameter, sharded


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
    """down(silu(gate(x)) * up(x)); gate and up stacked as one matrix after loading (one GEMM per
    call; the checkpoint-named parameters become views of it), multiplied by the backend's method.
    Under tensor parallelism a rank holds a slice of the intermediate dimension and returns a partial
    sum (the decoder layer all-reduces it)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, weights: WeightMethods, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        local = tp.part(intermediate_size, "MLP intermediate_size")
        self.gate_proj = sharded(WeightHolder(hidden_size, local, bias=False), tp.rows(intermediate_size, "MLP"))
        self.up_proj = sharded(WeightHolder(hidden_size, local, bias=False), tp.rows(intermediate_size, "MLP"))
        self.down_proj = sharded(WeightHolder(local, hidden_size, bias=False), tp.cols(intermediate_size, "MLP"))
        self.weights = weights
        self.gate_up_weight: torch.Tensor | None = None  # [2 * intermediate, hidden], set after loading
        self.method: SwiGLUMethod | None = None

    def process_weights_after_loading(self) -> None:
        gate, up, down = (p.loaded_weight() for p in (self.gate_proj, self.up_proj, self.down_proj))
        if any(isinstance(w, QuantizedMatrix) for w in (gate, up, down)):
            self.method = self.weights.swiglu(cat_weights([gate, up]), down)
            return
        inter = self.gate_proj.weight.shape[0]
        fused = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])
        self.gate_proj.weight.data = fused[:inter]
        self.up_proj.weight.data = fused[inter:]
        self.gate_up_weight = fused
        self.method = self.weights.swiglu(fused, self.down_proj.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is None or torch.is_grad_enabled():
            # Not prepared for inference, or being trained (draft training): the fused copy carries no
            # gradient, so read the parameters themselves.
            gate, up = dense_linear(x, self.gate_proj.weight), dense_linear(x, self.up_proj.weight)
            return dense_linear(F.silu(gate) * up, self.down_proj.weight)
        return self.method.apply(x)


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


class RoutedExperts(nn.Module):
    """All routed experts' SwiGLU weights stacked: w13 = [gate; up] per expert, w2 = down, multiplied
    by the backend's experts method. The checkpoint stores each expert separately;
    :meth:`checkpoint_weights` maps those names onto slices of the stacked tensors.

    Under tensor parallelism each rank holds either a slice of every expert's intermediate dimension
    (the default) or, with ``tp.expert_parallel``, ``num_experts / tp.size`` whole experts, running
    only the (token, expert) pairs routed to them. Either way the output is a partial sum that the
    decoder layer all-reduces.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, weights: WeightMethods,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.total_experts = num_experts
        self.first_expert = 0
        self.inter_shard: tuple[TensorShard, TensorShard] | None = None
        if tp.expert_parallel and tp.enabled:
            num_experts = tp.part(num_experts, "n_routed_experts")
            self.first_expert = tp.rank * num_experts
        else:
            rows, cols = tp.rows(intermediate_size, "moe_intermediate_size"), tp.cols(intermediate_size, "moe_intermediate_size")
            intermediate_size = tp.part(intermediate_size, "moe_intermediate_size")
            self.inter_shard = (rows, cols) if rows is not None and cols is not None else None
        self.expert_parallel = self.first_expert > 0 or num_experts < self.total_experts
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.weights = weights
        self.method: ExpertsMethod | None = None
        # Per-expert projections the checkpoint stores quantized, by checkpoint-name suffix; stacked
        # into quantized w13 / w2 after loading (``quantized``; w13 / w2 then hold no storage).
        self.quantized_parts: dict[str, QuantizedMatrix] = {}
        self.quantized: tuple[QuantizedMatrix, QuantizedMatrix] | None = None

    def bytes_per_expert(self) -> float:
        """Bytes one expert's weights take in the form they are multiplied in (a decode step reads them)."""
        if self.quantized is not None:
            return sum(m.nbytes for m in self.quantized) / self.num_experts
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    def process_weights_after_loading(self) -> None:
        if self.quantized_parts:
            w13, w2 = self._stack_quantized()
            self.w13, self.w2 = meta_parameter(self.w13), meta_parameter(self.w2)
            self.quantized_parts = {}
            self.quantized = (w13, w2)
            self.method = self.weights.experts(w13, w2)
            return
        self.method = self.weights.experts(self.w13.detach(), self.w2.detach())

    def hold_quantized(self, suffix: str, matrix: QuantizedMatrix) -> None:
        """Takes the quantized matrix the checkpoint stores under ``{prefix}{suffix}``."""
        self.quantized_parts[suffix] = matrix

    def _stack_quantized(self) -> tuple[QuantizedMatrix, QuantizedMatrix]:
        # Every expert's three projections are here: the loader refuses experts stored partly quantized.
        parts = self.quantized_parts
        owned = range(self.first_expert, self.first_expert + self.num_experts)
        w13 = stack([cat_weights([parts[f"{e}.gate_proj.weight"], parts[f"{e}.up_proj.weight"]]) for e in owned])
        w2 = stack([parts[f"{e}.down_proj.weight"] for e in owned])
        return w13, w2

    def checkpoint_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        """The checkpoint names of this rank's experts -> their slices of the stacked tensors."""
        inter = self.intermediate_size
        views: dict[str, torch.Tensor] = {}
        for local in range(self.num_experts):
            e = self.first_expert + local
            views[f"{prefix}{e}.gate_proj.weight"] = self.w13.data[local, :inter]
            views[f"{prefix}{e}.up_proj.weight"] = self.w13.data[local, inter:]
            views[f"{prefix}{e}.down_proj.weight"] = self.w2.data[local]
        return views

    def checkpoint_shards(self, prefix: str) -> dict[str, TensorShard]:
        """Which slice of each expert's checkpoint tensors this rank holds (split intermediate dimension)."""
        if self.inter_shard is None:
            return {}
        rows, cols = self.inter_shard
        shards: dict[str, TensorShard] = {}
        for name in self.checkpoint_weights(prefix):
            shards[name] = cols if name.endswith("down_proj.weight") else rows
        return shards

    def unowned_checkpoint_tensors(self, prefix: str) -> set[str]:
        """The other ranks' experts (expert parallelism): in the checkpoint, not read here."""
        if not self.expert_parallel:
            return set()
        owned = range(self.first_expert, self.first_expert + self.num_experts)
        return {
            f"{prefix}{e}.{proj}.weight"
            for e in range(self.total_experts) if e not in owned
            for proj in ("gate_proj", "up_proj", "down_proj")
        }

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if self.method is None:
            raise RuntimeError("RoutedExperts runs after process_weights_after_loading (the loader calls it)")
        if not self.expert_parallel:
            return self.method.apply(x, weights, expert_ids)
        # Only the (token, expert) pairs routed to this rank's experts, one pair per row; each
        # token's pairs are summed back in ascending slot order.
        local_ids = expert_ids - self.first_expert
        tokens, slots = ((local_ids >= 0) & (local_ids < self.num_experts)).nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if tokens.numel():
            pairs = self.method.apply(x[tokens], weights[tokens, slots][:, None], local_ids[tokens, slots][:, None])
            out.index_add_(0, tokens, pairs)
        return out


class MoE(nn.Module):
    """Router (whole on every rank: each rank routes every token alike), routed experts and shared
    experts; under tensor parallelism the output is a partial sum."""

    def __init__(self, config: MoEConfig, backend: Backend, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.gate = NoAuxRouter(config, backend.layers)
        self.experts = RoutedExperts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, backend.weights, tp
        )
        self.shared_experts = (
            SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, backend.weights, tp)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        out = self.experts(x, weights, expert_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
