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

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eaglet.config import ModelConfig, TextConfig, parse_text_config, read_config_json
from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.runtime.kv_cache import KVCacheManager, LatentKVPool
from eaglet.errors import CheckpointError, ConfigError
from eaglet.layers.attention_backend import FusedCPUMLABackend, TorchNativeMLABackend
from eaglet.layers.gqa_attention import (
    GQAAttention,
    GQAKVPool,
    LlamaRopeConfig,
    LlamaRotaryEmbedding,
    TorchNativeGQABackend,
)
from eaglet.layers.linear import linear, logits_linear
from eaglet.layers.mla import MLAAttention
from eaglet.layers.moe import SwiGLU
from eaglet.layers.norms import RMSNorm
from eaglet.layers.rotary import RotaryEmbedding
from eaglet.layers.sampler import greedy_tokens, top_k_logprobs
from eaglet.models.loader import checkpoint_files, load_weights, skip_init

if TYPE_CHECKING:
    from eaglet.kernels.decoder_stack import FusedMidlayer

LLAMA_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMEagle3")
# Routing keys an MLA draft config inherits from its target (ModelOpt copies them); a draft has no MoE.
_MOE_KEYS = (
    "topk_method", "scoring_func", "moe_layer_freq", "n_routed_experts", "num_experts_per_tok", "n_group",
    "topk_group", "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
    "moe_intermediate_size", "num_nextn_predict_layers",
)  # fmt: skip


@dataclass(frozen=True)
class LlamaDraftAttentionConfig:
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    bias: bool  # q/k/v/o biases ("attention_bias" or "bias")
    rope: LlamaRopeConfig


