"""Quantized tensors of a checkpoint, found by what the files hold, and read into ``QuantizedMatrix``.

A weight ``X.weight`` is stored as
- int4 (compressed-tensors pack-quantized): ``X.weight_packed`` int32 [out, in / 8],
  ``X.weight_scale`` [out, in / group], ``X.weight_shape`` [2];
- fp8 (DeepSeek-V3): ``X.weight`` float8_e4m3fn [out, in], ``X.weight_scale_inv`` float32
  [ceil(out / 128), ceil(in / 128)];
any other tensor is plain. ``logical_view`` turns the file's names and shapes into those of the
plain weights they stand for, so the loader checks a quantized checkpoint against the model as it
checks a plain one, before reading any data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from eaglet.backends.quantized_matrix import INT4_PER_INT32, QuantizedMatrix
from eaglet.distributed.tensor_parallel import TensorShard
from eaglet.errors import CheckpointError
from eaglet.layers.quantized_weight import QuantizableWeight
from eaglet.models.quantization import QuantScheme

INT4_SUFFIXES = ("_packed", "_scale", "_shape")
REFUSED_SUFFIXES = {
    "_zero_point": "an asymmetric scheme (zero points)",
    "_g_idx": "GPTQ activation ordering (g_idx)",
}
FP8_DTYPE = "F8_E4M3"


@dataclass(frozen=True)
class StoredQuantized:
    """One quantized weight: its logical name and shape, and the file tensors that hold it."""

    name: str  # "...down_proj.weight"
    format: str
    shape: tuple[int, int]
    parts: dict[str, str]  # role ("codes", "scales", "shape") -> tensor name in the checkpoint


def logical_view(
    shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], scheme: QuantScheme | None
) -> tuple[dict[str, tuple[int, ...]], dict[str, StoredQuantized], list[str]]:
    """(name -> shape with every quantized weight as its plain [out, in] self, the quantized weights
    by name, problems). Raises nothing: problems are reported with the loader's other findings."""
    quantized: dict[str, StoredQuantized] = {}
    problems: list[str] = []
    for name in shapes:
        if name.endswith(".weight_packed"):
            _int4(name[: -len("_packed")], shapes, scheme, quantized, problems)
        elif dtypes.get(name, "").startswith("F8_") and name.endswith(".weight"):
            _fp8(name, shapes, dtypes, scheme, quantized, problems)
        else:
            for suffix, meaning in REFUSED_SUFFIXES.items():
                if name.endswith(".weight" + suffix):
                    problems.append(f"{name}: {meaning} is not supported")
    consumed = {part for q in quantized.values() for part in q.parts.values()}
    view = {n: s for n, s in shapes.items() if n not in consumed}
    view.update({q.name: q.shape for q in quantized.values()})
    return view, quantized, problems


def _int4(base: str, shapes: dict, scheme: QuantScheme | None, out: dict, problems: list[str]) -> None:
    parts = {role: base + suffix for role, suffix in zip(("codes", "scales", "shape"), INT4_SUFFIXES)}
    absent = [n for n in parts.values() if n not in shapes]
    if absent:
        problems.append(f"{base}: int4 weight without {', '.join(absent)}")
        return
    if scheme is None or scheme.format != "int4":
        problems.append(f"{base}: stored int4 (weight_packed) but quantization_config is {scheme}")
        return
    (out_rows, words), (scale_rows, groups) = shapes[parts["codes"]], shapes[parts["scales"]]
    in_features = groups * scheme.group_size
    if scale_rows != out_rows or words * INT4_PER_INT32 != in_features:
        problems.append(
            f"{base}: weight_packed {[out_rows, words]} and weight_scale {[scale_rows, groups]} do not "
            f"describe one [out, in] matrix in groups of {scheme.group_size}"
        )
        return
    out[base] = StoredQuantized(base, "int4", (out_rows, in_features), parts)


def _fp8(name: str, shapes: dict, dtypes: dict, scheme: QuantScheme | None, out: dict, problems: list[str]) -> None:
    if dtypes[name] != FP8_DTYPE:
        problems.append(f"{name}: fp8 dtype {dtypes[name]} is not supported (eaglet runs {FP8_DTYPE})")
        return
    scale = name + "_scale_inv"
    if scale not in shapes:
        problems.append(f"{name}: fp8 weight without {scale}")
        return
    if scheme is None or scheme.format != "fp8":
        problems.append(f"{name}: stored fp8 but quantization_config is {scheme}")
        return
    rows, cols = shapes[name]
    blocks = (math.ceil(rows / scheme.block_rows), math.ceil(cols / scheme.group_size))
    if tuple(shapes[scale]) != blocks:
        problems.append(f"{scale}: shape {list(shapes[scale])}, expected {list(blocks)} for {name} {[rows, cols]}")
        return
    out[name] = StoredQuantized(name, "fp8", (rows, cols), {"codes": name, "scales": scale})


