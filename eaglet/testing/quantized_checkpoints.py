"""Tiny quantized checkpoints in the published layouts, made from the plain ones of ``checkpoints``.

- ``write_int4_checkpoint``: Kimi-K2.5's int4 routed experts (or every linear layer of the language
  model), compressed by the compressed-tensors package's own pack-quantized compressor (scales from
  its ``calculate_qparams``), with the ``quantization_config`` Kimi-K2.5 publishes (top level and
  ``text_config``).
- ``write_decompressed_checkpoint``: the same model with every int4 weight decompressed by
  compressed-tensors in float32, as a plain checkpoint: what transformers runs as the reference.
- ``write_fp8_checkpoint``: DeepSeek-V3's FP8: every decoder-layer linear weight in float8_e4m3fn
  with a float32 ``weight_scale_inv`` per 128 x 128 block (edges padded), scale = block amax / 448.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil

import torch

from eaglet.testing.checkpoints import INDEX_NAME, PathLike, _write_shards, read_checkpoint_tensors

KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
ROUTED_EXPERT_WEIGHT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
DECODER_LINEAR_WEIGHT = re.compile(
    r".*model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$"
)
LANGUAGE_MODEL_LINEAR_WEIGHT = re.compile(DECODER_LINEAR_WEIGHT.pattern + r"|.*lm_head\.weight$")
ALL_LINEAR_IGNORE = ["re:.*vision_tower.*", "re:.*mm_projector.*", r"re:.*mlp\.gate$"]
FP8_BLOCK = 128
FP8_MAX = 448.0
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}


def int4_scheme(group_size: int = 32):
    """compressed-tensors' W4A16 scheme with ``group_size`` (Kimi-K2.5: 32)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size, dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=args, input_activations=None)


def int4_quantization_config(group_size: int = 32, ignore: list[str] = KIMI_IGNORE) -> dict:
    """The ``quantization_config`` compressed-tensors writes for Kimi-K2.5's scheme."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={"group_0": int4_scheme(group_size)}, format="pack-quantized",
        quantization_status="compressed", ignore=ignore,
    )
    return json.loads(json.dumps(config.model_dump(), default=str))


def write_int4_checkpoint(
    src: PathLike, dst: PathLike, *, group_size: int = 32, num_shards: int = 3, layers: str = "experts"
) -> pathlib.Path:
    """The routed experts (``layers="all"``: every linear layer of the language model, lm_head
    included) of the plain checkpoint ``src`` compressed to int4 by compressed-tensors."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = int4_scheme(group_size)
    tensors: dict[str, torch.Tensor] = {}
    quantized = ROUTED_EXPERT_WEIGHT if layers == "experts" else LANGUAGE_MODEL_LINEAR_WEIGHT
    for name, weight in read_checkpoint_tensors(src).items():
        if not quantized.match(name):
            tensors[name] = weight
            continue
        groups = weight.float().reshape(weight.shape[0], -1, group_size)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        compressed = PackedQuantizationCompressor.compress(
            {"weight": weight.bfloat16(), "weight_scale": scale.bfloat16()}, scheme
        )
        base = name.removesuffix("weight")
        tensors[base + "weight_packed"] = compressed["weight_packed"]
        tensors[base + "weight_scale"] = compressed["weight_scale"]
        tensors[base + "weight_shape"] = compressed["weight_shape"].to(torch.int32)  # as published
    quantization = int4_quantization_config(group_size, KIMI_IGNORE if layers == "experts" else ALL_LINEAR_IGNORE)

    def add_config(config: dict) -> None:
        config["quantization_config"] = quantization
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["quantization_config"] = quantization

    return _write(src, dst, tensors, num_shards, add_config)


def write_decompressed_checkpoint(src: PathLike, dst: PathLike) -> pathlib.Path:
    """Every int4 weight of ``src`` decompressed by compressed-tensors in float32, the rest in float32:
    a plain checkpoint of the model the int4 one stands for."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    config = json.loads((pathlib.Path(src) / "config.json").read_text())
    group_size = config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    scheme = int4_scheme(group_size)
    stored = read_checkpoint_tensors(src)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith(".weight_packed"):
            base = name.removesuffix("weight_packed")
            parts = {
                "weight_packed": tensor, "weight_scale": stored[base + "weight_scale"].float(),
                "weight_shape": stored[base + "weight_shape"],
            }
            tensors[base + "weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
        elif not name.endswith((".weight_scale", ".weight_shape")):
            tensors[name] = tensor.float() if tensor.is_floating_point() else tensor
    return _write(src, dst, tensors, 1, _drop_quantization)


def write_fp8_checkpoint(src: PathLike, dst: PathLike, *, num_shards: int = 3) -> pathlib.Path:
    """The decoder layers' linear weights of ``src`` in DeepSeek-V3's FP8 block format."""
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in read_checkpoint_tensors(src).items():
        if DECODER_LINEAR_WEIGHT.match(name):
            tensors[name], tensors[name + "_scale_inv"] = fp8_block_quantize(weight)
        else:
            tensors[name] = weight

    def add_config(config: dict) -> None:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)

    return _write(src, dst, tensors, num_shards, add_config)


def fp8_block_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [out, in], float32 scale_inv [ceil(out / 128), ceil(in / 128)]), scale = amax / 448."""
    rows, cols = weight.shape
    block_rows, block_cols = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = torch.zeros(block_rows * FP8_BLOCK, block_cols * FP8_BLOCK)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(block_rows, FP8_BLOCK, block_cols, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(padded.shape)[:rows, :cols].contiguous(), scale


def _drop_quantization(config: dict) -> None:
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    config["torch_dtype"] = "float32"


def _write(src: PathLike, dst: PathLike, tensors: dict[str, torch.Tensor], num_shards: int, edit_config) -> pathlib.Path:
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_NAME):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    edit_config(config)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_shards(dst, tensors, num_shards)
    return dst
