"""A DeepSeek-V3 model's decoder layers, and an MLA EAGLE-3 draft's midlayer, in one kernel call per
forward (``torch.classes.eaglet.DecoderStack``).

A small model's decode step is dominated by Python: about 20 op calls and 8 module calls per
layer, each some microseconds, around kernels that take tens. The stack runs the same kernels
that ``DecoderLayer.forward`` reaches through RMSNorm, MLAAttention, CpuMLAAttention, MoE and
SwiGLU, on the same inputs and in the same order, from C++: the same bits (tests/test_decoder_stack.py).
It applies where that Python path would run the tile-layout kernels (AMX or AVX512-BF16)
throughout: a bfloat16 model whose matrices all have tile copies, no autograd, at most
PADDED_MAX_ROWS tokens, and a batch the fused backend attends in the absorbed form (decode,
verify, draft extends). Other batches (prefill) take
the layer-by-layer path. The stack holds the tile copies made when the kernels were switched on:
unlike ``linear``, it does not notice a weight changed in place afterwards (inference never does;
draft training runs under autograd, which takes the layer path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from eaglet.models.config import TextConfig
from eaglet.backends.cpu.mla_attention import CpuMLAAttention
from eaglet.layers.linear import PADDED_MAX_ROWS, amx_tiles
from eaglet.layers.mla import MLAAttention
from eaglet.layers.moe import MoE, SwiGLU
from eaglet.models.eagle3 import Eagle3DecoderLayer

if TYPE_CHECKING:
    from eaglet.runtime.forward_batch import ForwardBatch
    from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
    from eaglet.models.deepseek_v3 import DecoderLayer, DeepseekV3Model
    from eaglet.models.eagle3 import Eagle3Draft
    from eaglet.spec.eagle_worker import DraftState


def _layer_weights(layer: DecoderLayer | Eagle3DecoderLayer) -> tuple[dict[str, torch.Tensor], dict[str, int]] | None:
    """The layer's weights by the roles DecoderStack.add_layer takes and its MLP sizes (mlp_inter,
    expert_inter), or None where one of its matrices would not run on the tile-layout kernels."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(attn, MLAAttention):
        return None
    weights = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
               "kv_a_norm": attn.kv_a_layernorm.weight, "o_proj": amx_tiles(attn.o_proj.weight)}
    if isinstance(layer, Eagle3DecoderLayer):
        weights["hidden_norm"] = layer.hidden_norm.weight
    if attn.has_q_lora:
        if attn.qkv_a_weight is None:
            return None
        weights |= {"first": amx_tiles(attn.qkv_a_weight), "q_proj": amx_tiles(attn.q_b_proj.weight),
                    "q_a_norm": attn.q_a_layernorm.weight}
        first_bias = attn.qkv_a_bias
    else:
        weights |= {"first": amx_tiles(attn.kv_a_proj_with_mqa.weight), "q_proj": amx_tiles(attn.q_proj.weight)}
        first_bias = attn.kv_a_proj_with_mqa.bias
    if attn.w_uk is None:
        return None
    weights |= {"w_uk": attn.w_uk, "w_uv_t": attn.w_uv_t}
    if attn.amx_projections:
        weights |= dict(zip(("uk_packed", "uv_packed"), attn.amx_projections))
    for name, bias in (("first_bias", first_bias), ("o_bias", attn.o_proj.bias)):
        if bias is not None:
            weights[name] = bias.detach()
    dense = mlp if isinstance(mlp, SwiGLU) else mlp.shared_experts if isinstance(mlp, MoE) else None
    sizes = {"mlp_inter": 0, "expert_inter": 0}
    if dense is not None:
        if dense.amx_weights is None:
            return None
        weights |= dict(zip(("mlp_w13", "mlp_w2"), dense.amx_weights))
        sizes["mlp_inter"] = dense.down_proj.weight.shape[1]
    if isinstance(mlp, MoE):
        if mlp.experts.amx_weights is None:
            return None
        weights |= {"router_weight": mlp.gate.weight.detach(), "router_bias": mlp.gate.e_score_correction_bias.detach()}
        weights |= dict(zip(("experts_w13", "experts_w2"), mlp.experts.amx_weights))
        sizes["expert_inter"] = mlp.experts.intermediate_size
    elif not isinstance(mlp, SwiGLU):
        return None
    if any(w is None for w in weights.values()):
        return None
    return {name: w.detach() for name, w in weights.items()}, sizes


def _build(config: TextConfig, layers: list[nn.Module]) -> torch.ScriptObject | None:
    """A DecoderStack of ``layers``; None if one of them would not run on the tile-layout kernels."""
    if not layers or any(layer.input_layernorm.weight.dtype != torch.bfloat16 for layer in layers):
        return None
    stack = torch.classes.eaglet.DecoderStack(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank or 0, rope_interleave=bool(config.rope_interleave), rms_norm_eps=config.rms_norm_eps,
        softmax_scale=layers[0].self_attn.scaling, num_experts_per_tok=config.num_experts_per_tok or 0,
        n_group=config.n_group or 1, topk_group=config.topk_group or 1, norm_topk_prob=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor or 1.0),
    )
    for layer in layers:
        entry = _layer_weights(layer)
        if entry is None:
            return None
        weights, sizes = entry
        stack.add_layer(weights, **sizes)
    return stack


