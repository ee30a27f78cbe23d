"""The DeepSeek-V3 text configuration read from a checkpoint's config.json, shared by the models.

Accepts the published spellings (DeepSeek-V3, Kimi-K2 / Kimi-K2.5 as released) and the ones
transformers 5 writes (``rope_parameters``, ``image_token_id``, ...). Anything eaglet does not
implement is refused with a :class:`ConfigError` instead of being run differently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.errors import ConfigError
from eaglet.layers.rotary import RopeConfig
from eaglet.models.quantization import QuantScheme


@dataclass(frozen=True)
class TextConfig:
    """The DeepSeek-V3 language model (also the text part of Kimi-K2 / Kimi-K2.5)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    num_nextn_predict_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the compressed latent plus the roped key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime needs to build a model: the text config, and for Kimi-K2.5 the vision part."""

    architecture: str  # config.json's model_type, the key of models/registry.py's MODELS
    text: TextConfig
    vision: Any = None  # KimiVisionConfig for kimi_k25
    image_token_id: int | None = None
    raw: dict | None = None
    quantization: QuantScheme | None = None  # the checkpoint's quantization_config, parsed

    @property
    def is_multimodal(self) -> bool:
        return self.vision is not None


def read_config_json(model_dir: str | Path, kind: str = "Hugging Face model") -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (expected a {kind} directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return raw


def _get(raw: dict, key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if key not in raw or raw[key] is None:
        if default is ...:
            raise ConfigError(f"{where}: missing required key '{key}'")
        return default
    value = raw[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise ConfigError(f"{where}: '{key}' must be {names}, got {value!r}")
    return value


def _positive(raw: dict, key: str, where: str, default: Any = ...) -> int:
    value = _get(raw, key, int, where, default)
    if value <= 0:
        raise ConfigError(f"{where}: '{key}' must be positive, got {value}")
    return value


def parse_rope_config(raw: dict, where: str) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_scaling / rope_parameters must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=float(theta), rope_type="default")
    if rope_type != "yarn":
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (default or yarn)")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if original is None:
        original = raw.get("max_position_embeddings")
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ConfigError(f"{where}: yarn 'factor' must be a positive number, got {factor!r}")
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def parse_text_config(raw: dict, where: str) -> TextConfig:
    topk_method = raw.get("topk_method", "noaux_tc")
    scoring_func = raw.get("scoring_func", "sigmoid")
    if topk_method != "noaux_tc" or scoring_func != "sigmoid":
        raise ConfigError(
            f"{where}: routing topk_method={topk_method!r}, scoring_func={scoring_func!r} is not "
            f"supported (eaglet implements noaux_tc with sigmoid scores, as DeepSeek-V3 and Kimi-K2)"
        )
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{where}: hidden_act {hidden_act!r} is not supported (silu)")
    moe_layer_freq = raw.get("moe_layer_freq", 1)
    if moe_layer_freq != 1:
        raise ConfigError(f"{where}: moe_layer_freq {moe_layer_freq!r} is not supported (1)")

    num_heads = _positive(raw, "num_attention_heads", where)
    num_kv_heads = raw.get("num_key_value_heads", num_heads)
    if num_kv_heads not in (None, num_heads):
        raise ConfigError(f"{where}: MLA needs num_key_value_heads == num_attention_heads")
    q_lora_rank = _get(raw, "q_lora_rank", int, where, None)
    n_routed = _get(raw, "n_routed_experts", int, where, 0)
    n_group = _get(raw, "n_group", int, where, 1)
    topk_group = _get(raw, "topk_group", int, where, 1)
    top_k = _get(raw, "num_experts_per_tok", int, where, 0 if not n_routed else ...)
    qk_rope = _positive(raw, "qk_rope_head_dim", where)
    if qk_rope % 2:
        raise ConfigError(f"{where}: qk_rope_head_dim must be even, got {qk_rope}")
    if n_routed:
        if n_group <= 0 or n_routed % n_group:
            raise ConfigError(f"{where}: n_routed_experts {n_routed} must be divisible by n_group {n_group}")
        if n_routed // n_group < 2:
            raise ConfigError(f"{where}: each expert group needs at least 2 experts (group score = top-2 sum)")
        if not 0 < topk_group <= n_group:
            raise ConfigError(f"{where}: topk_group {topk_group} must be in 1..n_group ({n_group})")
        if not 0 < top_k <= topk_group * (n_routed // n_group):
            raise ConfigError(
                f"{where}: num_experts_per_tok {top_k} must be in 1..topk_group*experts_per_group"
            )
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    config = TextConfig(
        vocab_size=_positive(raw, "vocab_size", where),
        hidden_size=_positive(raw, "hidden_size", where),
        intermediate_size=_positive(raw, "intermediate_size", where),
        moe_intermediate_size=_positive(raw, "moe_intermediate_size", where, 1),
        num_hidden_layers=_positive(raw, "num_hidden_layers", where),
        num_attention_heads=num_heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=_positive(raw, "kv_lora_rank", where),
        qk_nope_head_dim=_positive(raw, "qk_nope_head_dim", where),
        qk_rope_head_dim=qk_rope,
        v_head_dim=_positive(raw, "v_head_dim", where),
        n_routed_experts=n_routed,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=_get(raw, "n_shared_experts", int, where, 0),
        first_k_dense_replace=_get(raw, "first_k_dense_replace", int, where, 0),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, where, 1.0),
        norm_topk_prob=_get(raw, "norm_topk_prob", bool, where, True),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, where, 1e-6),
        max_position_embeddings=_positive(raw, "max_position_embeddings", where),
        rope=parse_rope_config(raw, where),
        rope_interleave=_get(raw, "rope_interleave", bool, where, True),
        attention_bias=_get(raw, "attention_bias", bool, where, False),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, where, False),
        eos_token_ids=eos_ids,
        num_nextn_predict_layers=_get(raw, "num_nextn_predict_layers", int, where, 0),
    )
    if q_lora_rank is not None and q_lora_rank <= 0:
        raise ConfigError(f"{where}: q_lora_rank must be positive or null, got {q_lora_rank}")
    return config
