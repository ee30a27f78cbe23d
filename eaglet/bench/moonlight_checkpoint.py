"""Moonlight-16B-A3B at its published shapes with random weights, its routed experts int4 in
Kimi-K2.5's compressed-tensors layout, made an echo acceptance dial with an MLA EAGLE-3 draft.

The bench's other checkpoints are small enough that per-call costs hide what a decode step of a
real MoE reads; this one reads what Moonshot's ~3B-active DeepSeek-V3-architecture model reads
(int4 routed experts, bfloat16 elsewhere, as Kimi-K2.5 ships), without downloading it, so eaglet
and its peers (llama.cpp converts it) are timed on a real-size model whose speculative acceptance
is still set by ``alpha`` (eaglet.testing.echo_checkpoints). The full size holds 11,227,664,896
bytes of tensors (about 11.2 GB: embed_tokens and lm_head 0.67 GB each, 373.8 MB per MoE layer),
so it is generated shard by shard straight to a cache directory, once per (alpha, seed, shapes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglet.testing.checkpoints import (
    SHARD_NAME,
    INDEX_NAME,
    published_text_config,
    special_tokens_for,
    write_tokenizer_files,
    tiny_text_config,
)
from eaglet.testing.echo_checkpoints import echo_draft
from eaglet.testing.quantized_checkpoints import KIMI_IGNORE

# Moonlight-16B-A3B's config.json (model_type deepseek_v3, DeepseekV3ForCausalLM, bfloat16).
MOONLIGHT_16B_A3B = dict(
    vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=1,
    topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.446, norm_topk_prob=True, rope_theta=50000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5,
)
# What `small` may override: shapes and norms, not the architecture (a plain q_proj, as Moonlight).
SMALL_KEYS = frozenset(MOONLIGHT_16B_A3B) - {"q_lora_rank"}
GROUP_SIZE = 32
# Written literally rather than by compressed-tensors (a test-only dependency): the bench must not
# need it. tests/test_moonlight_checkpoint.py checks it equals what compressed-tensors writes.
QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": GROUP_SIZE,
                        "strategy": "group", "dynamic": False},
            "input_activations": None, "output_activations": None, "format": None,
        }
    },
    "quant_method": "compressed-tensors", "kv_cache_scheme": None, "format": "pack-quantized",
    "quantization_status": "compressed", "global_compression_ratio": None,
    "ignore": KIMI_IGNORE,
    "moe_sparsity_config": None,
}
# Mean square of a stored int4 value: codes uniform over [-8, 7] (every nibble of a random word).
INT4_MEAN_SQUARE = sum(q * q for q in range(-8, 8)) / 16
# Group scales are jittered uniformly in [0.5, 1.5) (mean square 13/12) so that a converter that
# misplaces a group's scale changes the model's output instead of hiding behind equal scales.
SCALE_JITTER_MEAN_SQUARE = 13 / 12
# A shard holds whole layers, at most two and about 1 GB: one shard and its serialised copy are
# all the generator holds in memory.
LAYERS_PER_SHARD = 2
SHARD_BYTES = 1_250_000_000
MARKER = "eaglet-moonlight.json"
# Part of the generation key: bump it when the tensors written for a key change.
GENERATOR_VERSION = 1
DRAFT_SEED = 4


@dataclass(frozen=True)
class _Spec:
    """A tensor to write: its name, shape and dtype known before ``make`` draws it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[torch.Generator], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Unit:
    """Tensors drawn from one generator seeded by ``seed``: the embedding, a layer, or the head.
    A unit per layer keeps each layer's weights the same whatever the number of layers."""

    label: str
    seed: int
    specs: list[_Spec]
    is_layer: bool

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def _normal(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0,
            dtype: torch.dtype = torch.bfloat16) -> _Spec:
    def make(g: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=g).mul_(std).add_(mean).to(dtype)

    return _Spec(name, shape, dtype, make)


def _linear(name: str, out_f: int, in_f: int, gain: float = 1.0) -> _Spec:
    # std gain / sqrt(fan_in), as eaglet.testing.checkpoints draws its linears
    return _normal(name, (out_f, in_f), gain / math.sqrt(in_f))


def _norm(name: str, n: int) -> _Spec:
    return _normal(name, (n,), 0.1, mean=1.0)


def _int4_linear(base: str, out_f: int, in_f: int, gain: float = 1.0) -> list[_Spec]:
    """compressed-tensors pack-quantized: ``weight_packed`` int32 [out, in/8] (8 codes a word, value
    + 8, least significant nibble first along the input), ``weight_scale`` bfloat16 [out, in/32],
    ``weight_shape`` int32 [2]; random words give uniform codes directly, and the scales give the
    dequantized weight the root mean square of ``_linear``'s."""
    words, groups = (out_f, in_f // 8), (out_f, in_f // GROUP_SIZE)
    scale = gain / math.sqrt(in_f * INT4_MEAN_SQUARE * SCALE_JITTER_MEAN_SQUARE)

    def packed(g: torch.Generator) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, words, dtype=torch.int32, generator=g)

    def scales(g: torch.Generator) -> torch.Tensor:
        return torch.rand(groups, generator=g).add_(0.5).mul_(scale).bfloat16()

    def shape(g: torch.Generator) -> torch.Tensor:
        return torch.tensor([out_f, in_f], dtype=torch.int32)

    return [
        _Spec(base + "weight_packed", words, torch.int32, packed),
        _Spec(base + "weight_scale", groups, torch.bfloat16, scales),
        _Spec(base + "weight_shape", (2,), torch.int32, shape),
    ]


