"""What a benchmark record says about the machine and the code it ran: CPU, threads, library
versions, what eaglet's bfloat16 GEMM kernels ran on, and the eaglet commit."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path

import torch

# The eaglet package directory: its git checkout, when it sits in one, names the code measured.
EAGLET_DIR = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import transformers

    from eaglet import kernels

    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": torch.backends.mkl.is_available(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "tile_backend": kernels.tile_backend(),  # what eaglet's bfloat16 GEMM kernels run on
        "kernels_unavailable": kernels.unavailable_reason(),  # eaglet then runs PyTorch ops: say why
        "mem_total_gib": _mem_total_gib(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "eaglet_git": _git_describe(),
    }


def _git_describe() -> str | None:
    """HEAD commit of the git checkout holding the eaglet package, with '+dirty' when the package
    has uncommitted changes; None for an installed wheel."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=EAGLET_DIR, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=EAGLET_DIR, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (head + ("+dirty" if dirty else "")) or None
    return None


def _mem_total_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None
