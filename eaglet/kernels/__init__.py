"""eaglet's fused CPU kernels (``csrc/``: one file per op family, the tile-layout GEMM one per
instruction set, ``registration.cpp`` naming every op), compiled on first use for this machine.

The kernels run under ``torch.ops.eaglet``: ``rms_norm``, ``argmax_last_dim`` (greedy tokens),
``topk_logprobs`` (the draft's tree proposals), ``select_draft_tree`` and ``tree_attention_mask``
(EAGLE-2 tree selection and its verify mask), ``verify_tree_greedy`` / ``verify_tree_greedy_ids``
and ``commit_table`` (a speculative round's acceptance, from logits or greedy ids, and commit, with
the draft extend's per-request vectors), ``copy_cache_slots`` (an accepted tree path's cache entries
moving to their rows), ``write_block_entries`` (the request-to-slots table's entries of new
cache blocks) and ``scratch_slots`` (a round's slots), ``rope_query_key``, ``noaux_route`` (DeepSeek-V3 routing), ``mla_cache_write`` and
``mla_absorbed_attention`` (absorbed MLA attention over the paged latent cache) and, where
``tile_backend()`` names one, ``amx_linear`` (bfloat16 GEMMs on weights in AMX tile layout),
``amx_linear_argmax`` (an lm_head's greedy ids without its logits), ``amx_swiglu`` and
``moe_routed_experts`` (all routed experts in one call). The tile-layout kernels multiply on AMX
tiles, with AVX512-BF16 dot products on CPUs without AMX (AMD Zen 4 and later), or with float32
FMAs on the weights widened in registers on AVX2-only CPUs: the same layout and one product chain
per output in k order, so a row's bits do not depend on its batch. Each
does in one call what the PyTorch fallback does in 5-40 ops, and computes every token
independently of the rest of its batch. ``torch.classes.eaglet.DecoderStack`` runs a bfloat16
model's decoder layers (or an MLA draft's midlayer) through those kernels in one call per forward,
and a draft's whole top-1 chain (``draft_chain``) or EAGLE-2 tree (``draft_tree``) in one call per
round (``eaglet.backends.cpu.decoder_stack``).

This package builds, loads and describes the kernels and imports nothing else of eaglet; the CPU
backend (``eaglet.backends.cpu``) wraps them. The build (``build.py``) needs a C++ compiler and
ninja; where the kernels cannot be built, ``available()`` is False (with one warning saying why)
and engines run the PyTorch backend. ``EAGLET_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from eaglet.kernels.build import build_and_load

logger = logging.getLogger(__name__)


@functools.cache
def _load() -> str | None:
    """Builds and loads the kernels; returns None on success, else why they are unavailable."""
    if os.environ.get("EAGLET_CPU_KERNELS", "1") == "0":
        return "turned off by EAGLET_CPU_KERNELS=0"
    try:
        build_and_load()
    except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch ops still work
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        logger.warning("eaglet CPU kernels unavailable, using PyTorch ops (%s)", reason)
        return reason
    return None


def available() -> bool:
    """Whether ``torch.ops.eaglet`` holds the kernels (built on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def tile_backend() -> str | None:
    """What the tile-layout kernels multiply on here ("amx", "avx512_bf16", "avx2"), or None (none,
    or the kernels unavailable: bfloat16 matrices then take oneDNN's packed GEMMs or F.linear)."""
    return (torch.ops.eaglet_info.tile_backend() or None) if available() else None