def quantized_matrix(
    stored: StoredQuantized, read: Callable[[str, tuple[slice, ...] | None], torch.Tensor], scheme: QuantScheme,
    shard: TensorShard | None = None,
) -> QuantizedMatrix:
    """The matrix (or this rank's ``shard`` of it) from its file tensors (``read``: name, slicing ->
    tensor; only the slices a shard needs are read)."""
    rows, cols = stored.shape
    local_rows, local_cols = shard.sharded_shape((rows, cols)) if shard is not None else (rows, cols)
    if stored.format == "int4":
        group = scheme.group_size
        codes_index = scales_index = None
        if shard is not None and shard.dim == 0:
            codes_index = scales_index = shard.index(2)
        elif shard is not None:
            if shard.start % group or shard.length % group:
                raise CheckpointError(
                    f"{stored.name}: tensor parallelism gives a rank its columns [{shard.start}, "
                    f"{shard.start + shard.length}) of {cols}, not whole int4 groups of {group}: choose a tp_size "
                    f"that splits the groups evenly"
                )
            codes_index = (slice(None), slice(shard.start // INT4_PER_INT32, (shard.start + shard.length) // INT4_PER_INT32))
            scales_index = (slice(None), slice(shard.start // group, (shard.start + shard.length) // group))
        codes, scales = read(stored.parts["codes"], codes_index), read(stored.parts["scales"], scales_index)
        declared = read(stored.parts["shape"], None).tolist()
        if declared != [rows, cols]:
            raise CheckpointError(f"{stored.parts['shape']}: {declared}, but the packed weight holds {[rows, cols]}")
        if codes.dtype != torch.int32:
            raise CheckpointError(f"{stored.parts['codes']}: dtype {codes.dtype}, expected torch.int32")
        if scales.dtype not in (torch.bfloat16, torch.float32):
            scales = scales.float()  # float16 scales are exact in float32
        return QuantizedMatrix("int4", codes.contiguous(), scales.contiguous(), group, local_cols)
    block_rows, block_cols = scheme.block_rows, scheme.group_size
    first_row, codes_index, scales_index = 0, None, None
    if shard is not None and shard.dim == 0:
        first_block = shard.start // block_rows
        first_row = shard.start - first_block * block_rows
        codes_index = shard.index(2)
        scales_index = (slice(first_block, -(-(shard.start + shard.length) // block_rows)), slice(None))
    elif shard is not None:
        end = shard.start + shard.length
        if shard.start % block_cols or (end % block_cols and end != cols):
            raise CheckpointError(
                f"{stored.name}: tensor parallelism gives a rank its columns [{shard.start}, {end}) of {cols}, "
                f"not whole FP8 blocks of {block_cols}: choose a tp_size that splits the blocks evenly"
            )
        codes_index = shard.index(2)
        scales_index = (slice(None), slice(shard.start // block_cols, -(-end // block_cols)))
    codes = read(stored.parts["codes"], codes_index)
    block_scales = read(stored.parts["scales"], scales_index).float()
    # One scale per row per 128 columns (see quantized_matrix): rows of a block share its scale.
    scales = block_scales.repeat_interleave(block_rows, dim=0)[first_row : first_row + local_rows].contiguous()
    return QuantizedMatrix("fp8", codes.contiguous(), scales, block_cols, local_cols)


def quantized_receivers(model: nn.Module, prefix: str = "") -> dict[str, Callable[[QuantizedMatrix], None]]:
    """Checkpoint weight name -> where its quantized form goes, for every weight the model can run
    quantized (``QuantizableWeight`` modules, routed experts)."""
    receivers: dict[str, Callable[[QuantizedMatrix], None]] = {}
    for name, module in model.named_modules():
        dotted = f"{prefix}{name}." if name else prefix
        if isinstance(module, QuantizableWeight):
            receivers[f"{dotted}weight"] = module.hold_quantized
        elif hasattr(module, "hold_quantized") and hasattr(module, "checkpoint_weights"):
            for full in module.checkpoint_weights(dotted):
                suffix = full[len(dotted):]
                receivers[full] = lambda matrix, m=module, s=suffix: m.hold_quantized(s, matrix)
    return receivers


def partly_quantized(model: nn.Module, quantized: dict[str, StoredQuantized], prefix: str = "") -> list[str]:
    """Modules whose weights are multiplied as one stack (a layer's routed experts) but stored partly
    quantized and partly plain, or quantized in different formats."""
    mixed = []
    for name, module in model.named_modules():
        if hasattr(module, "hold_quantized") and hasattr(module, "checkpoint_weights"):
            names = module.checkpoint_weights(f"{prefix}{name}." if name else prefix)
            formats = {quantized[n].format if n in quantized else "plain" for n in names}
            if len(formats) > 1:
                mixed.append(f"{prefix}{name} ({', '.join(sorted(formats))})")
    return mixed
