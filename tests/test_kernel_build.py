"""The kernel build survives being killed: a build stopped midway (``kill -9`` during the first
start) leaves nothing that makes the next start wait, and the next start says it is compiling."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet import kernels
from eaglet.kernels import build

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels not built: {kernels.unavailable_reason()}")

LOAD = "import eaglet.kernels as k; print('loaded' if k.available() else k.unavailable_reason())"


def _half_built_cache(root: Path) -> Path:
    """This machine's build with its library gone and torch's build lock left behind: the state a
    build killed while linking leaves (the objects are there, the link is not)."""
    built = build.build_dir()
    copy = root / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("*.so", "build.flock"))
    (copy / "lock").write_text("")
    return copy


def _start(cache: Path) -> subprocess.Popen:
    env = {**os.environ, "EAGLET_KERNEL_CACHE": str(cache.parent)}
    return subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_start_after_a_killed_build_finishes_it(tmp_path):
    cache = _half_built_cache(tmp_path)
    first = _start(cache)
    time.sleep(1.0)  # into its link (or before it): wherever it is, it dies there
    first.send_signal(signal.SIGKILL)
    first.wait()
    start = time.perf_counter()
    second = _start(cache)
    out, err = second.communicate(timeout=600)
    assert out.strip() == "loaded", err
    assert "compiling the CPU kernels" in err and "compiled in" in err
    assert time.perf_counter() - start < 600
    assert any(cache.glob("eaglet_cpu_ops*.so")) and not (cache / "lock").exists()


def test_torchs_stale_lock_alone_does_not_block(tmp_path):
    cache = _half_built_cache(tmp_path)
    out, err = _start(cache).communicate(timeout=600)
    assert out.strip() == "loaded", err
