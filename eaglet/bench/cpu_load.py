"""CPU time other processes take while a benchmark runs: the machine is shared and noisy, so timed
runs record it and may wait for quiet."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from types import TracebackType


def loadavg() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


class ForeignCPU:
    """CPU time used by OTHER processes while a block runs, as a fraction of all cores.

    /proc/stat busy time minus this process's CPU time; the machine is shared and noisy, so every
    timed run records it (a run with much foreign load is not a clean measurement).
    """

    def __init__(self) -> None:
        self.fraction: float | None = None

    @staticmethod
    def _busy_s() -> float | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
            idle = fields[3] + fields[4]
            return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")
        return None

    def __enter__(self) -> "ForeignCPU":
        self._busy0, self._own0, self._wall0 = self._busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None = None, exc: BaseException | None = None,
                 traceback: TracebackType | None = None) -> None:
        busy1 = self._busy_s()
        wall = time.perf_counter() - self._wall0
        if self._busy0 is None or busy1 is None or wall <= 0:
            return
        foreign = (busy1 - self._busy0) - (time.process_time() - self._own0)
        self.fraction = max(0.0, foreign / (wall * (os.cpu_count() or 1)))


def wait_for_idle(max_wait_s: float, threshold: float = 0.15, window_s: float = 2.0) -> float:
    """Waits (up to max_wait_s) until other processes use < threshold of the CPUs; returns seconds waited."""
    t0 = time.perf_counter()
    while True:
        with ForeignCPU() as f:
            time.sleep(window_s)
        waited = time.perf_counter() - t0
        if f.fraction is None or f.fraction < threshold or waited >= max_wait_s:
            return waited