def _layer_specs(c: dict, i: int, alpha: float) -> list[_Spec]:
    """Layer ``i`` in the published names (eaglet.testing.checkpoints._text_layer_tensors' order),
    every residual branch's last projection scaled by ``alpha`` (the echo dial)."""
    D, H, L = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    P, R, V = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    p = f"model.layers.{i}."
    specs = [
        _norm(p + "input_layernorm.weight", D),
        _linear(p + "self_attn.q_proj.weight", H * (P + R), D),
        _linear(p + "self_attn.kv_a_proj_with_mqa.weight", L + R, D),
        _norm(p + "self_attn.kv_a_layernorm.weight", L),
        _linear(p + "self_attn.kv_b_proj.weight", H * (P + V), L),
        _linear(p + "self_attn.o_proj.weight", D, H * V, gain=alpha),
        _norm(p + "post_attention_layernorm.weight", D),
    ]
    if i < c["first_k_dense_replace"]:
        inter = c["intermediate_size"]
        return specs + [
            _linear(p + "mlp.gate_proj.weight", inter, D),
            _linear(p + "mlp.up_proj.weight", inter, D),
            _linear(p + "mlp.down_proj.weight", D, inter, gain=alpha),
        ]
    E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    specs += [
        _linear(p + "mlp.gate.weight", E, D, gain=2.0),
        # float32 in the real bfloat16 checkpoints
        _normal(p + "mlp.gate.e_score_correction_bias", (E,), 0.1, dtype=torch.float32),
    ]
    for e in range(E):
        x = f"{p}mlp.experts.{e}."
        specs += _int4_linear(x + "gate_proj.", inter, D)
        specs += _int4_linear(x + "up_proj.", inter, D)
        specs += _int4_linear(x + "down_proj.", D, inter, gain=alpha)
    shared = inter * c["n_shared_experts"]
    return specs + [
        _linear(p + "mlp.shared_experts.gate_proj.weight", shared, D),
        _linear(p + "mlp.shared_experts.up_proj.weight", shared, D),
        _linear(p + "mlp.shared_experts.down_proj.weight", D, shared, gain=alpha),
    ]


def _units(config: dict, alpha: float, seed: int) -> list[_Unit]:
    D, vocab, N = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    embed_seed = seed * 10_000
    embed = _normal("model.embed_tokens.weight", (vocab, D), 1.0)
    # The echo dial's lm_head = embed_tokens: drawn again from the embedding's own generator, so the
    # 0.67 GB embedding is not held from the first shard to the last.
    head = _Spec("lm_head.weight", embed.shape, embed.dtype,
                 lambda g: embed.make(torch.Generator().manual_seed(embed_seed)))
    units = [_Unit("embed_tokens", embed_seed, [embed], is_layer=False)]
    units += [_Unit(f"layer {i}", embed_seed + 1 + i, _layer_specs(config, i, alpha), is_layer=True) for i in range(N)]
    units.append(_Unit("lm_head", embed_seed + 1 + N, [_norm("model.norm.weight", D), head], is_layer=False))
    return units


def _shards(units: list[_Unit]) -> list[list[_Unit]]:
    """Consecutive units, a new shard when the next unit would pass LAYERS_PER_SHARD or SHARD_BYTES."""
    shards: list[list[_Unit]] = [[]]
    for unit in units:
        current = shards[-1]
        layers = sum(u.is_layer for u in current) + unit.is_layer
        if current and (layers > LAYERS_PER_SHARD or sum(u.nbytes for u in current) + unit.nbytes > SHARD_BYTES):
            shards.append([])
        shards[-1].append(unit)
    return shards


