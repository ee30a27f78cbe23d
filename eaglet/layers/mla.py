"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) for inference over the latent cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from eaglet.backends.base import Backend, LinearMethod
from eaglet.backends.pytorch.weights import dense_linear
from eaglet.backends.quantized_matrix import QuantizedMatrix
from eaglet.distributed.tensor_parallel import TensorParallel, TensorShard
from eaglet.errors import ConfigError
from eaglet.layers.linear import Linear
from eaglet.layers.norms import RMSNorm
from eaglet.layers.quantized_weight import WeightHolder, cat_weights, sharded
from eaglet.layers.rotary import RopeConfig, RotaryEmbedding, softmax_scale

if TYPE_CHECKING:
    from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
    from eaglet.runtime.forward_batch import ForwardBatch


class MLAConfig(Protocol):
    """What an MLA layer reads of a model's config (DeepSeek-V3's TextConfig has it)."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    rope: RopeConfig

    @property
    def qk_head_dim(self) -> int: ...


class MLAAttention(nn.Module):
    """Projections of one MLA layer; the attention itself is the backend's (``MLAAttentionBackend``).

    Weights keep the checkpoint names and [out, in] layout. ``input_size`` differs from hidden_size
    only for an EAGLE-3 MLA draft, whose q_a / kv_a projections read the 2*hidden concatenation.
    With q_lora_rank, q_a_proj and kv_a_proj_with_mqa are multiplied as one matrix (``qkv_a``).

    Under tensor parallelism a rank holds ``num_attention_heads / tp.size`` heads: its rows of the
    up-projections (q_b_proj / q_proj, kv_b_proj) and its columns of o_proj, whose output is then a
    partial sum (the decoder layer all-reduces it). The down-projections, their norms and so the
    latent cache are whole on every rank: each head reads all of the latent.
    """

    def __init__(
        self, config: MLAConfig, layer_id: int, rotary: RotaryEmbedding, backend: Backend, input_size: int | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        ops, weights = backend.layers, backend.weights
        self.weights = weights
        input_size = input_size or config.hidden_size
        self.layer_id = layer_id
        if tp.enabled and config.attention_bias:
            raise ConfigError("tensor parallelism: attention_bias (a bias on o_proj) is not supported")
        self.num_heads = tp.part(config.num_attention_heads, "num_attention_heads")
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = softmax_scale(config.qk_head_dim, config.rope)
        self.rotary = rotary
        heads_qk = self.num_heads * config.qk_head_dim
        self.q_lora_rank = config.q_lora_rank
        self.has_q_lora = config.q_lora_rank is not None
        kv_a_out = config.kv_lora_rank + config.qk_rope_head_dim

        def by_heads(per_head: int) -> TensorShard | None:
            return tp.rows(config.num_attention_heads * per_head, "attention heads")

        if config.q_lora_rank is None:
            self.q_proj = sharded(Linear(input_size, heads_qk, False, weights), by_heads(config.qk_head_dim))
            self.kv_a_proj_with_mqa = Linear(input_size, kv_a_out, config.attention_bias, weights)
        else:
            # Parameter holders: qkv_a multiplies them as one matrix.
            self.q_a_proj = WeightHolder(input_size, config.q_lora_rank, bias=config.attention_bias)
            self.kv_a_proj_with_mqa = WeightHolder(input_size, kv_a_out, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, ops)
            self.q_b_proj = sharded(Linear(config.q_lora_rank, heads_qk, False, weights), by_heads(config.qk_head_dim))
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps, ops)
        kv_b_per_head = config.qk_nope_head_dim + config.v_head_dim
        self.kv_b_proj = sharded(
            Linear(config.kv_lora_rank, self.num_heads * kv_b_per_head, False, weights), by_heads(kv_b_per_head)
        )
        self.o_proj = sharded(
            Linear(self.num_heads * config.v_head_dim, config.hidden_size, config.attention_bias, weights),
            tp.cols(config.num_attention_heads * config.v_head_dim, "attention heads"),
        )
        # Set by process_weights_after_loading.
        self.w_uk: torch.Tensor | None = None  # [H, P, L] float32
        self.w_uv_t: torch.Tensor | None = None  # [H, L, V] float32
        self.qkv_a_weight: torch.Tensor | None = None  # [q_lora_rank + L + R, input_size]
        self.qkv_a_bias: torch.Tensor | None = None
        self.qkv_a: LinearMethod | None = None
        # W_UK / W_UV in the backend's form for its absorbed attention; () runs them in float32.
        self.absorbed_projections: tuple[torch.Tensor, ...] = ()

    def process_weights_after_loading(self) -> None:
        """Derives the absorbed-form matrices and fuses the two down-projections that read x.

        W_UK [H, P, L] and W_UV^T [H, L, V] come from kv_b_proj and are kept in float32: absorbed
        attention runs in float32 whatever the model dtype (1.1-1.2x faster than bfloat16 batched
        GEMMs of these shapes where the CPU emulates bfloat16, as fast with AMX; and more exact).
        With q_lora_rank, q_a_proj and kv_a_proj_with_mqa become row slices of one matrix, so a
        token reads x once in one GEMM; the checkpoint-named parameters stay views of it.
        """
        kv_b = self.kv_b_proj.loaded_weight()
        kv_b = kv_b.dequantize() if isinstance(kv_b, QuantizedMatrix) else kv_b.float()
        w = kv_b.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        self.w_uk = w[:, : self.qk_nope_head_dim].contiguous()
        self.w_uv_t = w[:, self.qk_nope_head_dim :].transpose(1, 2).contiguous()
        if self.has_q_lora:
            self._fuse_down_projections()
        self.absorbed_projections = self.weights.absorbed_projections(self.w_uk, self.w_uv_t, self.kv_b_proj.weight.dtype)

    def _fuse_down_projections(self) -> None:
        q_a, kv_a = self.q_a_proj.loaded_weight(), self.kv_a_proj_with_mqa.loaded_weight()
        if isinstance(q_a, QuantizedMatrix) or isinstance(kv_a, QuantizedMatrix):
            # Quantized: the fused matrix is the only copy; the holders keep their meta stand-ins.
            if self.q_a_proj.bias is not None:
                self.qkv_a_bias = torch.cat([self.q_a_proj.bias.detach(), self.kv_a_proj_with_mqa.bias.detach()])
            self.qkv_a = self.weights.linear(cat_weights([q_a, kv_a]), self.qkv_a_bias)
            return
        q_rows = self.q_a_proj.weight.shape[0]
        fused = torch.cat([q_a, kv_a])
        self.q_a_proj.weight.data = fused[:q_rows]
        self.kv_a_proj_with_mqa.weight.data = fused[q_rows:]
        self.qkv_a_weight = fused
        if self.q_a_proj.bias is not None:
            fused_bias = torch.cat([self.q_a_proj.bias.detach(), self.kv_a_proj_with_mqa.bias.detach()])
            self.q_a_proj.bias.data = fused_bias[:q_rows]
            self.kv_a_proj_with_mqa.bias.data = fused_bias[q_rows:]
            self.qkv_a_bias = fused_bias
        self.qkv_a = self.weights.linear(fused, self.qkv_a_bias)

    def decompress(self, latent: torch.Tensor) -> torch.Tensor:
        """kv_b_proj of cached latents [S, L]: each token's keys' nope part and values, [S, H * (P + V)]."""
        return self.kv_b_proj(latent)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        attention: MLAAttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if not self.has_q_lora:
            q = self.q_proj(x)
            c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        else:
            if self.qkv_a is None or torch.is_grad_enabled():
                # Not prepared for inference, or being trained: the fused copy carries no gradient.
                q_a = dense_linear(x, self.q_a_proj.weight, self.q_a_proj.bias)
                c_kv, k_pe = dense_linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias).split(
                    [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
                )
            else:
                q_a, c_kv, k_pe = self.qkv_a.apply(x).split(
                    [self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
                )
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.view(num_tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = self.rotary.rotate_query_and_key(q_pe, k_pe, cos, sin)
        attn = attention.forward(self, q_nope, q_pe, c_kv, k_pe, batch)  # [T, H, V]
        return self.o_proj(attn.reshape(num_tokens, self.num_heads * self.v_head_dim))
