"""A checkpoint's ``quantization_config``: the two published forms eaglet runs, every other setting
refused with a message naming it.

- compressed-tensors ``pack-quantized`` W4A16 (Kimi-K2.5): int4 weights, symmetric, one scale per
  group of 32 (also 64 or 128) input columns, no activation quantization.
- ``fp8`` (DeepSeek-V3, Kimi-K2): e4m3 weights with a float32 ``weight_scale_inv`` per 128 x 128
  block, activations dynamic (eaglet multiplies them unquantized).

Which tensors are quantized is read from the checkpoint itself (``quantized_checkpoint``), not
from the config's target and ignore lists: Kimi-K2.5 stores its vision tower in bfloat16 although
its ignore list does not name it.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.errors import ConfigError

INT4_GROUP_SIZES = (32, 64, 128)
FP8_BLOCK = [128, 128]


@dataclass(frozen=True)
class QuantScheme:
    format: str  # "int4" or "fp8" (eaglet.backends.quantized_matrix.FORMATS)
    group_size: int  # input columns per scale (fp8: the block's columns)
    block_rows: int = 1  # output rows per scale in the file (fp8: the block's rows)


def parse_quantization(raw: dict, where: str = "config") -> QuantScheme | None:
    """The scheme of a config.json's ``quantization_config`` (None when it has none)."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    where = f"{where}: quantization_config"
    if not isinstance(quant, dict):
        raise ConfigError(f"{where} must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    if method == "fp8":
        return _fp8(quant, where)
    raise ConfigError(
        f"{where}.quant_method={method!r} is not supported; eaglet runs 'compressed-tensors' "
        "(pack-quantized int4 W4A16) and 'fp8' (e4m3, 128x128 blocks)"
    )


def _compressed_tensors(quant: dict, where: str) -> QuantScheme:
    fmt = quant.get("format")
    if fmt != "pack-quantized":
        raise ConfigError(
            f"{where}.format={fmt!r} is not supported; eaglet runs compressed-tensors 'pack-quantized' (int4 W4A16)"
        )
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(f"{where}.quantization_status={status!r}: eaglet reads 'compressed' checkpoints only")
    for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if quant.get(key):
            raise ConfigError(f"{where}.{key} is set ({quant[key]!r}); eaglet runs weight-only int4 without it")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        count = len(groups) if isinstance(groups, dict) else groups
        raise ConfigError(f"{where}.config_groups: eaglet runs exactly one quantization group, got {count!r}")
    (name, group), = groups.items()
    where = f"{where}.config_groups.{name}"
    if not isinstance(group, dict):
        raise ConfigError(f"{where} must be an object")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ConfigError(
                f"{where}.{key} is set ({group[key]!r}); eaglet runs weight-only quantization (W4A16), "
                "activations unquantized"
            )
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ConfigError(f"{where}.weights must be an object, got {weights!r}")
    where = f"{where}.weights"
    checks = [
        ("type", "int", "integer weights (a float type is e.g. FP4/NVFP4/MXFP4)"),
        ("num_bits", 4, "4-bit weights"),
        ("symmetric", True, "symmetric int4 (an asymmetric scheme needs zero points)"),
        ("strategy", "group", "one scale per group of input columns ('group' strategy)"),
        ("dynamic", False, "static weight scales"),
    ]
    for key, expected, meaning in checks:
        value = weights.get(key, expected if key == "dynamic" else None)
        if value != expected:
            raise ConfigError(f"{where}.{key}={value!r} is not supported; eaglet runs {meaning}: {key}={expected!r}")
    actorder = weights.get("actorder")
    if actorder not in (None, False):
        raise ConfigError(
            f"{where}.actorder={actorder!r} is not supported: GPTQ activation ordering (g_idx) permutes the "
            "groups; eaglet runs groups in column order"
        )
    group_size = weights.get("group_size")
    if group_size not in INT4_GROUP_SIZES:
        raise ConfigError(
            f"{where}.group_size={group_size!r} is not supported; eaglet runs int4 groups of "
            f"{', '.join(map(str, INT4_GROUP_SIZES))} columns"
        )
    return QuantScheme("int4", group_size)


def _fp8(quant: dict, where: str) -> QuantScheme:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}.fmt={fmt!r} is not supported; eaglet runs fp8 'e4m3'")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"{where}.activation_scheme={scheme!r} is not supported; eaglet runs 'dynamic' (activations unquantized)"
        )
    block = quant.get("weight_block_size")
    if block != FP8_BLOCK:
        raise ConfigError(
            f"{where}.weight_block_size={block!r} is not supported; eaglet runs fp8 in {FP8_BLOCK} blocks"
        )
    return QuantScheme("fp8", group_size=block[1], block_rows=block[0])


def parse_text_and_top_quantization(raw: dict, text_raw: dict) -> QuantScheme | None:
    """Kimi-K2.5 states its quantization at the top level and again in ``text_config``: they must agree."""
    top, text = parse_quantization(raw, "config"), parse_quantization(text_raw, "text_config")
    if top is not None and text is not None and top != text:
        raise ConfigError(f"quantization_config differs between the top level ({top}) and text_config ({text})")
    return top or text
