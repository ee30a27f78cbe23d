"""Loads a Hugging Face checkpoint directory (config.json + safetensors) into an eaglet model.

Every tensor the model needs is matched against the checkpoint BEFORE any data is read: missing,
unexpected and mis-shaped tensors are reported together in one CheckpointError, so nothing ever runs
on a half-loaded model. Shards are read through safetensors' memory map, one tensor at a time.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from eaglet.distributed.tensor_parallel import TensorShard
from eaglet.errors import CheckpointError
from eaglet.models.load_time_quantization import LoadTimeQuantization, quantize_at_load
from eaglet.models.quantization import QuantScheme
from eaglet.models.quantized_checkpoint import logical_view, partly_quantized, quantized_matrix, quantized_receivers

# Tensors that published checkpoints carry but inference does not use.
IGNORED_TENSORS = (
    re.compile(r".*rotary_emb\.inv_freq$"),
)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Maps each tensor name to the shard holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        missing_shards = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing_shards:
            raise CheckpointError(f"{model_dir}: shards listed in the index are missing: {missing_shards}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir}: no model.safetensors, no model.safetensors.index.json, no *.safetensors")
    files: dict[str, Path] = {}
    for shard in shards:
        with _open(shard) as f:
            files.update({name: shard for name in f.keys()})
    return files


def read_checkpoint_tensor(model_dir: str | Path, name: str) -> torch.Tensor:
    """One tensor of a checkpoint, whole."""
    files = checkpoint_files(Path(model_dir))
    if name not in files:
        raise CheckpointError(f"{model_dir}: no tensor {name}")
    with _open(files[name]) as f:
        return f.get_tensor(name)


@contextlib.contextmanager
def _open(path: Path) -> Iterator:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc


class _ShardReader:
    """Tensors by name from the shards holding them, each shard opened on first use and closed with
    the reader."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.stack = contextlib.ExitStack()
        self.handles: dict[Path, object] = {}

    def __enter__(self) -> _ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or only its ``index`` slice (read from the file, not sliced after)."""
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(_open(path))
        if index is None:
            return self.handles[path].get_tensor(name)
        return self.handles[path].get_slice(name)[index]


@contextlib.contextmanager
def skip_init(dtype: torch.dtype) -> Iterator[None]:
    """Builds modules with uninitialised parameters in ``dtype``: the loader fills every one."""
    layer_types = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv2d)
    saved = {cls: cls.reset_parameters for cls in layer_types}
    previous_dtype = torch.get_default_dtype()
    try:
        for cls in layer_types:
            cls.reset_parameters = lambda self: None
        torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_dtype(previous_dtype)
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def weight_targets(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the tensor (parameter or view of one) it loads into.

    Tied aliases (``tied_weights``) are not expected in the checkpoint; they are re-pointed after loading.
    """
    targets: dict[str, torch.Tensor] = {}
    tied: set[str] = set()

    def visit(module: nn.Module, name: str) -> None:
        dotted = f"{name}." if name else ""
        if hasattr(module, "tied_weights"):
            tied.update(dotted + alias for alias in module.tied_weights())
        if hasattr(module, "checkpoint_weights"):
            targets.update(module.checkpoint_weights(f"{prefix}{dotted}"))
            return
        for param_name, param in module.named_parameters(recurse=False):
            if dotted + param_name not in tied:
                targets[f"{prefix}{dotted}{param_name}"] = param.data
        for child_name, child in module.named_children():
            visit(child, dotted + child_name)

    visit(model, "")
    return targets


def weight_shards(model: nn.Module, prefix: str = "") -> dict[str, TensorShard]:
    """Checkpoint tensor name -> the slice of it this tensor-parallel rank holds (absent: whole)."""
    shards: dict[str, TensorShard] = {}
    for name, module in model.named_modules():
        dotted = f"{prefix}{name}." if name else prefix
        shard = getattr(module, "tensor_shard", None)
        if shard is not None:
            shards[f"{dotted}weight"] = shard
            if getattr(module, "bias", None) is not None and shard.dim == 0:
                shards[f"{dotted}bias"] = TensorShard(0, shard.start, shard.length)
        if hasattr(module, "checkpoint_shards"):
            shards.update(module.checkpoint_shards(dotted))
    return shards


def unowned_tensors(model: nn.Module, prefix: str = "") -> set[str]:
    """Checkpoint tensors that other tensor-parallel ranks hold (expert parallelism's other experts)."""
    names: set[str] = set()
    for name, module in model.named_modules():
        if hasattr(module, "unowned_checkpoint_tensors"):
            names |= module.unowned_checkpoint_tensors(f"{prefix}{name}." if name else prefix)
    return names


