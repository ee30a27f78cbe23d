"""EAGLE-3 draft models (one decoder layer over the target's features), written for inference.

Two published kinds:

* ``LlamaForCausalLMEagle3`` (SpecForge / EAGLE reference / ModelOpt): grouped-query attention with
  Llama RoPE (``default`` or ``llama3`` scaling); its own K/V cache (:class:`GQAKVPool`);
* ``Eagle3DeepseekV2ForCausalLM`` (the Kimi-K2.5 "EAGLE3 MLA" head; aliases
  ``Eagle3DeepseekV3ForCausalLM``, SpecForge's ``DeepseekV3ForCausalLMEagle3``): MLA attention whose
  ``q_a_proj`` / ``kv_a_proj_with_mqa`` read the 2H concatenation; its cache holds the MLA latent.

One step (``forward``)::

    h = fc(cat(fc_norm.i(feature chunk i)))   on target features, else the fed-back draft hidden
    x = cat(input_layernorm(emb), hidden_norm(h))
    h = h + attn(x);  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                 over the draft vocabulary
    fed back next step: h (or norm(h) with ``norm_output``)

Checkpoint names (published, no ``model.`` prefix in SpecForge / SGLang / ModelOpt exports; a
``model.`` prefix on everything but ``lm_head``/``d2t``/``t2d`` is accepted as SGLang's loader does):
``fc.weight``, ``fc_norm.{i}.weight``, ``midlayer.*`` or ``layers.0.*``, ``norm.weight``,
``lm_head.weight``, ``d2t`` (int64 offsets: target_id = draft_id + d2t[draft_id]), ``t2d`` (bool
[vocab]), optional ``embed_tokens.weight``. Missing pieces come from the target: ``embed_tokens``
always when absent; ``lm_head`` when the draft vocabulary is the full vocabulary and the checkpoint
has none. ``t2d`` is derived from ``d2t`` when absent (ModelOpt exports only ``d2t``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eaglet.backends.base import Backend
from eaglet.backends.pytorch.gqa_attention import TorchGQAAttention
from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
from eaglet.backends.stack import DecoderStack, StackLayer
from eaglet.errors import CheckpointError, ConfigError
from eaglet.layers.gqa_attention import GQAAttention, LlamaRotaryEmbedding
from eaglet.layers.linear import Linear
from eaglet.layers.mla import MLAAttention
from eaglet.layers.moe import SwiGLU
from eaglet.layers.norms import RMSNorm
from eaglet.layers.rotary import RotaryEmbedding
from eaglet.models.config import ModelConfig, read_config_json
from eaglet.models.deepseek_v3 import stack_config, stack_layer
from eaglet.models.eagle3_config import Eagle3Config
from eaglet.models.loader import checkpoint_files, load_weights, skip_init
from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.runtime.kv_cache import GQAKVPool, KVCacheManager, LatentKVPool

@dataclass
class DraftOutput:
    logits: torch.Tensor  # [K, draft_vocab] float32 at batch.logits_indices
    hidden_out: torch.Tensor  # [K, H] what the next draft step feeds back at those rows


class Eagle3DecoderLayer(nn.Module):
    """The EAGLE-3 midlayer: attention over cat(input_layernorm(emb), hidden_norm(h)), then SwiGLU."""

    def __init__(self, config: Eagle3Config, rotary: RotaryEmbedding, backend: Backend) -> None:
        super().__init__()
        hidden, eps, ops = config.hidden_size, config.rms_norm_eps, backend.layers
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.hidden_norm = RMSNorm(hidden, eps, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.self_attn: nn.Module
        if config.kind == "mla":
            self.self_attn = MLAAttention(config.mla, 0, rotary, backend, input_size=2 * hidden)
        else:
            attn = config.llama
            self.self_attn = GQAAttention(
                layer_id=0,
                input_size=2 * hidden,
                hidden_size=hidden,
                num_heads=attn.num_attention_heads,
                num_kv_heads=attn.num_key_value_heads,
                head_dim=attn.head_dim,
                bias=attn.bias,
                rotary=rotary,
                weights=backend.weights,
            )
        self.mlp = SwiGLU(hidden, config.intermediate_size, backend.weights)

    def stack_layer(self) -> StackLayer | None:
        """An MLA midlayer's weights by role for a one-layer decoder stack (a GQA one has none)."""
        if not isinstance(self.self_attn, MLAAttention):
            return None
        return stack_layer(self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm, self.hidden_norm)

    def forward(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        attention: MLAAttentionBackend | TorchGQAAttention,
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, cos, sin, batch, attention)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    """One EAGLE-3 draft. Build under ``skip_init(dtype)``; :func:`load_eagle3_draft` does both.

    The layout flags say which optional tensors the checkpoint carries and how its names are spelled;
    ``checkpoint_weights`` maps every parameter (and the d2t/t2d buffers) to its checkpoint name.
    """

    def __init__(
        self,
        config: Eagle3Config,
        backend: Backend,
        *,
        own_embed_tokens: bool = False,
        own_lm_head: bool = True,
        checkpoint_d2t: bool | None = None,
        checkpoint_t2d: bool | None = None,
        checkpoint_prefix: str = "",
        layer_prefix: str = "midlayer.",
    ) -> None:
        super().__init__()
        if not own_lm_head and config.draft_vocab_size != config.vocab_size:
            raise ConfigError(f"a draft vocabulary of {config.draft_vocab_size} ids needs the draft's own lm_head")
        self.config = config
        self.own_embed_tokens = own_embed_tokens
        self.own_lm_head = own_lm_head
        self.checkpoint_d2t = config.has_draft_vocab if checkpoint_d2t is None else checkpoint_d2t
        self.checkpoint_t2d = config.has_draft_vocab if checkpoint_t2d is None else checkpoint_t2d
        if config.draft_vocab_size != config.vocab_size and not self.checkpoint_d2t:
            raise ConfigError(f"a draft vocabulary of {config.draft_vocab_size} ids needs d2t in the checkpoint")
        self.checkpoint_prefix = checkpoint_prefix
        self.layer_prefix = layer_prefix
        self._shared: dict[str, nn.Module] = {}  # target modules (not registered: not the draft's parameters)
        self.backend = backend

        hidden = config.hidden_size
        if config.kind == "mla":
            self.rotary: RotaryEmbedding = RotaryEmbedding(
                config.mla.qk_rope_head_dim, config.mla.rope, config.mla.rope_interleave, backend.layers
            )
        else:
            self.rotary = LlamaRotaryEmbedding(config.llama.head_dim, config.llama.rope)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embed_tokens else None
        num_aux = len(config.aux_layer_ids)
        self.fc = Linear(num_aux * config.target_hidden_size, hidden, False, backend.weights)
        self.fc_norm = (
            nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps, backend.layers) for _ in range(num_aux))
            if config.fc_norm
            else None
        )
        self.midlayer = Eagle3DecoderLayer(config, self.rotary, backend)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, backend.layers)
        self.lm_head = Linear(hidden, config.draft_vocab_size, False, backend.weights) if own_lm_head else None
        # target_id = draft_id + d2t[draft_id]; t2d[target_id]: whether the draft vocabulary holds it.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        # The midlayer in one call for the batches it takes (and the round's drafting, eaglet.spec),
        # where the backend has a decoder stack.
        self.stack: DecoderStack | None = None

    # ---- loading -------------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        """The checkpoint tensor name of a parameter / buffer name of this module."""
        if name.startswith("lm_head.") or name in ("d2t", "t2d"):
            return name
        if name.startswith("midlayer."):
            name = self.layer_prefix + name.removeprefix("midlayer.")
        return self.checkpoint_prefix + name

    def checkpoint_weights(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Loader hook: checkpoint name -> tensor to fill (parameters, d2t / t2d when the checkpoint has them)."""
        targets = {prefix + self.checkpoint_name(n): p.data for n, p in self.named_parameters()}
        if self.checkpoint_d2t:
            targets[prefix + "d2t"] = self.d2t
        if self.checkpoint_t2d:
            targets[prefix + "t2d"] = self.t2d
        return targets

    def process_weights_after_loading(self) -> None:
        """Checks the vocabulary mapping; derives t2d from d2t when the checkpoint has no t2d."""
        draft_vocab, vocab = self.config.draft_vocab_size, self.config.vocab_size
        target_ids = torch.arange(draft_vocab, device=self.d2t.device) + self.d2t
        if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab):
            raise CheckpointError(f"d2t maps draft ids outside the target vocabulary [0, {vocab})")
        if torch.unique(target_ids).numel() != draft_vocab:
            raise CheckpointError("d2t maps two draft ids to the same target id")
        if not self.checkpoint_t2d:
            self.t2d.zero_()
            self.t2d[target_ids] = True
        elif int(self.t2d.sum()) != draft_vocab or not bool(self.t2d[target_ids].all()):
            raise CheckpointError("t2d does not mark exactly the target ids that d2t maps the draft vocabulary to")
        layer = self.midlayer.stack_layer()
        if layer is not None:
            config = stack_config(self.config.mla, self.midlayer.self_attn.scaling)
            self.stack = self.backend.decoder_stack(config, [layer])

    def share_target_weights(self, embed_tokens: nn.Embedding, lm_head: Linear | None) -> None:
        """Uses the target's embed_tokens when the checkpoint has none, and its lm_head when needed."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if not self.own_embed_tokens:
            if tuple(embed_tokens.weight.shape) != expected:
                raise ConfigError(
                    f"the draft shares the target's embed_tokens, shaped {list(embed_tokens.weight.shape)}; "
                    f"the draft needs {list(expected)}"
                )
            self._shared["embed_tokens"] = embed_tokens
        if not self.own_lm_head:
            if lm_head is None:
                raise ConfigError("the draft has no lm_head of its own and needs the target's")
            if tuple(lm_head.weight.shape) != expected:
                raise ConfigError(
                    f"the draft shares the target's lm_head, shaped {list(lm_head.weight.shape)}; "
                    f"the draft needs {list(expected)}"
                )
            self._shared["lm_head"] = lm_head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the draft sees them (its own table or the target's)."""
        return self._module("embed_tokens")(input_ids)

    def embed_weight(self) -> torch.Tensor:
        return self._module("embed_tokens").weight

    def lm_head_module(self) -> Linear:
        return self._module("lm_head")

    def _module(self, name: str) -> nn.Module:
        own = getattr(self, name)
        if own is not None:
            return own
        if name not in self._shared:
            raise RuntimeError(f"the draft uses the target's {name}: call share_target_weights first")
        return self._shared[name]

    # ---- runtime -------------------------------------------------------------------------------
    def make_kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> LatentKVPool | GQAKVPool:
        """The draft's own cache buffers (one layer) over the slot space shared with the target."""
        if self.config.kind == "mla":
            return LatentKVPool(1, num_slots, self.config.mla.kv_cache_dim, dtype, device)
        attn = self.config.llama
        return GQAKVPool(1, num_slots, attn.num_key_value_heads, attn.head_dim, dtype, device)

    def make_attention(self, cache: KVCacheManager, pool: LatentKVPool | GQAKVPool) -> MLAAttentionBackend | TorchGQAAttention:
        """Attention over the draft's pool: the backend's MLA attention, or PyTorch GQA for a Llama draft."""
        if self.config.kind == "mla":
            return self.backend.mla_attention(cache, pool)
        return TorchGQAAttention(cache, pool)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def greedy_target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """The target ids of the draft's argmax over its vocabulary."""
        return self.backend.sampling.argmax(logits, self.d2t)

    def top_k_target_ids(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk_logprobs`` of the draft's logits, its ids mapped to target ids."""
        return self.backend.sampling.topk_logprobs(logits, k, self.d2t)

    def forward(
        self,
        batch: ForwardBatch,
        attention: MLAAttentionBackend | TorchGQAAttention,
        hidden: torch.Tensor,
        *,
        hidden_is_target_features: bool,
    ) -> DraftOutput:
        """hidden: [T, len(aux) * target_hidden] target features (then fc), or [T, H] fed-back draft hidden."""
        if hidden.shape[0] != batch.num_tokens:
            raise ValueError(f"hidden has {hidden.shape[0]} rows, the batch {batch.num_tokens} tokens")
        if hidden_is_target_features:
            if hidden.shape[-1] != self.fc.in_features:
                raise ValueError(f"target features are {hidden.shape[-1]} wide, fc reads {self.fc.in_features}")
            hidden = hidden.to(self.fc.weight.dtype)
            if self.fc_norm is not None:
                chunks = hidden.chunk(len(self.fc_norm), dim=-1)
                hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
            hidden = self.fc(hidden)
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"fed-back hidden is {hidden.shape[-1]} wide, the draft's hidden_size is {self.config.hidden_size}"
            )
        emb = batch.input_embeds if batch.input_embeds is not None else self.embed(batch.input_ids)
        cos, sin = self.rotary.cos_sin_as(batch.positions, self.fc.weight.dtype)
        emb, hidden = emb.to(hidden.dtype), hidden.to(self.fc.weight.dtype)
        stacked = self.stack.forward_eagle3(emb, hidden, cos, sin, batch, attention) if self.stack is not None else None
        hidden = stacked if stacked is not None else self.midlayer(emb, hidden, cos, sin, batch, attention)
        rows = hidden[batch.logits_indices]
        normed = self.norm(rows)
        logits = self.lm_head_module().logits(normed)
        return DraftOutput(logits=logits, hidden_out=normed if self.config.norm_output else rows)


def _checkpoint_layout(names: set[str], config: Eagle3Config) -> dict[str, Any]:
    """Which optional tensors the checkpoint has and how its names are spelled (Eagle3Draft kwargs)."""
    root = "model." if any(n.startswith("model.") for n in names) else ""
    layer = "layers.0." if any(n.startswith(f"{root}layers.0.") for n in names) else "midlayer."
    full_vocab = config.draft_vocab_size == config.vocab_size
    return dict(
        own_embed_tokens=f"{root}embed_tokens.weight" in names,
        own_lm_head="lm_head.weight" in names or not full_vocab,
        checkpoint_d2t="d2t" in names or not full_vocab,
        checkpoint_t2d="t2d" in names,
        checkpoint_prefix=root,
        layer_prefix=layer,
    )


def load_eagle3_draft(
    path: str | Path,
    target: ModelConfig,
    dtype: torch.dtype,
    backend: Backend,
    show_progress: bool = False,
) -> tuple[Eagle3Draft, Eagle3Config]:
    """Reads config.json + safetensors of an EAGLE-3 draft checked against its target's config.

    The returned draft still needs ``share_target_weights`` when it lacks embed_tokens or lm_head.
    """
    path = Path(path)
    config = Eagle3Config.from_hf(read_config_json(path, "EAGLE-3 draft"), target)
    layout = _checkpoint_layout(set(checkpoint_files(path)), config)
    target_hidden = target.text.hidden_size
    if config.hidden_size != target_hidden:
        for name in ("embed_tokens", "lm_head"):
            if not layout[f"own_{name}"]:
                raise ConfigError(
                    f"{path}: draft hidden_size {config.hidden_size} != the target's {target_hidden}, and the "
                    f"checkpoint has no {name} of its own (it would share the target's)"
                )
    with skip_init(dtype):
        draft = Eagle3Draft(config, backend, **layout)
    for param in draft.parameters():
        param.requires_grad_(False)
    load_weights(draft.eval(), path, show_progress=show_progress)
    return draft, config
