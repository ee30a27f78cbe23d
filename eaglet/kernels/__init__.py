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
tiles, or with AVX512-BF16 dot products on CPUs without AMX (AMD Zen 4 and later): the same
layout and the same per-row order of products, so a row's bits do not depend on its batch. Each
does in one call what the PyTorch fallback does in 5-40 ops, and computes every token
independently of the rest of its batch. ``torch.classes.eaglet.DecoderStack`` runs a bfloat16 model's decoder layers (or an MLA
draft's midlayer) through those kernels in one call per forward, and a draft's whole top-1 chain
(``draft_chain``) or EAGLE-2 tree (``draft_tree``) in one call per round (``decoder_stack.py``).

The build needs a C++ compiler and ninja; it takes about 15 s once and is cached under
``~/.cache/eaglet/kernels`` (``EAGLET_KERNEL_CACHE`` overrides), keyed by the sources (every file
of ``csrc/``), the torch version and the CPU's feature flags. ``EAGLET_CPU_KERNELS=0`` turns the
kernels off; where they cannot be built, ``available()`` is False (with one warning saying why)
and callers use the PyTorch ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")


def _sources() -> list[Path]:
    """The translation units: every ``.cpp`` under ``csrc/`` (the headers come with them)."""
    return sorted(SOURCE_DIR.glob("*.cpp"))


def _build_dir() -> Path:
    """The build cache of these sources, torch version and CPU: the kernels are compiled with
    -march=native, so a build made on another CPU (a home directory shared between an AMX Xeon and
    an AVX512-BF16 EPYC, say) may use instructions this one lacks, or miss ones it has. The key
    covers every source and header under ``csrc/``, by name and content."""
    from eaglet.backends.cpu_caps import cpu_flags

    root = Path(os.environ.get("EAGLET_KERNEL_CACHE", Path.home() / ".cache" / "eaglet" / "kernels"))
    machine = " ".join(sorted(cpu_flags())).encode()
    digest = hashlib.sha256()
    for path in sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(torch.__version__.encode() + machine)
    return root / digest.hexdigest()[:16]


@functools.cache
def _load() -> str | None:
    """Builds and loads the kernels; returns None on success, else why they are unavailable."""
    if os.environ.get("EAGLET_CPU_KERNELS", "1") == "0":
        return "turned off by EAGLET_CPU_KERNELS=0"
    try:
        from torch.utils import cpp_extension

        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="eaglet_cpu_ops",
            sources=[str(path) for path in _sources()],
            # -fopenmp: at::parallel_for runs on torch's OpenMP pool (same libgomp soname, one runtime).
            # -ffp-contract=off: a*b+c stays two roundings, as in the PyTorch ops the kernels mirror.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch ops still work
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        logger.warning("eaglet CPU kernels unavailable, using PyTorch ops (%s)", reason)
        return reason
    global _loaded
    _loaded = True
    return None


_loaded = False  # set once the kernels are loaded (read on hot paths by loaded())


def available() -> bool:
    """Whether ``torch.ops.eaglet`` holds the kernels (built on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def loaded() -> bool:
    """Whether the kernels are loaded already; unlike ``available()``, never starts a build (for
    hot paths that use a kernel only where a model load has built them)."""
    return _loaded


def tile_backend() -> str | None:
    """What the tile-layout kernels multiply on here: "amx", "avx512_bf16", or None (neither, or the
    kernels unavailable; the model then takes oneDNN's packed GEMMs or F.linear)."""
    return (torch.ops.eaglet_info.tile_backend() or None) if available() else None


def use_cpu_kernels(model: torch.nn.Module) -> int:
    """Switches the model's matrices to the kernels (they need ``available()``): where
    ``tile_backend()`` names one, every bfloat16 matrix that ``linear`` multiplies
    (``packable_weights``) gets its tile layout copy, and the routed experts and each SwiGLU run in
    one call, and a DeepSeek-V3 model's layers (an MLA EAGLE-3 draft's midlayer) run as one
    DecoderStack call wherever every matrix qualifies. Attention is the backend's
    (FusedCPUMLABackend). Returns how many modules and matrices were switched."""
    from eaglet.kernels.decoder_stack import FusedDecoderStack, FusedMidlayer
    from eaglet.layers.linear import AMX_PACKED, pack_weight_for_amx
    from eaglet.layers.mla import MLAAttention
    from eaglet.layers.moe import RoutedExperts, SwiGLU
    from eaglet.models.deepseek_v3 import DeepseekV3Model
    from eaglet.models.eagle3 import Eagle3Draft

    if not available():
        raise RuntimeError(f"eaglet CPU kernels unavailable: {unavailable_reason()}")
    tiles = tile_backend() is not None
    count = 0
    for module in model.modules():
        if not tiles:
            continue
        for weight in module.packable_weights() if hasattr(module, "packable_weights") else ():
            if weight.dim() == 2 and weight.dtype == torch.bfloat16 and not hasattr(weight, AMX_PACKED):
                pack_weight_for_amx(weight)
                count += 1
        if isinstance(module, RoutedExperts) and module.w13_per_expert and module.w13.dtype == torch.bfloat16:
            # One stacked copy per matrix kind for the one-call kernel; the per-expert copies go
            # (only the PyTorch path, under autograd or in float32, multiplies single experts).
            module.amx_weights = tuple(
                torch.stack([getattr(w, AMX_PACKED)[0] for w in weights]) for weights in (module.w13_per_expert, module.w2_per_expert)
            )
            for weight in module.w13_per_expert + module.w2_per_expert:
                delattr(weight, AMX_PACKED)
            count += 1
        if (isinstance(module, MLAAttention) and module.w_uk is not None and module.kv_b_proj.weight.dtype == torch.bfloat16
                and module.kv_lora_rank % 16 == 0):
            # W_UK / W_UV were taken from the bfloat16 kv_b_proj: back in bfloat16 they are exact.
            pack = torch.ops.eaglet.amx_pack_weight
            module.amx_projections = (
                torch.stack([pack(w.t().bfloat16().contiguous()) for w in module.w_uk]),  # [L, P] per head
                torch.stack([pack(w.t().bfloat16().contiguous()) for w in module.w_uv_t]),  # [V, L] per head
            )
            count += 1
        if isinstance(module, SwiGLU) and module.gate_up_weight is not None and module.gate_up_weight.dtype == torch.bfloat16:
            module.amx_weights = (getattr(module.gate_up_weight, AMX_PACKED)[0], getattr(module.down_proj.weight, AMX_PACKED)[0])
            count += 1
    for module in model.modules():
        if tiles and isinstance(module, DeepseekV3Model):
            module.decoder_stack = FusedDecoderStack.build(module)
            count += module.decoder_stack is not None
        if tiles and isinstance(module, Eagle3Draft):
            module.fused_midlayer = FusedMidlayer.build(module)
            count += module.fused_midlayer is not None
    return count