def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    *,
    prefix: str = "",
    show_progress: bool = True,
    quantization: QuantScheme | None = None,
    quantize: LoadTimeQuantization | None = None,
) -> None:
    """Loads every tensor of ``model`` from the checkpoint. Weights the files store quantized (the
    scheme of config.json's ``quantization_config``) go to their modules as ``QuantizedMatrix``
    (codes and scales as stored, never dequantized here). ``quantize`` quantizes plain matrices
    once read (``load_time_quantization``)."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    targets = weight_targets(model, prefix)
    tp_slices = weight_shards(model, prefix)
    unowned = unowned_tensors(model, prefix)
    ignored = IGNORED_TENSORS + tuple(getattr(model, "ignored_checkpoint_tensors", lambda: ())())
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for shard in sorted(set(files.values())):
        with _open(shard) as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                shapes[name] = tuple(tensor_slice.get_shape())
                dtypes[name] = tensor_slice.get_dtype()
    index_only = sorted(n for n, p in files.items() if n not in shapes)
    shapes, quantized, problems = logical_view(shapes, dtypes, quantization)
    for name, piece in tp_slices.items():
        if name in shapes:
            full = shapes[name]
            if piece.dim >= len(full) or piece.start + piece.length > full[piece.dim]:
                problems.append(
                    f"{name}: shape {list(full)} has no slice [{piece.start}, {piece.start + piece.length}) along dim {piece.dim}"
                )
            else:
                shapes[name] = piece.sharded_shape(full)
    receivers = quantized_receivers(model, prefix)
    unrunnable = sorted(n for n in quantized if n in targets and n not in receivers)
    missing = sorted(n for n in targets if n not in shapes)
    unexpected = sorted(
        n for n in shapes if n not in targets and n not in unowned and not any(p.match(n) for p in ignored)
    )
    misshaped = [
        f"{n}: checkpoint {list(shapes[n])}, model expects {list(targets[n].shape)}"
        for n in sorted(targets)
        if n in shapes and shapes[n] != tuple(targets[n].shape)
    ]
    if unrunnable:
        problems.append(f"stored quantized where eaglet runs only plain weights: {_clip(unrunnable)}")
    mixed = partly_quantized(model, quantized, prefix)
    if mixed:
        problems.append(f"weights multiplied as one stack stored in different forms: {_clip(mixed)}")
    if index_only:
        problems.append(f"listed in the index but absent from their shard: {_clip(index_only)}")
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_clip(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_clip(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors ({len(misshaped)}): {_clip(misshaped)}")
    if problems:
        raise CheckpointError(f"{model_dir}: checkpoint does not match the model config:\n  " + "\n  ".join(problems))

    by_shard: dict[Path, list[str]] = {}
    for name in targets:
        if name not in quantized:
            by_shard.setdefault(files[name], []).append(name)
    progress = tqdm(total=len(targets), desc="Loading weights", unit="tensor", disable=not show_progress)
    with torch.no_grad():
        # Quantized weights by the shard of their codes, that shard and the ones holding their
        # scales open together: one shard's pages are mapped at a time, as for plain tensors.
        by_codes_shard: dict[Path, list[str]] = {}
        for name in sorted(n for n in quantized if n in targets):
            by_codes_shard.setdefault(files[quantized[name].parts["codes"]], []).append(name)
        for names in by_codes_shard.values():
            with _ShardReader(files) as reader:
                for name in names:
                    receivers[name](quantized_matrix(quantized[name], reader.read, quantization, tp_slices.get(name)))
                    progress.update(1)
        for shard, names in sorted(by_shard.items()):
            with _open(shard) as f:
                for name in names:
                    piece = tp_slices.get(name)
                    tensor = f.get_tensor(name) if piece is None else f.get_slice(name)[piece.index(targets[name].dim())]
                    if not (tensor.is_floating_point() or tensor.dtype == targets[name].dtype):
                        raise CheckpointError(f"{shard.name}: tensor {name} has dtype {tensor.dtype}, expected floating point")
                    targets[name].copy_(tensor)
                    progress.update(1)
    progress.close()
    if quantize is not None:
        quantize_at_load(model, quantize)
    _tie(model)
    # Children first: a module that prepares itself from its children's weight methods (a decoder
    # stack) finds them made.
    for module in reversed(list(model.modules())):
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def _tie(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "tied_weights"):
            for alias, source in module.tied_weights().items():
                alias_module, _, alias_attr = alias.rpartition(".")
                source_param = module.get_parameter(source)
                setattr(module.get_submodule(alias_module), alias_attr, source_param)


def _clip(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")