def _absorbed_inputs(
    backend: MLAAttentionBackend, hidden: torch.Tensor, batch: ForwardBatch
) -> dict[str, torch.Tensor | None] | None:
    """The stack's attention inputs for this batch by name, or None where the layer-by-layer path must run."""
    if (not isinstance(backend, CpuMLAAttention) or hidden.dtype != torch.bfloat16
            or batch.num_tokens > PADDED_MAX_ROWS or torch.is_grad_enabled()):
        return None
    return backend.absorbed_inputs(batch)


class FusedDecoderStack:
    """The C++ stack of a DeepseekV3Model's layers; ``forward`` returns None for batches it does not take."""

    def __init__(self, stack: torch.ScriptObject) -> None:
        self.stack = stack

    @classmethod
    def build(cls, model: DeepseekV3Model) -> FusedDecoderStack | None:
        """The stack for ``model`` after ``use_cpu_kernels``; None if any layer would not run on the
        tile-layout kernels."""
        stack = _build(model.config, list(model.layers))
        return cls(stack) if stack is not None else None

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, backend: MLAAttentionBackend,
        capture_layers: list[int],
    ) -> list[torch.Tensor] | None:
        """[hidden after the last layer, then after each of ``capture_layers`` (ascending)], or
        None where the layer-by-layer path must run."""
        inputs = _absorbed_inputs(backend, hidden, batch)
        if inputs is None:
            return None
        return self.stack.forward(hidden=hidden, cos=cos, sin=sin, capture_layers=capture_layers, **inputs)


@dataclass(frozen=True)
class _DraftHead:
    """What the Python side checks of the draft's head before a drafting call; the head itself (fc's
    and the lm_head's tile copies, the embeddings, the final norm, d2t) is the stack's, set once
    (``DecoderStack.set_draft_head``)."""

    extends: bool  # fc has a tile copy and there is no fc_norm: extend_proposals can run
    fc_in: int


