"""DeepSeek-V3 language model (also Kimi-K2 and the text part of Kimi-K2.5), written for inference.

Parameter names equal the checkpoint's tensor names below the model's prefix, so the loader maps
them one to one (routed experts excepted, see ``RoutedExperts.checkpoint_weights``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from eaglet.backends.base import Backend
from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
from eaglet.backends.stack import DecoderStack, StackConfig, StackLayer
from eaglet.distributed.tensor_parallel import TensorParallel
from eaglet.layers.mla import MLAAttention
from eaglet.layers.moe import MoE, SwiGLU
from eaglet.layers.norms import RMSNorm
from eaglet.layers.rotary import RotaryEmbedding
from eaglet.layers.vocab_parallel import VocabParallelLinear
from eaglet.models.config import ModelConfig, TextConfig, parse_text_config
from eaglet.models.quantization import parse_quantization
from eaglet.runtime.forward_batch import ForwardBatch


def parse_deepseek_v3_config(raw: dict) -> ModelConfig:
    """A DeepSeek-V3 / Kimi-K2 config.json."""
    return ModelConfig(
        raw.get("model_type", "deepseek_v3"), parse_text_config(raw, where="config"), raw=raw,
        quantization=parse_quantization(raw),
    )


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [K, vocab] float32, rows = batch.logits_indices; None with greedy_ids
    aux_hidden_states: torch.Tensor | None = None  # [T, len(capture_layers) * hidden]
    # [K] int64 argmax of the logits rows, computed without the logits (batch.greedy_ids_only, where
    # the lm_head has a fused kernel); None otherwise.
    greedy_ids: torch.Tensor | None = None


def stack_config(config: TextConfig, softmax_scale: float) -> StackConfig:
    """The sizes a decoder stack of this config's layers shares."""
    return StackConfig(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank or 0, rope_interleave=bool(config.rope_interleave), rms_norm_eps=config.rms_norm_eps,
        softmax_scale=softmax_scale, num_experts_per_tok=config.num_experts_per_tok or 0, n_group=config.n_group or 1,
        topk_group=config.topk_group or 1, norm_topk_prob=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor or 1.0),
    )


def stack_layer(
    attn: MLAAttention, mlp: nn.Module, input_norm: RMSNorm, post_norm: RMSNorm, hidden_norm: RMSNorm | None = None
) -> StackLayer | None:
    """A prepared MLA layer's weights by role for a decoder stack (None before loading)."""
    if attn.w_uk is None:
        return None
    if attn.has_q_lora:
        first, first_bias = attn.qkv_a, attn.qkv_a_bias
        q_proj, q_a_norm = attn.q_b_proj.method, attn.q_a_layernorm.weight
    else:
        first, first_bias = attn.kv_a_proj_with_mqa.method, attn.kv_a_proj_with_mqa.bias
        q_proj, q_a_norm = attn.q_proj.method, None
    dense = mlp if isinstance(mlp, SwiGLU) else mlp.shared_experts if isinstance(mlp, MoE) else None
    moe = mlp if isinstance(mlp, MoE) else None
    if first is None or q_proj is None or attn.o_proj.method is None or (dense is not None and dense.method is None):
        return None
    return StackLayer(
        input_norm=input_norm.weight, post_norm=post_norm.weight, kv_a_norm=attn.kv_a_layernorm.weight, first=first,
        first_bias=first_bias, q_proj=q_proj, q_a_norm=q_a_norm, o_proj=attn.o_proj.method, o_bias=attn.o_proj.bias,
        w_uk=attn.w_uk, w_uv_t=attn.w_uv_t, absorbed_projections=attn.absorbed_projections,
        mlp=None if dense is None else dense.method, mlp_inter=0 if dense is None else dense.down_proj.weight.shape[1],
        router_weight=None if moe is None else moe.gate.weight, router_bias=None if moe is None else moe.gate.e_score_correction_bias,
        experts=None if moe is None else moe.experts.method, expert_inter=0 if moe is None else moe.experts.intermediate_size,
        hidden_norm=None if hidden_norm is None else hidden_norm.weight,
    )


class DecoderLayer(nn.Module):
    """Attention then MLP, each added to the residual stream; under tensor parallelism each returns
    a partial sum that is all-reduced before the add."""

    def __init__(
        self, config: TextConfig, layer_id: int, rotary: RotaryEmbedding, backend: Backend, tp: TensorParallel
    ) -> None:
        super().__init__()
        ops = backend.layers
        self.tp = tp
        self.self_attn = MLAAttention(config, layer_id, rotary, backend, tp=tp)
        self.mlp: nn.Module = (
            MoE(config, backend, tp) if config.is_moe_layer(layer_id)
            else SwiGLU(config.hidden_size, config.intermediate_size, backend.weights, tp)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def stack_layer(self) -> StackLayer | None:
        return stack_layer(self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        attention: MLAAttentionBackend,
    ) -> torch.Tensor:
        hidden = hidden + self.tp.all_reduce(self.self_attn(self.input_layernorm(hidden), cos, sin, batch, attention))
        return hidden + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(hidden)))


