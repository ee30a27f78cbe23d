"""Compiling the kernels for this machine, once per source, torch version and CPU, and loading them.

Builds go to ``~/.cache/eaglet/kernels/<key>`` (``EAGLET_KERNEL_CACHE`` overrides the root). One
process builds a directory at a time, under an OS file lock that dies with its process: a build
killed midway (``kill -9`` during the first ``eaglet serve``) leaves no lock behind that makes the
next start wait, and the next build picks up what ninja finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from eaglet.kernels import cpu_info

logger = logging.getLogger(__name__)

NAME = "eaglet_cpu_ops"
SOURCE_DIR = Path(__file__).with_name("csrc")
# -fopenmp: at::parallel_for runs on torch's OpenMP pool (same libgomp soname, one runtime).
# -ffp-contract=off: a*b+c stays two roundings, as in the PyTorch ops the kernels mirror.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


def sources() -> list[Path]:
    """The translation units: every ``.cpp`` under ``csrc/`` (the headers come with them)."""
    return sorted(SOURCE_DIR.glob("*.cpp"))


def build_dir() -> Path:
    """The build cache of these sources, torch version and CPU: the kernels are compiled with
    -march=native, so a build made on another CPU (a home directory shared between an AMX Xeon and
    an AVX512-BF16 EPYC, say) may use instructions this one lacks, or miss ones it has. The key
    covers every source and header under ``csrc/``, by name and content, and where they are: ninja's
    build file names the sources by path, so two checkouts sharing a directory would rebuild it in turn."""
    root = Path(os.environ.get("EAGLET_KERNEL_CACHE", Path.home() / ".cache" / "eaglet" / "kernels"))
    digest = hashlib.sha256(str(SOURCE_DIR.resolve()).encode() + b"\0")
    for path in sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(torch.__version__.encode() + " ".join(sorted(cpu_info.cpu_flags())).encode())
    return root / digest.hexdigest()[:16]


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` (waiting for another process's build); the OS releases
    it when the holder exits, however it exits."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_and_load() -> None:
    """Builds the kernels if this directory has no finished build yet (saying so, and how long it
    took), then loads them into ``torch.ops.eaglet``. Raises what the compiler or loader raised.

    A finished build (its ``complete`` marker, written after the link) loads without ninja or a
    compiler: an installed eaglet keeps its kernels when its build tools are gone."""
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library, marker = directory / f"{NAME}.so", directory / "complete"
    if marker.is_file() and library.is_file():
        torch.ops.load_library(str(library))
        return
    from torch.utils import cpp_extension

    with _exclusive(directory / "build.flock"):
        # torch's own lock file, left by a build killed midway: under our lock no one else builds here.
        (directory / "lock").unlink(missing_ok=True)
        fresh = not library.is_file()
        if fresh:
            logger.warning(
                "eaglet: compiling the CPU kernels for this CPU and source (once; about 1-4 minutes on 2 cores) in %s",
                directory,
            )
        start = time.perf_counter()
        cpp_extension.load(
            name=NAME, sources=[str(path) for path in sources()], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
            build_directory=str(directory), is_python_module=False, verbose=False,
        )
        marker.write_text(f"built in {time.perf_counter() - start:.0f} s\n")
        if fresh:
            logger.warning("eaglet: CPU kernels compiled in %.0f s", time.perf_counter() - start)
