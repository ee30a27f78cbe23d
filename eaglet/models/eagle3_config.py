"""An EAGLE-3 draft's config.json, checked against its target's config.

The two published kinds (see ``eagle3.py``): a Llama draft (grouped-query attention, Llama RoPE)
and an MLA draft (the Kimi-K2.5 "EAGLE3 MLA" head), whose attention is parsed as DeepSeek-V3's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglet.errors import ConfigError
from eaglet.layers.gqa_attention import LlamaRopeConfig
from eaglet.models.config import ModelConfig, TextConfig, parse_text_config


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
