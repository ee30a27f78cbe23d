"""Tiny random checkpoints in the *published* Hugging Face layout, made at test time.

Nothing here is committed as weights: every ``write_*`` function builds a few hundred KB of
random tensors in a directory the caller owns (normally pytest's ``tmp_path``), in well under a
second.  The layouts follow what ``deepseek-ai/DeepSeek-V3`` and ``moonshotai/Kimi-K2.5`` ship:

* DeepSeek-V3 / Kimi-K2 text: ``model.embed_tokens.weight``, ``model.layers.N.self_attn.*``
  (MLA), ``model.layers.N.mlp.{gate,up,down}_proj.weight`` (dense layers),
  ``model.layers.N.mlp.gate.{weight,e_score_correction_bias}``,
  ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` (one tensor per expert, NOT fused),
  ``model.layers.N.mlp.shared_experts.*``, ``model.norm.weight``, ``lm_head.weight``; optional MTP
  layers at ``model.layers.{num_hidden_layers + i}.*`` (DeepSeek-V3 ships one; Kimi ships none).
* Kimi-K2.5: the text model under ``language_model.model.*`` / ``language_model.lm_head.weight``,
  MoonViT under ``vision_tower.*`` (fused ``wqkv`` in the interleaved-RoPE row layout, ``norm0``/
  ``norm1``, ``mlp.fc0``/``mlp.fc1``, ``pos_emb.weight [H, W, D]``), projector ``mm_projector.*``.
* ``e_score_correction_bias`` is always stored as float32 (as in the real bf16 checkpoints);
  every other tensor is stored in ``dtype``.
* Shards are named like the published ones, ``model-00001-of-000002.safetensors`` (5-digit index,
  6-digit total), with ``model.safetensors.index.json``; ``num_shards=1`` writes a single
  ``model.safetensors`` and no index.  Readers must go through the index, never guess names.
* Quantisation is NOT reproduced (DeepSeek-V3 ships FP8 block-quantised linears, Kimi-K2.5 int4
  ``compressed-tensors`` routed experts); these fixtures are unquantised and carry no
  ``quantization_config`` and no ``auto_map``.

transformers 5.24 renames and fuses these tensors on load (see ``transformers/conversion_mapping.py``:
``qwen2_moe`` expert fusion for ``deepseek_v3`` and the ``kimi_k25`` renames).  ``expected_transformers_state``
re-implements that mapping independently so tests can prove the name mapping exactly, and
``transformers_state_to_published`` is its inverse.

A text-only checkpoint with ``model_type="kimi_k2"`` (as Kimi-K2 publishes) is not loaded
correctly by ``DeepseekV3ForCausalLM.from_pretrained`` as is: transformers keeps ``kimi_k2`` as the
model type, finds no weight-conversion mapping for it and leaves the fused experts randomly
initialised.  ``load_reference_deepseek_v3`` therefore loads such a checkpoint through
``to_transformers_config_dir`` as well (``model_type`` rewritten to ``deepseek_v3``).

Kimi-K2.5 config styles:

* ``config_style="published"`` (default): the spellings of the real ``config.json``
  (``media_placeholder_token_id``, ``vision_config.vt_hidden_size`` ..., text ``model_type: kimi_k2``,
  ``rope_scaling`` + top-level ``rope_theta``).  transformers 5.24 does NOT understand these vision
  spellings (it silently falls back to its 1152-wide / 27-layer defaults and the 163605 image token),
  so ``load_reference_kimi_k25`` loads it through ``to_transformers_config_dir`` (a temporary copy whose
  ``config.json`` uses transformers' spellings and whose ``*.safetensors`` / index are symlinks to the
  same files).
* ``config_style="transformers"``: what ``Kimi_K25Config.save_pretrained`` writes (``image_token_id``,
  ``projection_hidden_size``, ``vision_config.hidden_size`` ..., text ``model_type: deepseek_v3`` with
  ``rope_parameters``); loads directly.

The transformers image processor for Kimi-K2.5 imports torchvision, which does not import beside
the CPU torch 2.13 build, so there is no ``reference_image_inputs`` helper: build ``pixel_values``
[num_patches, 3, p, p] (patches in raster order over (h, w)) and ``image_grid_thw`` [[1, h, w]] yourself
(see ``random_image_inputs``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import re
import tempfile
from collections.abc import Iterable

import torch
from safetensors.torch import load_file, save_file

from eaglet.testing.kimi_template import CHAT_TEMPLATE as KIMI_CHAT_TEMPLATE

__all__ = [
    "tiny_text_config",
    "tiny_vision_config",
    "write_deepseek_v3_checkpoint",
    "write_kimi_k25_checkpoint",
    "write_tiny_tokenizer",
    "load_reference_deepseek_v3",
    "load_reference_kimi_k25",
    "to_transformers_config_dir",
    "transformers_config_dict",
    "transformers_kimi_config_dict",
    "read_checkpoint_tensors",
    "expected_transformers_state",
    "transformers_state_to_published",
    "fuse_experts",
    "split_experts",
    "vision_qkv_interleaved_to_rotate_half",
    "vision_qkv_rotate_half_to_interleaved",
    "random_image_inputs",
    "patchify_image",
    "DEEPSEEK_SPECIAL_TOKENS",
    "KIMI_SPECIAL_TOKENS",
    "SHARD_NAME",
    "published_text_config",
    "special_tokens_for",
    "write_tokenizer_files",
]

PathLike = str | os.PathLike

# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------


def tiny_text_config(**overrides) -> dict:
    """Keyword arguments for ``transformers.DeepseekV3Config`` describing a tiny legal model.

    Uses the legacy spellings ``rope_theta`` + ``rope_scaling`` (``None`` or a YaRN dict, e.g.
    ``{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}``), which DeepseekV3Config accepts and
    converts to ``rope_parameters``.  ``rms_norm_eps`` is 1e-6 because transformers builds
    ``q_a_layernorm``/``kv_a_layernorm`` with eps 1e-6 whatever the config says.
    """
    cfg = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling=None,
        rope_interleave=True,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
    )
    cfg.update(overrides)
    _check_text_config(cfg)
    return cfg


def _check_text_config(cfg: dict) -> None:
    e, g, tg, k = cfg["n_routed_experts"], cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]
    if e % g:
        raise ValueError(f"n_routed_experts={e} must be divisible by n_group={g}")
    if e // g < 2:
        raise ValueError("need at least 2 experts per group (group score = sum of the top-2)")
    if tg * (e // g) < k:
        raise ValueError("topk_group * experts_per_group must be >= num_experts_per_tok")
    if cfg["qk_rope_head_dim"] % 2:
        raise ValueError("qk_rope_head_dim must be even")
    if cfg.get("tie_word_embeddings"):
        raise ValueError("published DeepSeek-V3 / Kimi checkpoints are untied; tie_word_embeddings must be False")


def tiny_vision_config(**overrides) -> dict:
    """Keyword arguments for ``transformers.Kimi_K25VisionConfig`` (transformers' spellings)."""
    cfg = dict(
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        pos_emb_height=8,
        pos_emb_width=8,
        pos_emb_time=4,
        merge_kernel_size=[2, 2],
        hidden_act="gelu_pytorch_tanh",
    )
    cfg.update(overrides)
    cfg["merge_kernel_size"] = list(cfg["merge_kernel_size"])
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    if hd * cfg["num_attention_heads"] != cfg["hidden_size"] or hd % 4:
        raise ValueError("vision head dim must be an integer divisible by 4")
    if cfg["pos_emb_height"] != cfg["pos_emb_width"]:
        # transformers resamples the table assuming a square grid (num_grid_per_side = pos_emb_height)
        raise ValueError("transformers assumes a square position table: pos_emb_height == pos_emb_width")
    return cfg


_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def published_text_config(tc: dict, *, model_type: str, dtype: torch.dtype, mtp_layers: int) -> dict:
    """The text config as DeepSeek-V3's / Kimi-K2's config.json spells it."""
    rope_scaling = tc.get("rope_scaling")
    rope_theta = tc.get("rope_theta", 10000.0)
    if tc.get("rope_parameters") is not None:  # accept transformers-5 spelling in overrides
        rp = dict(tc["rope_parameters"])
        rope_theta = rp.pop("rope_theta", rope_theta)
        rtype = rp.pop("rope_type", rp.pop("type", "default"))
        rope_scaling = None if rtype == "default" else {"type": rtype, **rp}
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        if "type" not in rope_scaling and "rope_type" in rope_scaling:
            rope_scaling["type"] = rope_scaling.pop("rope_type")
    out = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": tc["attention_bias"],
        "attention_dropout": tc.get("attention_dropout", 0.0),
        "aux_loss_alpha": 0.001,
        "bos_token_id": tc.get("bos_token_id"),
        "eos_token_id": tc.get("eos_token_id"),
        "ep_size": 1,
        "first_k_dense_replace": tc["first_k_dense_replace"],
        "hidden_act": tc.get("hidden_act", "silu"),
        "hidden_size": tc["hidden_size"],
        "initializer_range": tc.get("initializer_range", 0.02),
        "intermediate_size": tc["intermediate_size"],
        "kv_lora_rank": tc["kv_lora_rank"],
        "max_position_embeddings": tc["max_position_embeddings"],
        "model_type": model_type,
        "moe_intermediate_size": tc["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": tc["n_group"],
        "n_routed_experts": tc["n_routed_experts"],
        "n_shared_experts": tc["n_shared_experts"],
        "norm_topk_prob": tc["norm_topk_prob"],
        "num_attention_heads": tc["num_attention_heads"],
        "num_experts_per_tok": tc["num_experts_per_tok"],
        "num_hidden_layers": tc["num_hidden_layers"],
        "num_key_value_heads": tc["num_key_value_heads"],
        "num_nextn_predict_layers": mtp_layers,
        "pretraining_tp": 1,
        "q_lora_rank": tc["q_lora_rank"],
        "qk_nope_head_dim": tc["qk_nope_head_dim"],
        "qk_rope_head_dim": tc["qk_rope_head_dim"],
        "rms_norm_eps": tc["rms_norm_eps"],
        "rope_scaling": rope_scaling,
        "rope_theta": rope_theta,
        "routed_scaling_factor": tc["routed_scaling_factor"],
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": tc["topk_group"],
        "topk_method": "noaux_tc",
        "torch_dtype": _dtype_name(dtype),
        "transformers_version": "4.33.1" if model_type == "deepseek_v3" else "4.48.3",
        "use_cache": True,
        "v_head_dim": tc["v_head_dim"],
        "vocab_size": tc["vocab_size"],
    }
    if tc.get("pad_token_id") is not None:
        out["pad_token_id"] = tc["pad_token_id"]
    # Published configs have no rope_interleave key (DeepSeek's own code always interleaves);
    # only write it when someone asks for the non-default.
    if not tc.get("rope_interleave", True):
        out["rope_interleave"] = False
    known = set(out) | set(_ROPE_KEYS) | {"rope_interleave", "pad_token_id"}
    for key, value in tc.items():  # anything extra the caller passed goes through verbatim
        if key not in known:
            out[key] = value
    return dict(sorted(out.items()))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# random tensors
# --------------------------------------------------------------------------------------------


class _Rand:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, *shape, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, dtype=torch.float32) * std + mean

    def linear(self, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return self.normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def norm_weight(self, n: int) -> torch.Tensor:
        return self.normal(n, std=0.1, mean=1.0)

    def small(self, *shape) -> torch.Tensor:
        return self.normal(*shape, std=0.1)


def _text_layer_tensors(r: _Rand, tc: dict, prefix: str, layer_idx: int) -> dict[str, torch.Tensor]:
    D, H = tc["hidden_size"], tc["num_attention_heads"]
    P, R, V, L = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"], tc["kv_lora_rank"]
    qr = tc["q_lora_rank"]
    p = f"{prefix}layers.{layer_idx}."
    t: dict[str, torch.Tensor] = {}
    t[p + "input_layernorm.weight"] = r.norm_weight(D)
    if qr is None:
        t[p + "self_attn.q_proj.weight"] = r.linear(H * (P + R), D)
    else:
        t[p + "self_attn.q_a_proj.weight"] = r.linear(qr, D)
        t[p + "self_attn.q_a_layernorm.weight"] = r.norm_weight(qr)
        t[p + "self_attn.q_b_proj.weight"] = r.linear(H * (P + R), qr)
    t[p + "self_attn.kv_a_proj_with_mqa.weight"] = r.linear(L + R, D)
    t[p + "self_attn.kv_a_layernorm.weight"] = r.norm_weight(L)
    t[p + "self_attn.kv_b_proj.weight"] = r.linear(H * (P + V), L)
    t[p + "self_attn.o_proj.weight"] = r.linear(D, H * V)
    if tc.get("attention_bias"):
        # (published models have none) transformers then biases q_a_proj, kv_a_proj_with_mqa and
        # o_proj only; q_proj, q_b_proj and kv_b_proj stay bias-free
        if qr is not None:
            t[p + "self_attn.q_a_proj.bias"] = r.small(qr)
        t[p + "self_attn.kv_a_proj_with_mqa.bias"] = r.small(L + R)
        t[p + "self_attn.o_proj.bias"] = r.small(D)
    t[p + "post_attention_layernorm.weight"] = r.norm_weight(D)
    if layer_idx < tc["first_k_dense_replace"] and layer_idx < tc["num_hidden_layers"]:
        Im = tc["intermediate_size"]
        t[p + "mlp.gate_proj.weight"] = r.linear(Im, D)
        t[p + "mlp.up_proj.weight"] = r.linear(Im, D)
        t[p + "mlp.down_proj.weight"] = r.linear(D, Im)
    else:
        E, Ie = tc["n_routed_experts"], tc["moe_intermediate_size"]
        t[p + "mlp.gate.weight"] = r.linear(E, D, gain=2.0)
        t[p + "mlp.gate.e_score_correction_bias"] = r.small(E)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = r.linear(Ie, D)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = r.linear(Ie, D)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = r.linear(D, Ie)
        Is = Ie * tc["n_shared_experts"]
        t[p + "mlp.shared_experts.gate_proj.weight"] = r.linear(Is, D)
        t[p + "mlp.shared_experts.up_proj.weight"] = r.linear(Is, D)
        t[p + "mlp.shared_experts.down_proj.weight"] = r.linear(D, Is)
    return t


def _text_tensors(r: _Rand, tc: dict, *, prefix: str = "", mtp_layers: int = 0) -> dict[str, torch.Tensor]:
    D, Vsz, N = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    t: dict[str, torch.Tensor] = {}
    t[prefix + "model.embed_tokens.weight"] = r.normal(Vsz, D)
    for i in range(N):
        t.update(_text_layer_tensors(r, tc, prefix + "model.", i))
    t[prefix + "model.norm.weight"] = r.norm_weight(D)
    # std 2/sqrt(D) on RMS-normalised states: logits std ~2, so greedy top-1 is not a coin toss.
    t[prefix + "lm_head.weight"] = r.linear(Vsz, D, gain=2.0)
    for j in range(mtp_layers):  # DeepSeek-V3 MTP module layout (model.layers.61 in the real one)
        p = f"{prefix}model.layers.{N + j}."
        t.update(_text_layer_tensors(r, tc, prefix + "model.", N + j))
        t[p + "embed_tokens.weight"] = r.normal(Vsz, D)
        t[p + "enorm.weight"] = r.norm_weight(D)
        t[p + "hnorm.weight"] = r.norm_weight(D)
        t[p + "eh_proj.weight"] = r.linear(D, 2 * D)
        t[p + "shared_head.norm.weight"] = r.norm_weight(D)
        t[p + "shared_head.head.weight"] = r.linear(Vsz, D, gain=2.0)
    return t


def _vision_tensors(r: _Rand, vc: dict, text_hidden: int) -> dict[str, torch.Tensor]:
    D, I, p = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    t: dict[str, torch.Tensor] = {}
    t["vision_tower.patch_embed.proj.weight"] = r.normal(D, 3, p, p, std=1.0 / math.sqrt(3 * p * p))
    t["vision_tower.patch_embed.proj.bias"] = r.small(D)
    t["vision_tower.patch_embed.pos_emb.weight"] = r.normal(vc["pos_emb_height"], vc["pos_emb_width"], D, std=0.5)
    for i in range(vc["num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        t[b + "norm0.weight"] = r.norm_weight(D)
        t[b + "norm0.bias"] = r.small(D)
        # published (interleaved-RoPE) row layout; random, so any layout is "the published one"
        t[b + "wqkv.weight"] = r.linear(3 * D, D)
        t[b + "wqkv.bias"] = r.small(3 * D)
        t[b + "wo.weight"] = r.linear(D, D)
        t[b + "wo.bias"] = r.small(D)
        t[b + "norm1.weight"] = r.norm_weight(D)
        t[b + "norm1.bias"] = r.small(D)
        t[b + "mlp.fc0.weight"] = r.linear(I, D)
        t[b + "mlp.fc0.bias"] = r.small(I)
        t[b + "mlp.fc1.weight"] = r.linear(D, I)
        t[b + "mlp.fc1.bias"] = r.small(D)
    t["vision_tower.encoder.final_layernorm.weight"] = r.norm_weight(D)
    t["vision_tower.encoder.final_layernorm.bias"] = r.small(D)
    kh, kw = vc["merge_kernel_size"]
    M = D * kh * kw
    t["mm_projector.pre_norm.weight"] = r.norm_weight(D)
    t["mm_projector.pre_norm.bias"] = r.small(D)
    t["mm_projector.proj.0.weight"] = r.linear(M, M)
    t["mm_projector.proj.0.bias"] = r.small(M)
    t["mm_projector.proj.2.weight"] = r.linear(text_hidden, M)
    t["mm_projector.proj.2.bias"] = r.small(text_hidden)
    return t


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tensors.items():
        keep_fp32 = k.endswith("e_score_correction_bias")  # fp32 in the real bf16 checkpoints
        out[k] = v.to(torch.float32 if keep_fp32 else dtype).contiguous()
    return out


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------

SHARD_NAME = "model-{i:05d}-of-{n:06d}.safetensors"  # as DeepSeek-V3 / Kimi-K2.5 name them
INDEX_NAME = "model.safetensors.index.json"


def _write_shards(path: pathlib.Path, tensors: dict[str, torch.Tensor], num_shards: int,
                  shard_name: str = SHARD_NAME) -> None:
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if num_shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    sizes = [tensors[k].numel() * tensors[k].element_size() for k in names]
    total = sum(sizes)
    # contiguous runs of roughly equal bytes, every shard non-empty
    acc, shard = 0, 1
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    for k, s in zip(names, sizes):
        remaining_names = len(names) - sum(len(g) for g in groups)
        if shard < num_shards and groups[shard - 1] and (
            acc >= total * shard / num_shards or remaining_names <= num_shards - shard
        ):
            shard += 1
        groups[shard - 1].append(k)
        acc += s
    if any(not g for g in groups):
        raise ValueError(f"cannot split {len(names)} tensors into {num_shards} non-empty shards")
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        fname = shard_name.format(i=i, n=num_shards)
        save_file({k: tensors[k] for k in group}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def read_checkpoint_tensors(path: PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (through the index when there is one), as stored."""
    path = pathlib.Path(path)
    if (path / INDEX_NAME).exists():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        out: dict[str, torch.Tensor] = {}
        for fname in sorted(set(weight_map.values())):
            out.update(load_file(str(path / fname)))
        if set(out) != set(weight_map):
            raise AssertionError("index weight_map disagrees with the shard contents")
        return out
    return load_file(str(path / "model.safetensors"))


def write_deepseek_v3_checkpoint(
    path: PathLike,
    text_overrides: dict | None = None,
    *,
    seed: int = 0,
    num_shards: int = 2,
    dtype: torch.dtype = torch.float32,
    model_type: str = "deepseek_v3",
    mtp_layers: int = 0,
    with_tokenizer: bool = False,
) -> pathlib.Path:
    """Write a tiny random DeepSeek-V3 (``model_type="deepseek_v3"``) or Kimi-K2 (``"kimi_k2"``)
    text checkpoint in the published layout and return its directory.

    ``mtp_layers=1`` adds a DeepSeek-V3 style multi-token-prediction layer at
    ``model.layers.{num_hidden_layers}`` and sets ``num_nextn_predict_layers``; transformers does not
    model it (its ignore pattern is hard-wired to ``model.layers.61``), so it reports those tensors
    as unexpected.  An engine must skip them.
    """
    if model_type not in ("deepseek_v3", "kimi_k2"):
        raise ValueError("model_type must be 'deepseek_v3' or 'kimi_k2'")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tc = tiny_text_config(**(text_overrides or {}))
    special = special_tokens_for(model_type, tc["vocab_size"])
    if with_tokenizer:
        tc["bos_token_id"], tc["eos_token_id"] = special["bos"][1], special["eos"][1]
    cfg = published_text_config(tc, model_type=model_type, dtype=dtype, mtp_layers=mtp_layers)
    _write_json(path / "config.json", cfg)
    tensors = _cast(_text_tensors(_Rand(seed), tc, mtp_layers=mtp_layers), dtype)
    _write_shards(path, tensors, num_shards)
    if with_tokenizer:
        write_tokenizer_files(path, tc["vocab_size"], special,
                               chat_style="deepseek" if model_type == "deepseek_v3" else "kimi")
    return path


def write_kimi_k25_checkpoint(
    path: PathLike,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
    *,
    seed: int = 0,
    num_shards: int = 2,
    dtype: torch.dtype = torch.float32,
    config_style: str = "published",
    image_token_id: int = 250,
    max_patches: int = 256,
    with_tokenizer: bool = False,
) -> pathlib.Path:
    """Write a tiny random Kimi-K2.5 checkpoint (published tensor names) and return its directory.

    See the module docstring for the two ``config_style`` values.  Also writes
    ``preprocessor_config.json`` (transformers' Kimi_K25ImageProcessor keys plus the published
    ``media_proc_cfg`` block with the same values).
    """
    if config_style not in ("published", "transformers"):
        raise ValueError("config_style must be 'published' or 'transformers'")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tc = tiny_text_config(**(text_overrides or {}))
    vc = tiny_vision_config(**(vision_overrides or {}))
    if not 0 <= image_token_id < tc["vocab_size"]:
        raise ValueError("image_token_id must be inside the vocabulary")
    special = special_tokens_for("kimi_k25", tc["vocab_size"], image_token_id=image_token_id)
    ids = {name: tid for name, (_, tid) in special.items()}
    if with_tokenizer:
        tc["bos_token_id"], tc["eos_token_id"] = ids["bos"], ids["eos"]
        tc.setdefault("pad_token_id", ids.get("pad"))
    if config_style == "published":
        cfg = _published_kimi_config(tc, vc, dtype=dtype, ids=ids)
    else:
        cfg = _transformers_kimi_config(tc, vc, dtype=dtype, ids=ids)
    _write_json(path / "config.json", cfg)
    tensors = _text_tensors(_Rand(seed), tc, prefix="language_model.")
    tensors.update(_vision_tensors(_Rand(seed + 1_000_003), vc, tc["hidden_size"]))
    _write_shards(path, _cast(tensors, dtype), num_shards)
    _write_json(path / "preprocessor_config.json", _preprocessor_config(vc, max_patches))
    if with_tokenizer:
        write_tokenizer_files(path, tc["vocab_size"], special, chat_style="kimi")
    return path


def _published_kimi_config(tc: dict, vc: dict, *, dtype: torch.dtype, ids: dict) -> dict:
    text = published_text_config(tc, model_type="kimi_k2", dtype=dtype, mtp_layers=0)
    vision = {
        "init_pos_emb_height": vc["pos_emb_height"],
        "init_pos_emb_time": vc["pos_emb_time"],
        "init_pos_emb_width": vc["pos_emb_width"],
        "merge_kernel_size": list(vc["merge_kernel_size"]),
        "merge_type": "sd2_tpool",
        "mm_hidden_size": vc["hidden_size"],
        "mm_projector_type": "patchmerger",
        "patch_size": vc["patch_size"],
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": tc["hidden_size"],
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": vc["hidden_size"],
        "vt_intermediate_size": vc["intermediate_size"],
        "vt_num_attention_heads": vc["num_attention_heads"],
        "vt_num_hidden_layers": vc["num_hidden_layers"],
    }
    if vc.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        vision["hidden_act"] = vc["hidden_act"]
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "bos_token_id": tc.get("bos_token_id"),
        "eos_token_id": tc.get("eos_token_id"),
        "ignore_index": -100,
        "media_placeholder_token_id": ids["media_pad"],
        "model_type": "kimi_k25",
        "pad_token_id": tc.get("pad_token_id", ids.get("pad")),
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "transformers_version": "4.57.1",
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": vision,
    }
    return cfg


def _transformers_kimi_config(tc: dict, vc: dict, *, dtype: torch.dtype, ids: dict) -> dict:
    from transformers import DeepseekV3Config, Kimi_K25Config, Kimi_K25VisionConfig

    # transformers defaults num_nextn_predict_layers (num_mtp_layers) to 1; these fixtures have no MTP
    text = DeepseekV3Config(**{**tc, "num_nextn_predict_layers": 0})
    text.architectures = ["DeepseekV3ForCausalLM"]
    cfg = Kimi_K25Config(
        text_config=text.to_dict(),
        vision_config=Kimi_K25VisionConfig(**vc).to_dict(),
        projection_hidden_size=vc["hidden_size"],
        projection_layer_norm_eps=1e-5,
        image_token_id=ids["media_pad"],
        vision_start_token_id=ids["media_begin"],
        vision_end_token_id=ids["media_end"],
        # no video token in the tiny vocab: park it outside [0, vocab) so it never matches
        video_token_id=tc["vocab_size"] + 1,
        tie_word_embeddings=False,
        bos_token_id=tc.get("bos_token_id"),
        eos_token_id=tc.get("eos_token_id"),
        pad_token_id=tc.get("pad_token_id", ids.get("pad")),
        dtype=_dtype_name(dtype),
    )
    cfg.architectures = ["Kimi_K25ForConditionalGeneration"]
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        return json.loads((pathlib.Path(d) / "config.json").read_text())


def _preprocessor_config(vc: dict, max_patches: int) -> dict:
    p, m = vc["patch_size"], vc["merge_kernel_size"][0]
    side = 512  # max patches per side, as published (the total budget max_patches binds first)
    return {
        # transformers' Kimi_K25ImageProcessor (torchvision backend) keys
        "image_processor_type": "Kimi_K25ImageProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,  # bicubic
        "size": {"max_height": side, "max_width": side},
        "max_patches": max_patches,
        "patch_size": p,
        "merge_size": m,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        # the published Kimi-K2.5 preprocessor_config.json block (same values)
        "media_proc_cfg": {
            "in_patch_limit": max_patches,
            "patch_size": p,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "merge_kernel_size": m,
            "fixed_output_tokens": None,
            "patch_limit_on_one_side": side,
            "in_patch_limit_each_frame": max_patches,
            "in_patch_limit_video": None,
            "sample_fps": 2.0,
            "max_num_frames_each_video": None,
            "temporal_merge_kernel_size": 4,
            "timestamp_mode": "hh:mm:ss.fff",
        },
    }


# --------------------------------------------------------------------------------------------
# published config -> transformers config
# --------------------------------------------------------------------------------------------

_VISION_RENAMES = {
    "vt_hidden_size": "hidden_size",
    "vt_num_hidden_layers": "num_hidden_layers",
    "vt_num_attention_heads": "num_attention_heads",
    "vt_intermediate_size": "intermediate_size",
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
}


def transformers_kimi_config_dict(published: dict) -> dict:
    """Translate a published Kimi-K2.5 config.json dict into one transformers 5.24 accepts."""
    if "media_placeholder_token_id" not in published and "vt_hidden_size" not in published.get("vision_config", {}):
        return copy.deepcopy(published)  # already transformers-style
    pv = published["vision_config"]
    vision = {new: pv[old] for old, new in _VISION_RENAMES.items() if old in pv}
    for key in ("patch_size", "merge_kernel_size", "hidden_act"):
        if key in pv:
            vision[key] = pv[key]
    vision["model_type"] = "kimi_k25_vision"
    text = copy.deepcopy(published["text_config"])
    text["model_type"] = "deepseek_v3"  # Kimi_K25Config does this too
    vocab = text["vocab_size"]
    out = {
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": vision,
        "projection_hidden_size": pv.get("mm_hidden_size", vision["hidden_size"]),
        "projection_layer_norm_eps": pv.get("projector_ln_eps", 1e-5),
        "image_token_id": published["media_placeholder_token_id"],
        "tie_word_embeddings": bool(published.get("tie_word_embeddings", False)),
        "bos_token_id": published.get("bos_token_id"),
        "eos_token_id": published.get("eos_token_id"),
        "pad_token_id": published.get("pad_token_id"),
        "dtype": published.get("torch_dtype", published.get("dtype", "bfloat16")),
    }
    if vocab < 163840:  # tiny vocab: no video token; park its id outside the vocabulary
        out["video_token_id"] = vocab + 1
    return out


def transformers_config_dict(config: dict) -> dict:
    """A config.json dict (either style, text-only or Kimi-K2.5) that transformers 5.24 loads
    correctly: Kimi-K2.5 published spellings translated, and a text-only ``model_type: kimi_k2``
    rewritten to ``deepseek_v3``.  (transformers keeps ``kimi_k2`` as the model type, finds no
    weight-conversion mapping for it, does not fuse the per-expert tensors and leaves
    ``mlp.experts.gate_up_proj``/``down_proj`` randomly initialised: missing + unexpected keys.)"""
    if config.get("model_type") == "kimi_k25":
        return transformers_kimi_config_dict(config)
    out = copy.deepcopy(config)
    if out.get("model_type") == "kimi_k2":
        out["model_type"] = "deepseek_v3"
    return out


def to_transformers_config_dir(src: PathLike, dst: PathLike) -> pathlib.Path:
    """Make ``dst`` a view of checkpoint ``src`` that transformers 5.24 loads: ``config.json``
    translated by ``transformers_config_dict``, every other file symlinked (the same safetensors)."""
    src, dst = pathlib.Path(src).resolve(), pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "config.json" or not f.is_file():
            continue
        link = dst / f.name
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(f)
    original = json.loads((src / "config.json").read_text())
    _write_json(dst / "config.json", transformers_config_dict(original))
    return dst


def _needs_view(config: dict) -> bool:
    return transformers_config_dict(config) != config


# --------------------------------------------------------------------------------------------
# reference models
# --------------------------------------------------------------------------------------------


def _load_reference(cls, path: PathLike, output_loading_info: bool):
    path = pathlib.Path(path)
    config = json.loads((path / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="eaglet_hf_view_") as d:
        src = to_transformers_config_dir(path, d) if _needs_view(config) else path
        res = cls.from_pretrained(str(src), dtype=torch.float32, output_loading_info=output_loading_info)
        model, info = res if output_loading_info else (res, None)
        # nothing may keep pointing into the temporary view
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()
    model.eval()
    return (model, info) if output_loading_info else model


def load_reference_deepseek_v3(path: PathLike, *, output_loading_info: bool = False):
    """``transformers.DeepseekV3ForCausalLM`` from the files written, float32, eval().
    A ``kimi_k2`` config goes through ``to_transformers_config_dir`` (see ``transformers_config_dict``).
    With ``output_loading_info=True`` returns ``(model, info)`` (missing/unexpected/mismatched keys)."""
    from transformers import DeepseekV3ForCausalLM

    return _load_reference(DeepseekV3ForCausalLM, path, output_loading_info)


def load_reference_kimi_k25(path: PathLike, *, output_loading_info: bool = False):
    """``transformers.Kimi_K25ForConditionalGeneration`` from the files written, float32, eval().
    A published-style config goes through ``to_transformers_config_dir``."""
    from transformers import Kimi_K25ForConditionalGeneration

    return _load_reference(Kimi_K25ForConditionalGeneration, path, output_loading_info)


# --------------------------------------------------------------------------------------------
# independent re-implementation of transformers' renames (to prove the mapping)
# --------------------------------------------------------------------------------------------


def vision_qkv_interleaved_to_rotate_half(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight [H*hd, in] or bias [H*hd]) from the published
    interleaved RoPE layout (pairs (0,1),(2,3),...) to transformers' rotate-half layout."""
    n = t.shape[0]
    half = n // num_heads // 2
    return t.reshape(num_heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def vision_qkv_rotate_half_to_interleaved(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    n = t.shape[0]
    half = n // num_heads // 2
    return t.reshape(num_heads, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


_EXPERT_RE = re.compile(r"^(?P<pre>.*mlp\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``...mlp.experts.E.{gate,up,down}_proj.weight`` -> transformers' fused
    ``...mlp.experts.gate_up_proj [E, 2I, D]`` (gate rows first) and ``...down_proj [E, D, I]``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for k, v in tensors.items():
        m = _EXPERT_RE.match(k)
        if m:
            experts.setdefault(m["pre"], {}).setdefault(m["w"], {})[int(m["e"])] = v
        else:
            out[k] = v
    for pre, parts in experts.items():
        n = len(parts["gate_proj"])
        out[pre + ".gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]], dim=0) for e in range(n)]
        )
        out[pre + ".down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``fuse_experts``."""
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len(".gate_up_proj")]
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.gate_proj.weight"] = v[e, :half]
                out[f"{pre}.{e}.up_proj.weight"] = v[e, half:]
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


_KIMI_VISION_RULES = [  # published suffix -> transformers suffix inside a block
    ("norm0.", "norm1."),
    ("norm1.", "norm2."),
    ("mlp.fc0.", "mlp.fc1."),
    ("mlp.fc1.", "mlp.fc2."),
    ("wo.", "attn.proj."),
]


def expected_transformers_state(
    published: dict[str, torch.Tensor], config: dict, *, kind: str | None = None
) -> dict[str, torch.Tensor]:
    """What transformers 5.24's state_dict() should hold after loading ``published`` tensors.

    ``config`` is the checkpoint's config.json dict (either style).  MTP layers (index >=
    num_hidden_layers) are dropped, as transformers does not model them.
    """
    kind = kind or config.get("model_type")
    if kind in ("deepseek_v3", "kimi_k2"):
        n = config["num_hidden_layers"]
        kept = {k: v for k, v in published.items() if not _is_mtp(k, n, "model.")}
        return fuse_experts(kept)
    if kind != "kimi_k25":
        raise ValueError(f"unknown model kind {kind!r}")
    vcfg = config["vision_config"]
    heads = vcfg.get("vt_num_attention_heads", vcfg.get("num_attention_heads"))
    n = config["text_config"]["num_hidden_layers"]
    out: dict[str, torch.Tensor] = {}
    text: dict[str, torch.Tensor] = {}
    for k, v in published.items():
        if k.startswith("language_model.model."):
            if not _is_mtp(k, n, "language_model.model."):
                text["model.language_model." + k[len("language_model.model."):]] = v
        elif k == "language_model.lm_head.weight":
            out["lm_head.weight"] = v
        elif k.startswith("vision_tower.encoder.blocks."):
            rest = k[len("vision_tower.encoder.blocks."):]
            idx, sub = rest.split(".", 1)
            base = f"model.vision_tower.layers.{idx}."
            if sub.startswith("wqkv."):
                leaf = sub[len("wqkv."):]
                q, kk, vv = v.chunk(3, dim=0)
                out[base + "attn.q_proj." + leaf] = vision_qkv_interleaved_to_rotate_half(q, heads)
                out[base + "attn.k_proj." + leaf] = vision_qkv_interleaved_to_rotate_half(kk, heads)
                out[base + "attn.v_proj." + leaf] = vv
                continue
            for src, dst in _KIMI_VISION_RULES:
                if sub.startswith(src):
                    out[base + dst + sub[len(src):]] = v
                    break
            else:
                raise KeyError(f"unmapped vision tensor {k}")
        elif k.startswith("vision_tower.encoder.final_layernorm."):
            out["model.vision_tower.final_layernorm." + k.rsplit(".", 1)[1]] = v
        elif k == "vision_tower.patch_embed.pos_emb.weight":
            out["model.vision_tower.patch_embed.pos_emb.position_embeddings"] = v
        elif k.startswith("vision_tower.patch_embed.proj."):
            out["model." + k] = v
        elif k.startswith("mm_projector.pre_norm."):
            out["model." + k] = v
        elif k.startswith("mm_projector.proj.0."):
            out["model.mm_projector.in_proj." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("mm_projector.proj.2."):
            out["model.mm_projector.out_proj." + k.rsplit(".", 1)[1]] = v
        else:
            raise KeyError(f"unmapped tensor {k}")
    out.update(fuse_experts(text))
    return out


def transformers_state_to_published(state: dict[str, torch.Tensor], config: dict,
                                    *, kind: str | None = None) -> dict[str, torch.Tensor]:
    """Inverse of ``expected_transformers_state`` (MTP layers are not recoverable)."""
    kind = kind or config.get("model_type")
    if kind in ("deepseek_v3", "kimi_k2"):
        return split_experts(dict(state))
    vcfg = config["vision_config"]
    heads = vcfg.get("vt_num_attention_heads", vcfg.get("num_attention_heads"))
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    inverse_rules = [(dst, src) for src, dst in _KIMI_VISION_RULES]
    for k, v in split_experts(dict(state)).items():
        if k.startswith("model.language_model."):
            out["language_model.model." + k[len("model.language_model."):]] = v
        elif k == "lm_head.weight":
            out["language_model.lm_head.weight"] = v
        elif k.startswith("model.vision_tower.layers."):
            idx, sub = k[len("model.vision_tower.layers."):].split(".", 1)
            base = f"vision_tower.encoder.blocks.{idx}."
            m = re.match(r"attn\.(q|k|v)_proj\.(weight|bias)$", sub)
            if m:
                qkv.setdefault(base + "wqkv." + m[2], {})[m[1]] = v
                continue
            for src, dst in inverse_rules:
                if sub.startswith(src):
                    out[base + dst + sub[len(src):]] = v
                    break
            else:
                raise KeyError(f"unmapped transformers tensor {k}")
        elif k.startswith("model.vision_tower.final_layernorm."):
            out["vision_tower.encoder.final_layernorm." + k.rsplit(".", 1)[1]] = v
        elif k == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
            out["vision_tower.patch_embed.pos_emb.weight"] = v
        elif k.startswith("model.vision_tower.patch_embed.proj.") or k.startswith("model.mm_projector.pre_norm."):
            out[k[len("model."):]] = v
        elif k.startswith("model.mm_projector.in_proj."):
            out["mm_projector.proj.0." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("model.mm_projector.out_proj."):
            out["mm_projector.proj.2." + k.rsplit(".", 1)[1]] = v
        else:
            raise KeyError(f"unmapped transformers tensor {k}")
    for name, parts in qkv.items():
        out[name] = torch.cat([
            vision_qkv_rotate_half_to_interleaved(parts["q"], heads),
            vision_qkv_rotate_half_to_interleaved(parts["k"], heads),
            parts["v"],
        ])
    return out


def _is_mtp(name: str, num_layers: int, prefix: str) -> bool:
    if not name.startswith(prefix + "layers."):
        return False
    return int(name[len(prefix + "layers."):].split(".", 1)[0]) >= num_layers


# --------------------------------------------------------------------------------------------
# image inputs (no torchvision: build what the transformers processor would output)
# --------------------------------------------------------------------------------------------


def random_image_inputs(grid_hw: Iterable[tuple[int, int]], patch_size: int, *, seed: int = 0):
    """``(pixel_values, image_grid_thw)`` for images of ``grid_hw`` patches, in the layout
    transformers' Kimi_K25ImageProcessor returns: pixel_values [sum(h*w), 3, p, p] float32 in
    [-1, 1] (patches of each image in raster order over (h, w), images concatenated) and
    image_grid_thw LongTensor [num_images, 3] of (1, h, w).  Each image contributes
    h*w/(kh*kw) placeholder tokens."""
    g = torch.Generator().manual_seed(seed)
    grids = [(1, int(h), int(w)) for h, w in grid_hw]
    n = sum(h * w for _, h, w in grids)
    pixel_values = torch.rand(n, 3, patch_size, patch_size, generator=g) * 2 - 1
    return pixel_values, torch.tensor(grids, dtype=torch.long)


def patchify_image(pixels: torch.Tensor, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[3, H, W] (already resized/padded/normalised) -> (pixel_values [h*w, 3, p, p], grid [[1, h, w]]),
    the same reshape as Kimi_K25ImageProcessor.patchify."""
    c, H, W = pixels.shape
    h, w = H // patch_size, W // patch_size
    patches = pixels.reshape(c, h, patch_size, w, patch_size).permute(1, 3, 0, 2, 4)
    return patches.reshape(h * w, c, patch_size, patch_size).contiguous(), torch.tensor([[1, h, w]])


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

# name -> token string; ids are assigned by special_tokens_for
DEEPSEEK_SPECIAL_TOKENS = {
    "bos": "<｜begin▁of▁sentence｜>",
    "eos": "<｜end▁of▁sentence｜>",
    "user": "<｜User｜>",
    "assistant": "<｜Assistant｜>",
}
KIMI_SPECIAL_TOKENS = {
    "bos": "[BOS]",
    "eos": "[EOS]",
    "im_end": "<|im_end|>",
    "im_user": "<|im_user|>",
    "im_assistant": "<|im_assistant|>",
    "im_system": "<|im_system|>",
    "im_middle": "<|im_middle|>",
    "media_begin": "<|media_begin|>",
    "media_content": "<|media_content|>",
    "media_end": "<|media_end|>",
    "media_pad": "<|media_pad|>",
    "pad": "[PAD]",
}


def special_tokens_for(model_type: str, vocab_size: int, *, image_token_id: int | None = None
                        ) -> dict[str, tuple[str, int]]:
    """Special tokens and their ids for the tiny vocabularies: bos 0, eos 1, the rest from 2
    upward; for Kimi-K2.5 ``<|media_pad|>`` sits at ``image_token_id`` and ``[PAD]`` at the top."""
    if model_type == "deepseek_v3":
        names = DEEPSEEK_SPECIAL_TOKENS
    else:
        names = KIMI_SPECIAL_TOKENS
    out: dict[str, tuple[str, int]] = {}
    fixed: dict[str, int] = {"bos": 0, "eos": 1}
    if "pad" in names:
        fixed["pad"] = vocab_size - 1
    if "media_pad" in names:
        fixed["media_pad"] = image_token_id if image_token_id is not None else vocab_size - 6
    used = set(fixed.values())
    if len(used) != len(fixed):
        raise ValueError(f"special token ids collide: {fixed}")
    nxt = 2
    for name, tok in names.items():
        if name in fixed:
            out[name] = (tok, fixed[name])
            continue
        while nxt in used:
            nxt += 1
        out[name] = (tok, nxt)
        used.add(nxt)
    for _, tid in out.values():
        if not 0 <= tid < vocab_size:
            raise ValueError(f"special token id {tid} outside vocab_size {vocab_size}")
    return out


_DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<｜User｜>{{ message['content'] }}"
    "{%- else -%}<｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"
)


def _training_text() -> list[str]:
    """Python stdlib docstrings: deterministic for a given Python, no network."""
    import collections
    import functools
    import itertools
    import json as _json
    import pathlib as _pathlib
    import re as _re
    import string
    import textwrap

    texts: list[str] = []
    for mod in (collections, functools, itertools, _json, _pathlib, _re, string, textwrap, os):
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name, None), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
        if mod.__doc__:
            texts.append(mod.__doc__)
    texts.append("The quick brown fox jumps over the lazy dog. 0123456789 " * 4)
    return texts


_TOKENIZER_CACHE: dict[tuple, str] = {}


def _build_tokenizer_json(vocab_size: int, specials: dict[str, int]) -> str:
    """tokenizer.json text: byte-level BPE whose ids fill [0, vocab_size) exactly, with the
    special tokens at the requested ids."""
    key = (vocab_size, tuple(sorted(specials.items())))
    if key in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[key]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    n_bpe = vocab_size - len(specials)
    if n_bpe < 64:
        raise ValueError(f"vocab_size {vocab_size} too small for {len(specials)} special tokens")
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    text = _training_text()
    if n_bpe >= len(byte_alphabet) + 64:
        alphabet = byte_alphabet  # every byte encodable
    else:
        # tiny vocab: printable ASCII + whitespace only (other bytes are dropped when encoding)
        alphabet = _bytes_to_unicode_chars(bytes(range(32, 127)) + b"\n\t")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
        show_progress=False, special_tokens=[],
    )
    tok.train_from_iterator(text, trainer=trainer)
    data = json.loads(tok.to_str())
    bpe_vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    free_ids = [i for i in range(vocab_size) if i not in set(specials.values())]
    new_vocab = {}
    for (tok_str, _), new_id in zip(bpe_vocab, free_ids):
        new_vocab[tok_str] = new_id
    added = [(tid, s) for s, tid in specials.items()]
    for j, new_id in enumerate(free_ids[len(bpe_vocab):]):  # training came up short: pad
        added.append((new_id, f"<|reserved_token_{j}|>"))
    # Special tokens also go into the model vocab at their ids: `tokenizers` only honours an
    # added token's id when the model vocab already maps the string to it (otherwise it
    # renumbers the added token past the end of the model vocab).
    for tid, s in added:
        new_vocab[s] = tid
    if sorted(new_vocab.values()) != list(range(vocab_size)):
        raise AssertionError("tokenizer ids do not fill [0, vocab_size)")
    data["model"]["vocab"] = dict(sorted(new_vocab.items(), key=lambda kv: kv[1]))
    data["added_tokens"] = [
        {"id": tid, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for tid, s in sorted(added)
    ]
    out = json.dumps(data, ensure_ascii=False)
    _TOKENIZER_CACHE[key] = out
    return out


def _bytes_to_unicode_chars(bs: bytes) -> list[str]:
    # GPT-2 byte->unicode map, as used by ByteLevel
    base = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = base[:]
    n = 0
    for b in range(256):
        if b not in base:
            base.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(base, (chr(c) for c in cs)))
    return [table[b] for b in bs]


def write_tiny_tokenizer(
    path: PathLike,
    vocab_size: int,
    *,
    extra_special_tokens: dict | None = None,
    chat_style: str = "kimi",
    special_tokens: dict[str, tuple[str, int]] | None = None,
) -> None:
    """Write tokenizer.json + tokenizer_config.json + generation_config.json.

    Byte-level BPE trained on stdlib docstrings; ids fill [0, vocab_size) exactly (short training
    is padded with ``<|reserved_token_j|>`` added tokens).  Special tokens: ``special_tokens``
    (name -> (string, id)), by default the Kimi set (``chat_style="kimi"``) or the DeepSeek set
    (``chat_style="deepseek"``); ``extra_special_tokens`` maps more token strings to ids.
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if special_tokens is None:
        special_tokens = special_tokens_for("kimi_k25" if chat_style == "kimi" else "deepseek_v3", vocab_size)
    write_tokenizer_files(path, vocab_size, special_tokens, chat_style=chat_style,
                           extra=extra_special_tokens)


def write_tokenizer_files(path: pathlib.Path, vocab_size: int, special: dict[str, tuple[str, int]],
                           *, chat_style: str, extra: dict | None = None) -> None:
    by_string = {s: tid for s, tid in special.values()}
    for s, tid in (extra or {}).items():
        by_string[s] = int(tid)
    if len(set(by_string.values())) != len(by_string):
        raise ValueError(f"special token ids collide: {sorted(by_string.items(), key=lambda kv: kv[1])}")
    (path / "tokenizer.json").write_text(_build_tokenizer_json(vocab_size, by_string), encoding="utf-8")
    bos, eos = special["bos"], special["eos"]
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos[0],
        "eos_token": eos[0],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": KIMI_CHAT_TEMPLATE if chat_style == "kimi" else _DEEPSEEK_TEMPLATE,
    }
    if "pad" in special:
        cfg["pad_token"] = special["pad"][0]
    _write_json(path / "tokenizer_config.json", cfg)
    gen_eos = special["im_end"][1] if chat_style == "kimi" and "im_end" in special else eos[1]
    gen = {"bos_token_id": bos[1], "eos_token_id": gen_eos, "do_sample": False}
    if "pad" in special:
        gen["pad_token_id"] = special["pad"][1]
    _write_json(path / "generation_config.json", gen)
