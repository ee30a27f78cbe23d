"""Echo targets and drafts: random checkpoints whose EAGLE-3 acceptance is set by a dial.

Random drafts accept almost nothing, which would leave the acceptance paths untested (and the
bench without speculation worth timing), so tests and the bench also use an "echo" pair:

- echo target: lm_head = embed_tokens and every residual branch (o_proj, down_proj) scaled by
  alpha, so the residual stream stays close to the current token's embedding and the target
  mostly predicts the current token again; larger alpha makes it deviate more often;
- echo draft: shares the target's lm_head, fc averages the three captured features, its own
  residual branches are scaled down, so it predicts "the same token again" at every step.

The draft is then right exactly when the target repeats, which gives partial acceptance with
accepted, rejected and bonus tokens in the same runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint, write_kimi_k25_checkpoint
from eaglet.testing.draft_checkpoints import write_eagle3_draft

IMAGE_TOKEN = 250


def draft_for(target: Path, path: Path, **kwargs: Any) -> Path:
    return write_eagle3_draft(path, target, **kwargs)


def _edit(checkpoint: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    index_path = checkpoint / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values())) if index_path.exists() else ["model.safetensors"]
    tensors = {}
    for shard in shards:
        tensors.update({name: (shard, t) for name, t in load_file(checkpoint / shard).items()})
    edit({name: t for name, (_, t) in tensors.items()})
    for shard in shards:
        save_file({name: t for name, (s, t) in tensors.items() if s == shard}, checkpoint / shard)


def _scale_residual_branches(tensors: dict[str, torch.Tensor], alpha: float) -> None:
    for name, tensor in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")) and "vision_tower" not in name:
            tensor.mul_(alpha)


def make_echo_target(path: Path, alpha: float, prefix: str = "") -> Path:
    """Turns a written target into an echo dial in place (``prefix``: where its text model's
    tensors sit, ``"language_model."`` for Kimi-K2.5)."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{prefix}lm_head.weight"].copy_(tensors[f"{prefix}model.embed_tokens.weight"])
        _scale_residual_branches(tensors, alpha)

    _edit(path, edit)
    return path


def make_successor_target(path: Path, successor: dict[int, int], alpha: float, prefix: str = "") -> Path:
    """Like ``make_echo_target``, but at token t the target predicts ``successor[t]`` instead of t:
    lm_head's row of ``successor[t]`` is t's embedding. ``successor`` (distinct values) is completed
    to a permutation of the vocabulary, the other tokens pairing up in id order."""
    if len(set(successor.values())) != len(successor):
        raise ValueError("two tokens cannot have the same successor")

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        embed = tensors[f"{prefix}model.embed_tokens.weight"]
        vocab = embed.shape[0]
        taken = set(successor.values())
        sources = [t for t in range(vocab) if t not in successor]
        targets = [t for t in range(vocab) if t not in taken]
        permutation = {**successor, **dict(zip(sources, targets))}
        head = tensors[f"{prefix}lm_head.weight"]
        for token, following in permutation.items():
            head[following].copy_(embed[token])
        _scale_residual_branches(tensors, alpha)

    _edit(path, edit)
    return path


def echo_kimi_target(path: Path, alpha: float, seed: int = 11) -> Path:
    write_kimi_k25_checkpoint(path, {"max_position_embeddings": 256}, seed=seed, image_token_id=IMAGE_TOKEN)
    return make_echo_target(path, alpha, prefix="language_model.")


def echo_text_target(path: Path, alpha: float, text_overrides: dict | None = None, seed: int = 11,
                     dtype: torch.dtype = torch.float32) -> Path:
    write_deepseek_v3_checkpoint(path, text_overrides, seed=seed, dtype=dtype)
    return make_echo_target(path, alpha)


def echo_draft(target: Path, path: Path, *, kind: str, seed: int = 0, alpha: float = 0.01, **kwargs: Any) -> Path:
    kwargs.setdefault("draft_vocab_size", None)
    write_eagle3_draft(path, target, kind=kind, seed=seed, **kwargs)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        fc = tensors["fc.weight"]
        hidden = fc.shape[0]
        fc.copy_(torch.eye(hidden).repeat(1, fc.shape[1] // hidden) / (fc.shape[1] // hidden))
        _scale_residual_branches(tensors, alpha)

    _edit(path, edit)
    return path