def moonlight_config(num_hidden_layers: int | None = None, small: dict | None = None) -> dict:
    """The target's config.json: Moonlight-16B-A3B's, ``small`` values and ``num_hidden_layers``
    (when given) replacing the published ones, with Kimi-K2.5's int4 ``quantization_config``."""
    overrides = dict(small or {})
    unknown = set(overrides) - SMALL_KEYS
    if unknown:
        raise ValueError(f"small may override {sorted(SMALL_KEYS)}, not {sorted(unknown)}")
    if num_hidden_layers is not None:
        overrides["num_hidden_layers"] = num_hidden_layers
    text = tiny_text_config(**{**MOONLIGHT_16B_A3B, **overrides})
    for key in ("hidden_size", "moe_intermediate_size"):  # the routed experts' input widths
        if text[key] % GROUP_SIZE:
            raise ValueError(f"{key}={text[key]} is not a multiple of the int4 group size {GROUP_SIZE}")
    specials = _special_tokens(text["vocab_size"])
    text["bos_token_id"], text["eos_token_id"] = specials["bos"][1], specials["eos"][1]
    config = published_text_config(text, model_type="deepseek_v3", dtype=torch.bfloat16, mtp_layers=0)
    config["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
    return config


def _special_tokens(vocab_size: int) -> dict[str, tuple[str, int]]:
    # Moonlight ships Kimi's tokenizer ([BOS], [EOS], <|im_*|>), not DeepSeek's special tokens.
    return special_tokens_for("kimi_k2", vocab_size)


def expected_tensor_bytes(config: dict) -> int:
    """Bytes of tensor data the target's shards hold for ``config`` (the index's ``total_size``),
    computed without drawing anything; the safetensors headers, config and tokenizer files add
    about 0.3% at the full size (tokenizer.json is ~30 MB)."""
    return sum(unit.nbytes for unit in _units(config, alpha=1.0, seed=0))


def _write_target(path: Path, config: dict, alpha: float, seed: int) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards = _shards(_units(config, alpha, seed))
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        start = time.perf_counter()
        name = SHARD_NAME.format(i=k, n=len(shards))
        tensors = {}
        for unit in shard:
            g = torch.Generator().manual_seed(unit.seed)
            for spec in unit.specs:
                tensors[spec.name] = spec.make(g)
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        nbytes = sum(unit.nbytes for unit in shard)
        weight_map.update(dict.fromkeys(tensors, name))
        total += nbytes
        del tensors
        print(f"  {name}: {', '.join(u.label for u in shard)} ({nbytes / 1e9:.2f} GB) "
              f"in {time.perf_counter() - start:.1f} s", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    write_tokenizer_files(path, config["vocab_size"], _special_tokens(config["vocab_size"]), chat_style="kimi")


def _draft_sizing(config: dict) -> dict:
    """The target config the draft is sized from: an MLA EAGLE-3 draft's first attention reads the
    2H input through q_a_proj, so it needs the q_lora_rank Moonlight does not have; 3H/4 is 1536 at
    the full size, DeepSeek-V3's and Kimi-K2's (which their MLA drafts carry)."""
    return {**config, "q_lora_rank": config["hidden_size"] * 3 // 4}


def _directory_name(layers: int, alpha: float, seed: int, small: dict | None) -> str:
    name = f"moonlight-16b-a3b-int4-{layers}L-alpha{alpha}-seed{seed}"
    if small:
        name += "-small-" + hashlib.sha1(json.dumps(small, sort_keys=True).encode()).hexdigest()[:10]
    return name


def _files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def moonlight_int4_checkpoint(root: Path | None = None, alpha: float = 0.05, *, num_hidden_layers: int | None = None,
                              small: dict | None = None, seed: int = 1234) -> dict:
    """The checkpoint under ``root`` (default ``$EAGLET_BENCH_CACHE`` or ``~/.cache/eaglet/bench-checkpoints``),
    written unless a marker holding this generation key is already there: {"target", "draft",
    "dtype", "images", "echo", "file_bytes"} as ``bench_checkpoints.build_checkpoint`` returns, with
    ``file_bytes`` the size of the target's files. A directory without a matching marker (e.g. from
    a killed run) is removed and written again."""
    if root is None:
        root = Path(os.environ.get("EAGLET_BENCH_CACHE", Path.home() / ".cache" / "eaglet" / "bench-checkpoints"))
    config = moonlight_config(num_hidden_layers, small)
    out = Path(root) / _directory_name(config["num_hidden_layers"], alpha, seed, small)
    target, draft, marker = out / "target", out / "draft", out / MARKER
    key = json.dumps({"generator": GENERATOR_VERSION, "alpha": alpha, "seed": seed, "draft_seed": DRAFT_SEED,
                      "config": config}, sort_keys=True, indent=1)
    if not (marker.is_file() and marker.read_text() == key):
        if out.exists():
            shutil.rmtree(out)
        start = time.perf_counter()
        print(f"writing {out} ({expected_tensor_bytes(config) / 1e9:.2f} GB of tensors)", flush=True)
        _write_target(target, config, alpha, seed)
        # Sized from a config dict (echo_draft passes it to write_eagle3_draft, which takes one), the
        # draft never reads the target's weights; its lm_head is the target's.
        echo_draft(_draft_sizing(config), draft, kind="mla", seed=DRAFT_SEED, model_type="kimi_k2",
                   dtype=torch.bfloat16)
        marker.write_text(key)  # last: its presence means every file above is complete
        print(f"wrote {out} in {time.perf_counter() - start:.1f} s", flush=True)
    return {"target": target, "draft": draft, "dtype": "bfloat16", "images": False, "echo": True,
            "file_bytes": _files_bytes(target)}
