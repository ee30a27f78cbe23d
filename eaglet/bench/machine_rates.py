"""The machine's memory read bandwidth and GEMM throughput, the two sides of a decode step's
roofline."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def measure_bandwidth(gib: float = 1.0, runs: int = 7) -> dict:
    """Read bandwidth (sum of a float32 buffer) and copy bandwidth (read + write bytes), GB/s."""
    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    src.sum(), dst.copy_(src)  # touch every page first
    reads, copies = [], []
    for _ in range(runs):
        t = time.perf_counter()
        src.sum()
        reads.append(n * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * n * 4 / (time.perf_counter() - t) / 1e9)
    del src, dst
    return {
        "buffer_gib": gib,
        "read_gbps": statistics.median(reads),
        "copy_gbps": statistics.median(copies),
        "read_runs": [round(x, 2) for x in reads],
        "copy_runs": [round(x, 2) for x in copies],
    }


def measure_gemm(dtype: torch.dtype, m: int = 256, n: int = 1024, k: int = 1024, runs: int = 9) -> float:
    """Achievable GEMM throughput (GFLOP/s) for ``dtype`` with cache-resident weights."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    F.linear(x, w)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - t)
    return 2 * m * n * k / statistics.median(times) / 1e9
