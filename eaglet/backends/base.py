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


@dataclass(frozen=True)
class Backend:
    """One engine's choice of kernels, handed to everything that computes."""

    name: str  # "cpu" (eaglet's C++ kernels) or "pytorch"
    layers: LayerOps
    sampling: SamplingOps
    spec: SpecOps
    cache: CacheOps
    # MLA attention over a latent pool of the cache (the target's when None).
    mla_attention: Callable[[KVCacheManager, LatentKVPool | None], MLAAttentionBackend]
    # Why the C++ kernels are not used, for the startup log, /metrics and the bench (None: they are).
    fallback_reason: str | None = None

    @property
    def kernels(self) -> bool:
        """Whether this backend runs eaglet's C++ kernels."""
        return self.name == "cpu"