@dataclass(frozen=True)
class Eagle3Config:
    kind: str  # "llama" or "mla"
    architecture: str
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int  # = vocab_size when the config has none
    has_draft_vocab: bool  # whether config.json sets draft_vocab_size
    aux_layer_ids: tuple[int, ...]  # "output of layer id" (SGLang / SpecForge): target capture_layers
    fc_norm: bool
    norm_output: bool
    rms_norm_eps: float
    llama: LlamaDraftAttentionConfig | None = None
    mla: TextConfig | None = None
    raw: dict | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(cls, raw: dict, target: ModelConfig) -> Eagle3Config:
        where = "EAGLE-3 draft config"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        quant = raw.get("quantization_config")
        if quant:
            raise ConfigError(f"{where}: quantized drafts are not supported (quantization_config={quant!r})")
        archs = raw.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
            raise ConfigError(f"{where}: 'architectures' must list exactly one architecture, got {archs!r}")
        arch = archs[0]
        if arch in LLAMA_ARCHITECTURES:
            kind = "llama"
        elif arch in MLA_ARCHITECTURES:
            kind = "mla"
        else:
            raise ConfigError(
                f"{where}: unknown draft architecture {arch!r}; eaglet runs "
                f"{', '.join(LLAMA_ARCHITECTURES + MLA_ARCHITECTURES)}"
            )
        where = f"{where} ({arch})"
        num_layers = raw.get("num_hidden_layers", 1)
        if num_layers != 1:
            raise ConfigError(f"{where}: num_hidden_layers must be 1 (one EAGLE-3 midlayer), got {num_layers!r}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
        if raw.get("tie_word_embeddings"):
            raise ConfigError(f"{where}: tie_word_embeddings true is not supported for EAGLE-3 drafts")
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ConfigError(f"{where}: 'eagle_config' must be an object, got {eagle!r}")
        for flag in ("norm_before_residual", "norm_before_fc"):
            if raw.get(flag, eagle.get(flag)):
                raise ConfigError(f"{where}: '{flag}: true' is not supported")
        if not eagle.get("use_aux_hidden_state", True):
            raise ConfigError(f"{where}: use_aux_hidden_state false (no target features) is not EAGLE-3")

        text = target.text
        hidden = _int(raw, "hidden_size", where)
        target_hidden = raw.get("target_hidden_size") or hidden
        if target_hidden != text.hidden_size:
            spelled = "target_hidden_size"
            if not raw.get("target_hidden_size"):
                spelled += " (absent: hidden_size)"
            raise ConfigError(f"{where}: {spelled} {target_hidden} != the target's hidden_size {text.hidden_size}")
        vocab = _int(raw, "vocab_size", where)
        if vocab != text.vocab_size:
            raise ConfigError(f"{where}: vocab_size {vocab} != the target's vocab_size {text.vocab_size}")
        has_draft_vocab = raw.get("draft_vocab_size") is not None
        draft_vocab = _int(raw, "draft_vocab_size", where) if has_draft_vocab else vocab
        if draft_vocab > vocab:
            raise ConfigError(f"{where}: draft_vocab_size {draft_vocab} > vocab_size {vocab}")
        aux = _aux_layer_ids(raw, eagle, text.num_hidden_layers, where)

        mla = llama = None
        if kind == "mla":
            mla = parse_text_config({k: v for k, v in raw.items() if k not in _MOE_KEYS}, where=where)
            if mla.q_lora_rank is None:
                raise ConfigError(f"{where}: the MLA draft requires q_lora_rank (q_a_proj reads the 2H input)")
            intermediate, eps = mla.intermediate_size, mla.rms_norm_eps
        else:
            llama = _parse_llama_attention(raw, hidden, where)
            intermediate = _int(raw, "intermediate_size", where)
            eps = float(raw.get("rms_norm_eps") or 1e-6)
            if raw.get("mlp_bias"):
                raise ConfigError(f"{where}: mlp_bias true is not supported")
        return cls(
            kind=kind,
            architecture=arch,
            hidden_size=hidden,
            target_hidden_size=target_hidden,
            intermediate_size=intermediate,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            has_draft_vocab=has_draft_vocab,
            aux_layer_ids=aux,
            fc_norm=bool(raw.get("fc_norm", eagle.get("fc_norm")) or raw.get("use_aux_norm")),
            norm_output=bool(raw.get("norm_output", eagle.get("norm_output", False))),
            rms_norm_eps=eps,
            llama=llama,
            mla=mla,
            raw=raw,
        )


def _int(raw: dict, key: str, where: str) -> int:
    value = raw.get(key)
    if value is None:
        raise ConfigError(f"{where}: missing required key '{key}'")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _aux_layer_ids(raw: dict, eagle: dict, num_target_layers: int, where: str) -> tuple[int, ...]:
    nested = eagle.get("eagle_aux_hidden_state_layer_ids")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if nested is not None and top is not None and nested != top:
        raise ConfigError(
            f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {nested} disagrees with the top-level "
            f"eagle_aux_hidden_state_layer_ids {top}"
        )
    ids = nested if nested is not None else top
    n = num_target_layers
    if ids is None:  # SpecForge's default, in the "output of layer id" convention
        ids, source = [1, n // 2 - 1, n - 4], f"default [1, N//2-1, N-4] for the target's N={n} layers"
    else:
        source = "eagle_aux_hidden_state_layer_ids"
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{where}: {source} must be a list of layer ids, got {ids!r}")
    if len(ids) != 3:
        raise ConfigError(f"{where}: {source} must name exactly 3 target layers, got {list(ids)}")
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise ConfigError(f"{where}: {source} {list(ids)}: layer ids {bad} out of range [0, {n}) of the target")
    return tuple(ids)


def _parse_llama_attention(raw: dict, hidden: int, where: str) -> LlamaDraftAttentionConfig:
    heads = _int(raw, "num_attention_heads", where)
    kv_heads = raw.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{where}: no head_dim and hidden_size {hidden} is not divisible by {heads} heads")
        head_dim = hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ConfigError(f"{where}: head_dim must be a positive even integer, got {head_dim!r}")
    return LlamaDraftAttentionConfig(
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        bias=bool(raw.get("attention_bias") or raw.get("bias")),
        rope=_parse_llama_rope(raw, where),
    )


def _parse_llama_rope(raw: dict, where: str) -> LlamaRopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_scaling / rope_parameters must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return LlamaRopeConfig(theta=float(theta))
    if rope_type != "llama3":
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported for Llama drafts (default or llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ConfigError(f"{where}: llama3 rope_scaling is missing {missing}")
    if params["low_freq_factor"] >= params["high_freq_factor"]:
        raise ConfigError(f"{where}: llama3 rope_scaling needs low_freq_factor < high_freq_factor")
    return LlamaRopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [K, draft_vocab] float32 at batch.logits_indices
    hidden_out: torch.Tensor  # [K, H] what the next draft step feeds back at those rows


class Eagle3DecoderLayer(nn.Module):
    """The EAGLE-3 midlayer: attention over cat(input_layernorm(emb), hidden_norm(h)), then SwiGLU."""

    def __init__(self, config: Eagle3Config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn: nn.Module
        if config.kind == "mla":
            self.self_attn = MLAAttention(config.mla, 0, rotary, input_size=2 * hidden)
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
            )
        self.mlp = SwiGLU(hidden, config.intermediate_size)

    def forward(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        backend: Any,
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, cos, sin, batch, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    """One EAGLE-3 draft. Build under ``skip_init(dtype)``; :func:`load_eagle3_draft` does both.

    The layout flags say which optional tensors the checkpoint carries and how its names are spelled;
    ``checkpoint_weights`` maps every parameter (and the d2t/t2d buffers) to its checkpoint name.
    """

    def __init__(
        self,
        config: Eagle3Config,
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

        hidden = config.hidden_size
        if config.kind == "mla":
            self.rotary: RotaryEmbedding = RotaryEmbedding(
                config.mla.qk_rope_head_dim, config.mla.rope, config.mla.rope_interleave
            )
        else:
            self.rotary = LlamaRotaryEmbedding(config.llama.head_dim, config.llama.rope)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embed_tokens else None
        num_aux = len(config.aux_layer_ids)
        self.fc = nn.Linear(num_aux * config.target_hidden_size, hidden, bias=False)
        self.fc_norm = (
            nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(num_aux))
            if config.fc_norm
            else None
        )
        self.midlayer = Eagle3DecoderLayer(config, self.rotary)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False) if own_lm_head else None
        # target_id = draft_id + d2t[draft_id]; t2d[target_id]: whether the draft vocabulary holds it.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        # The midlayer in one kernel call for the batches it takes (eaglet.kernels.use_cpu_kernels).
        self.fused_midlayer: FusedMidlayer | None = None

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

    def packable_weights(self) -> list[torch.Tensor]:
        """fc and an own lm_head (a shared one is the target's, packed with it)."""
        return [self.fc.weight] + ([self.lm_head.weight] if self.lm_head is not None else [])

    def share_target_weights(self, embed_tokens: nn.Embedding, lm_head: nn.Linear | None) -> None:
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

    def lm_head_module(self) -> nn.Linear:
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

    def make_backend(
        self, cache: KVCacheManager, pool: LatentKVPool | GQAKVPool, fused: bool = False
    ) -> TorchNativeMLABackend | TorchNativeGQABackend:
        """``fused``: an MLA draft attends with the fused CPU kernel (FusedCPUMLABackend)."""
        if self.config.kind == "mla":
            return FusedCPUMLABackend(cache, pool) if fused else TorchNativeMLABackend(cache, pool)
        return TorchNativeGQABackend(cache, pool)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def greedy_target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """The target ids of the draft's argmax over its vocabulary."""
        return greedy_tokens(logits, self.d2t)

    def top_k_target_ids(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``top_k_logprobs`` of the draft's logits, its ids mapped to target ids."""
        return top_k_logprobs(logits, k, self.d2t)

    def forward(
        self,
        batch: ForwardBatch,
        backend: Any,
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
            hidden = linear(hidden, self.fc.weight)
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"fed-back hidden is {hidden.shape[-1]} wide, the draft's hidden_size is {self.config.hidden_size}"
            )
        emb = batch.input_embeds if batch.input_embeds is not None else self.embed(batch.input_ids)
        cos, sin = self.rotary.cos_sin_as(batch.positions, self.fc.weight.dtype)
        emb, hidden = emb.to(hidden.dtype), hidden.to(self.fc.weight.dtype)
        fused = self.fused_midlayer.forward(emb, hidden, cos, sin, batch, backend) if self.fused_midlayer is not None else None
        hidden = fused if fused is not None else self.midlayer(emb, hidden, cos, sin, batch, backend)
        rows = hidden[batch.logits_indices]
        normed = self.norm(rows)
        lm_head = self.lm_head_module()
        logits = logits_linear(normed, lm_head.weight, lm_head.bias)
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
        draft = Eagle3Draft(config, **layout)
    for param in draft.parameters():
        param.requires_grad_(False)
    load_weights(draft.eval(), path, show_progress=show_progress)
    return draft, config
