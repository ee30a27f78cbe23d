"""What /proc/cpuinfo says of this CPU (nothing where there is none, e.g. macOS)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path


def _cpuinfo_field(name: str) -> str:
    """The first CPU's ``name`` field of /proc/cpuinfo; empty where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags."""
    return frozenset(_cpuinfo_field("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor_id ("GenuineIntel", "AuthenticAMD")."""
    return _cpuinfo_field("vendor_id")
