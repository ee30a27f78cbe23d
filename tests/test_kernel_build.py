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
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("*.so", "build.flock", "complete"))
    (copy / "lock").write_text("")
    return copy


def _start(cache: Path, code: str = LOAD) -> subprocess.Popen:
    env = {**os.environ, "EAGLET_KERNEL_CACHE": str(cache.parent)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def test_a_finished_build_loads_without_compiling(tmp_path):
    """An installed eaglet whose build tools are gone (no ninja, no compiler) keeps its kernels."""
    copy = tmp_path / build.build_dir().name
    shutil.copytree(build.build_dir(), copy, ignore=shutil.ignore_patterns("build.flock"))
    assert (copy / "complete").is_file()
    no_build_tools = ("import torch.utils.cpp_extension as c\n"
                      "def refuse(*args, **kwargs): raise RuntimeError('no build tools')\n"
                      "c.load = refuse\n" + LOAD)
    out, err = _start(copy, no_build_tools).communicate(timeout=120)
    assert out.strip() == "loaded", err
    (copy / "complete").unlink()  # an unfinished build is built (and here cannot be)
    out, err = _start(copy, no_build_tools).communicate(timeout=120)
    assert "no build tools" in out, err


def test_checkouts_with_the_same_sources_build_apart(monkeypatch, tmp_path):
    """ninja's build file names its sources by path: two checkouts sharing one directory would
    rebuild it each time the other one loaded."""
    here = build.build_dir()
    copy = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, copy)
    monkeypatch.setattr(build, "SOURCE_DIR", copy)
    assert build.build_dir() != here and build.build_dir().parent == here.parent