class FusedMidlayer:
    """An MLA EAGLE-3 draft's midlayer as a one-layer C++ stack (``Eagle3DecoderLayer.forward``'s kernels).

    Like the stack's own weights, the draft's head (fc, embeddings, final norm, lm_head, d2t) is
    handed to the stack once, on first use (``set_draft_head``): a draft round calls the stack
    twice, and gathering, checking and passing those each time would cost a sizable share of a
    small draft's extend.
    """

    def __init__(self, stack: torch.ScriptObject) -> None:
        self.stack = stack
        self._head: _DraftHead | None = None
        self._head_checked = False

    @classmethod
    def build(cls, draft: Eagle3Draft) -> FusedMidlayer | None:
        if draft.config.kind != "mla":
            return None
        stack = _build(draft.config.mla, [draft.midlayer])
        return cls(stack) if stack is not None else None

    def forward(
        self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        backend: MLAAttentionBackend,
    ) -> torch.Tensor | None:
        """The midlayer's output, or None where ``Eagle3DecoderLayer.forward`` must run."""
        inputs = _absorbed_inputs(backend, hidden, batch)
        if inputs is None:
            return None
        return self.stack.forward_eagle3(emb=emb, hidden=hidden, cos=cos, sin=sin, **inputs)

    def extend_proposals(
        self, draft: Eagle3Draft, batch: ForwardBatch, backend: MLAAttentionBackend, features: torch.Tensor, k: int,
        states: DraftState, rows: torch.Tensor, feature_rows: torch.Tensor | None = None,
    ) -> bool:
        """A draft extend over the target ``features`` (token t's: ``features[feature_rows[t]]``
        where given) in one call (``DecoderStack.extend_proposals``): at each of
        ``batch.logits_indices`` the target ids of the draft's top ``k`` (with k > 1 their
        log-probabilities too) and the hidden fed to the next step, written to ``rows`` of
        ``states``. False (nothing written) where Eagle3Draft.forward must run (image embeddings,
        fc_norm, a batch attended decompressed)."""
        head = self._head_of(draft)
        if (head is None or not head.extends or batch.input_embeds is not None or features.dtype != torch.bfloat16
                or features.shape[-1] != head.fc_in):
            return False
        inputs = _absorbed_inputs(backend, features, batch)
        table = self._rope_table(draft, features, backend, max(batch.seq_lens_cpu), batch.num_tokens)
        if inputs is None or table is None:
            return False
        self.stack.extend_proposals(
            ids=batch.input_ids, features=features, feature_rows=feature_rows, positions=batch.positions, rope_table=table,
            logits_rows=batch.logits_indices, k=k, state_rows=rows, state_tokens=states.topk_tokens,
            state_logprobs=states.topk_logprobs, state_hidden=states.hidden, **inputs,
        )
        return True

    def draft_chain(
        self, draft: Eagle3Draft, roots: torch.Tensor, rows: torch.Tensor, states: DraftState, backend: MLAAttentionBackend,
        prefix: list[int], prefix_t: torch.Tensor, steps: int, final_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``steps`` top-1 draft steps in one call (``DecoderStack.draft_chain``) for the requests of
        cache ``rows`` [B], from their ``states`` (step 0's token, the fed-back hidden) after each
        request's ``prefix`` (also as the tensor ``prefix_t``): the chain [B, steps + 2] (roots, step
        0's tokens, the drafted target ids; fewer steps once every request drafted one of its
        ``final_ids`` [B, S], -1 padded), or None where the per-step Eagle3Draft.forward must run
        (it would not take the tile-layout kernels throughout)."""
        table = self._round_rope_table(draft, states.hidden, backend, max(prefix) + steps, rows.shape[0])
        if table is None:
            return None
        return self.stack.draft_chain(
            roots=roots, state_rows=rows, prefix=prefix_t, state_tokens=states.topk_tokens, state_hidden=states.hidden,
            rope_table=table, kv=backend.pool.kv, req_to_token=backend.cache.req_to_token, steps=steps, final_ids=final_ids,
        )

    def draft_tree(
        self, draft: Eagle3Draft, roots: torch.Tensor, rows: torch.Tensor, states: DraftState, k: int,
        backend: MLAAttentionBackend, prefix: list[int], prefix_t: torch.Tensor, steps: int, num_nodes: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """EAGLE-2 tree drafting of a round in one call (``DecoderStack.draft_tree``) for the requests
        of cache ``rows`` [B]: from each one's top-k tokens, scores and hidden in ``states``,
        ``steps - 1`` draft steps, then the best ``num_nodes - 1`` candidates under the ``roots``:
        (tokens, parents, depths) [B, num_nodes], or None where the per-step Eagle3Draft.forward must run."""
        table = self._round_rope_table(draft, states.hidden, backend, max(prefix) + steps, rows.shape[0] * k)
        if table is None:
            return None
        return tuple(self.stack.draft_tree(
            roots=roots, state_rows=rows, prefix=prefix_t, state_tokens=states.topk_tokens, state_logprobs=states.topk_logprobs,
            state_hidden=states.hidden, rope_table=table, kv=backend.pool.kv, req_to_token=backend.cache.req_to_token,
            steps=steps, k=k, num_nodes=num_nodes,
        ))

    def _round_rope_table(
        self, draft: Eagle3Draft, hidden: torch.Tensor, backend: MLAAttentionBackend, positions: int, rows: int
    ) -> torch.Tensor | None:
        """The rotary table of ``positions`` for a drafting call, or None where the draft's head or a
        draft step of ``rows`` tokens would not run on the tile-layout kernels."""
        if self._head_of(draft) is None:
            return None
        return self._rope_table(draft, hidden, backend, positions, rows)

    def _head_of(self, draft: Eagle3Draft) -> _DraftHead | None:
        """The draft's head, handed to the stack on first use; None where its lm_head or final norm
        would not run on the tile-layout kernels."""
        if not self._head_checked:
            self._head_checked = True
            lm_head, dtype = draft.lm_head_module(), torch.bfloat16
            tiles, embed = amx_tiles(lm_head.weight), draft.embed_weight()
            if (tiles is not None
                    and all(t.dtype == dtype for t in (embed, draft.fc.weight, draft.norm.weight))
                    and (lm_head.bias is None or lm_head.bias.dtype == dtype)):
                fc_tiles = amx_tiles(draft.fc.weight)
                self.stack.set_draft_head(
                    fc=fc_tiles, fc_out=draft.fc.weight.shape[0], embed=embed.detach(), norm_weight=draft.norm.weight.detach(),
                    norm_eps=draft.norm.eps, lm_head=tiles, vocab=lm_head.weight.shape[0],
                    lm_head_bias=None if lm_head.bias is None else lm_head.bias.detach(), d2t=draft.d2t,
                    norm_output=draft.config.norm_output,
                )
                self._head = _DraftHead(extends=fc_tiles is not None and draft.fc_norm is None, fc_in=draft.fc.in_features)
        return self._head

    @staticmethod
    def _rope_table(
        draft: Eagle3Draft, hidden: torch.Tensor, backend: MLAAttentionBackend, positions: int, rows: int
    ) -> torch.Tensor | None:
        """The draft's rotary table of at least ``positions`` rows, or None where a draft step of
        ``rows`` tokens would not run on the tile-layout kernels."""
        if (not isinstance(backend, CpuMLAAttention) or torch.is_grad_enabled() or rows > PADDED_MAX_ROWS
                or hidden.dtype != torch.bfloat16):
            return None
        return draft.rotary.table_as(positions, torch.bfloat16)
