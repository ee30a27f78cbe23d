"""What a model hands a backend to run its decoder layers as one call per forward, and what it gets.

A model describes each layer by the roles of its weights (``StackLayer``, its matrices as the
backend's weight methods); a backend that can run them together (the CPU backend's C++
``DecoderStack``) returns a ``DecoderStack``, one that cannot returns None and the model runs its
layers one by one. Either way the layers compute the same thing with the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from eaglet.backends.base import ExpertsMethod, LinearMethod, SwiGLUMethod
    from eaglet.runtime.forward_batch import ForwardBatch


@dataclass(frozen=True)
class StackConfig:
    """The sizes every layer of a stack shares (a DeepSeek-V3 text config's, or an MLA draft's)."""

    hidden_size: int
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    q_lora_rank: int  # 0: no q_lora (q_proj reads x)
    rope_interleave: bool
    rms_norm_eps: float
    softmax_scale: float
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class StackLayer:
    """One MLA decoder layer's weights by role (an EAGLE-3 midlayer's has ``hidden_norm``)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    kv_a_norm: torch.Tensor
    first: LinearMethod  # x -> [q_a (with q_lora); latent; k_pe]
    first_bias: torch.Tensor | None
    q_proj: LinearMethod  # q_a (or x) -> the heads' queries
    q_a_norm: torch.Tensor | None
    o_proj: LinearMethod
    o_bias: torch.Tensor | None
    w_uk: torch.Tensor  # [H, P, L] float32
    w_uv_t: torch.Tensor  # [H, L, V] float32
    absorbed_projections: tuple[torch.Tensor, ...]  # the backend's form of W_UK / W_UV, or ()
    mlp: SwiGLUMethod | None  # the dense MLP, or a MoE layer's shared experts
    mlp_inter: int
    router_weight: torch.Tensor | None  # a MoE layer's router [E, H] float32 and bias [E]
    router_bias: torch.Tensor | None
    experts: ExpertsMethod | None
    expert_inter: int
    hidden_norm: torch.Tensor | None = None


class DecoderStack(Protocol):
    """Layers run as one call per forward, for the batches the backend's attention takes that way."""

    def use_all_reduce(self, comm: object) -> bool:
        """Under tensor parallelism: all-reduce each layer's attention and MLP outputs through
        ``comm`` inside the call; False where it cannot (then the model runs its layers one by one)."""
        ...

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, attention: object,
        capture_layers: list[int],
    ) -> list[torch.Tensor] | None:
        """[hidden after the last layer, then after each of ``capture_layers``], or None where the
        layers must run one by one."""
        ...

    def forward_eagle3(
        self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        attention: object,
    ) -> torch.Tensor | None:
        """An EAGLE-3 midlayer's output, or None where it must run as Python."""
        ...