class DeepseekV3Model(nn.Module):
    """Under tensor parallelism the embedding is whole on every rank (the draft reads it too)."""

    def __init__(self, config: TextConfig, backend: Backend, tp: TensorParallel) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.rope, config.rope_interleave, backend.layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary, backend, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.layers)
        self.backend = backend
        # All layers in one call for the batches it takes, where the backend has a decoder stack.
        self.decoder_stack: DecoderStack | None = None

    def process_weights_after_loading(self) -> None:
        """After the layers prepared their weights (the loader goes children first)."""
        if self.tp.expert_parallel:
            return  # the stack runs every expert of a layer; expert parallelism runs this rank's
        layers = [layer.stack_layer() for layer in self.layers]
        if all(layers):
            attn = self.layers[0].self_attn
            config = dataclasses.replace(stack_config(self.config, attn.scaling), num_heads=attn.num_heads)  # this rank's
            self.decoder_stack = self.backend.decoder_stack(config, layers)
        if self.tp.enabled and self.decoder_stack is not None and not self.decoder_stack.use_all_reduce(self.tp.comm):
            self.decoder_stack = None

    def forward(self, batch: ForwardBatch, attention: MLAAttentionBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final-normed hidden states [T, D], captured residual streams or None)."""
        hidden = batch.input_embeds if batch.input_embeds is not None else self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin_as(batch.positions, hidden.dtype)
        capture_order = sorted(set(batch.capture_layers))
        stacked = None
        if self.decoder_stack is not None:
            stacked = self.decoder_stack.forward(hidden, cos, sin, batch, attention, capture_order)
        if stacked is not None:
            hidden, *captured = stacked
        else:
            captured = []
            for layer_id, layer in enumerate(self.layers):
                hidden = layer(hidden, cos, sin, batch, attention)
                if layer_id in batch.capture_layers:
                    captured.append(hidden)
        aux = None
        if batch.capture_layers:
            # Concatenate in the order the caller asked for, not in layer order.
            by_layer = dict(zip(capture_order, captured))
            aux = torch.cat([by_layer[i] for i in batch.capture_layers], dim=-1)
        return self.norm(hidden), aux


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, config: TextConfig, backend: Backend, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.config = config
        self.tp = tp
        self.model = DeepseekV3Model(config, backend, tp)
        self.lm_head = VocabParallelLinear(config.hidden_size, config.vocab_size, backend.weights, tp)

    @classmethod
    def from_model_config(
        cls, config: ModelConfig, backend: Backend, tp: TensorParallel | None = None
    ) -> DeepseekV3ForCausalLM:
        return cls(config.text, backend, tp)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def tied_weights(self) -> dict[str, str]:
        """Parameters that share storage when the config ties them: {alias: source}."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def process_weights_after_loading(self) -> None:
        if self.tp.enabled and self.config.tie_word_embeddings:
            # Tied: the loader pointed lm_head at the whole embedding; this rank multiplies its rows.
            rows = self.lm_head.weight.data[self.lm_head.vocab_start : self.lm_head.vocab_start + self.lm_head.out_features]
            self.lm_head.weight = nn.Parameter(rows, requires_grad=False)
            self.lm_head.process_weights_after_loading()
        # The vocabulary projection is the largest matrix read each decode step. A float32 CPU GEMM
        # reads it about twice as fast stored column-major (eaglet.bench.decode_vs_transformers); a
        # bfloat16 one is up to 2.7x slower that way, so bfloat16 keeps the row-major layout. Same
        # values; the lm_head's method is made again from the new layout.
        if self.lm_head.weight.dtype == torch.float32:
            self.lm_head.weight.data = self.lm_head.weight.data.t().contiguous().t()
            self.lm_head.process_weights_after_loading()

    def ignored_checkpoint_tensors(self, prefix: str = "") -> tuple[re.Pattern, ...]:
        """Multi-token-prediction layers (ids >= num_hidden_layers) that published checkpoints append."""
        if not self.config.num_nextn_predict_layers:
            return ()
        first = self.config.num_hidden_layers
        ids = "|".join(str(first + i) for i in range(self.config.num_nextn_predict_layers))
        return (re.compile(rf"{re.escape(prefix)}model\.layers\.({ids})\."),)

    def forward(self, batch: ForwardBatch, attention: MLAAttentionBackend) -> ForwardOutput:
        for layer_id in batch.capture_layers:
            if not 0 <= layer_id < self.config.num_hidden_layers:
                raise ValueError(f"capture layer {layer_id} out of range 0..{self.config.num_hidden_layers - 1}")
        hidden, aux = self.model(batch, attention)
        rows = hidden[batch.logits_indices]
        if batch.greedy_ids_only:
            ids = self.lm_head.argmax(rows)
            if ids is not None:
                return ForwardOutput(logits=None, aux_hidden_states=aux, greedy_ids=ids)
        return ForwardOutput(logits=self.lm_head.logits(rows), aux_hidden_states=aux)
