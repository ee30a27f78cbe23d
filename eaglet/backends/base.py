"""The small interfaces a backend implements: every computation whose fastest form depends on the
machine (eaglet's C++ kernels, or PyTorch ops) goes through one of them.

Two backends implement all of them: ``pytorch`` (PyTorch ops, any device, autograd-friendly) and
``cpu`` (eaglet's C++ kernels, ``eaglet.kernels``). An engine picks one (``select_backend``) and
hands it to the cache, the models, the sampler and the speculative round; nothing else decides
which code runs. Both give every row a result that does not depend on the other rows of its call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
    from eaglet.backends.quantized_matrix import QuantizedMatrix
    from eaglet.backends.stack import DecoderStack, StackConfig, StackLayer
    from eaglet.runtime.kv_cache import CacheOps, KVCacheManager, LatentKVPool


class LayerOps(Protocol):
    """The elementwise and per-token work of a decoder layer."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm in float32, rounded to x's dtype, then scaled by the weight in that dtype."""
        ...

    def rope_query_key(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's per-head q_pe [T, H, R] and shared k_pe [T, R] rotated by ``cos``/``sin`` [T, R / 2]."""
        ...

    def noaux_route(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
        norm_topk_prob: bool, routed_scaling_factor: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3 routing: (weights [T, k] float32, expert ids [T, k])."""
        ...


class SamplingOps(Protocol):
    """Vocabulary-wide reductions of logits rows."""

    def argmax(self, logits: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """``logits.argmax(-1)`` (first index of the maximum, NaN counting as the maximum); with
        ``offsets`` (an EAGLE-3 draft's d2t) each index i becomes i + offsets[i]."""
        ...

    def topk_logprobs(
        self, logits: torch.Tensor, k: int, offsets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits.log_softmax(-1).topk(k)`` of [R, V] logits: (float32 values, int64 ids), the
        lower index first among equal values; ids shifted by ``offsets`` as in ``argmax``."""
        ...


class SpecOps(Protocol):
    """A speculative round's tree selection, verification and commit (``eaglet.spec`` wraps the
    tensors in its types)."""

    def select_draft_tree(
        self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
        root_tokens: torch.Tensor, num_nodes: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The best ``num_nodes - 1`` of [B, M] float32-scored candidates under each root, ties to the
        earlier one: (tokens, parents, depths) [B, num_nodes], node 0 the root."""
        ...

    def tree_attention_mask(self, parents: torch.Tensor, prefix_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
        """[B * N, num_keys] bool: each node sees its request's prefix, its ancestors and itself."""
        ...

    def verify_tree_greedy(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The [B, D + 2] verify table (num accepted, bonus token, accepted nodes -1 padded) of the
        longest path whose tokens are the target's argmax at their parents."""
        ...

    def verify_tree_greedy_ids(self, tokens: torch.Tensor, parents: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """``verify_tree_greedy`` given the target's greedy token after every node [B, N]."""
        ...

    def commit_table(
        self, table: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A round's commit (``eaglet.spec.verify.CommitTable``'s entries, per_request, entry_starts)."""
        ...


class LinearMethod(Protocol):
    """A [out, in] weight (and bias) in the form a backend multiplies: the weight-format seam. A
    method owns its packed copy; the module keeps the checkpoint's parameters."""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b, in x's dtype."""
        ...

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``apply(x).float()`` (an lm_head's logits)."""
        ...

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """``logits(x).argmax(-1)`` without writing the logits, where the form can; None: take them."""
        ...


class SwiGLUMethod(Protocol):
    """A SwiGLU MLP's matrices: down(silu(gate(x)) * up(x)), gate and up stacked as one [2I, H] weight."""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        ...


class ExpertsMethod(Protocol):
    """All routed experts of a MoE layer: w13 [E, 2I, H] (gate; up) and w2 [E, H, I]."""

    def apply(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each token's experts (expert_ids [T, k]) combined with ``weights`` [T, k] float32."""
        ...


class WeightMethods(Protocol):
    """The weight formats a backend multiplies in, chosen per matrix from its dtype and the CPU, or
    from its quantized form (``QuantizedMatrix``: a checkpoint's int4 or FP8 codes and scales)."""

    def linear(self, weight: torch.Tensor | QuantizedMatrix, bias: torch.Tensor | None = None) -> LinearMethod:
        ...

    def swiglu(self, gate_up: torch.Tensor | QuantizedMatrix, down: torch.Tensor | QuantizedMatrix) -> SwiGLUMethod:
        ...

    def experts(self, w13: torch.Tensor | QuantizedMatrix, w2: torch.Tensor | QuantizedMatrix) -> ExpertsMethod:
        ...

    def absorbed_projections(self, w_uk: torch.Tensor, w_uv_t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """MLA's W_UK^T / W_UV per head ([H, P, L] / [H, L, V] float32) in the form the backend's
        absorbed attention multiplies a model of ``dtype`` in; () where it takes the float32 ones."""
        ...


@dataclass(frozen=True)
class Backend:
    """One engine's choice of kernels, handed to everything that computes."""

    name: str  # "cpu" (eaglet's C++ kernels) or "pytorch"
    layers: LayerOps
    sampling: SamplingOps
    spec: SpecOps
    cache: CacheOps
    weights: WeightMethods
    # MLA attention over a latent pool of the cache (the target's when None).
    mla_attention: Callable[[KVCacheManager, LatentKVPool | None], MLAAttentionBackend]
    # A model's decoder layers (or an EAGLE-3 draft's midlayer) as one C++ call per forward, where
    # the backend has one and every layer's weights are in its forms; else None.
    decoder_stack: Callable[[StackConfig, list[StackLayer]], DecoderStack | None]
    # Why the C++ kernels are not used, for the startup log, /metrics and the bench (None: they are).
    fallback_reason: str | None = None
    # Whether bfloat16 matrices are multiplied on eaglet's tile GEMM (then dtype "auto" is bfloat16).
    tile_gemm: bool = False
    # Whether int4 matrices meet their activations quantized to int8 (W4A8) instead of in float.
    int8_activations: bool = False

    @property
    def kernels(self) -> bool:
        """Whether this backend runs eaglet's C++ kernels."""
        return self.name == "cpu"
