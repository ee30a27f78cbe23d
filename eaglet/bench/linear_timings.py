"""One decode-sized GEMM three ways: F.linear, the PyTorch backend's oneDNN-packed weight, float32.

    python -m eaglet.bench.linear_timings                    # the DeepSeek-V3 bench model's shapes
    python -m eaglet.bench.linear_timings --rows 1,16 --repeats 500

Per weight shape [out, in] and row count: microseconds per call (median of 5 timings of
``--repeats`` calls each) and the packed / F.linear ratio. Each weight is a fresh tensor per timing
loop but small enough to stay in cache, so this measures the kernels, not DRAM; a decode step
streams its weights from memory (see eaglet.bench.roofline). Packing needs a CPU with
AMX / AVX512-BF16 (eaglet.backends.cpu_caps); elsewhere the packed column says so.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from eaglet.backends.pytorch.weights import OneDnnLinear, dense_linear, should_pack

# [out, in] of the bench model (eaglet.bench.bench_checkpoints.DEEPSEEK_FULL): q_b, o / kv_b, fused
# q_a + kv_a, expert gate+up, expert down, lm_head.
SHAPES = ((1024, 384), (512, 512), (960, 512), (512, 256), (1024, 512), (32000, 512))


def time_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(10):
        fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        runs.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    packable = should_pack(torch.bfloat16)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, packing {'on' if packable else 'unavailable'}")
    print(f"{'weight':>12} {'rows':>4} | {'F.linear bf16':>13} {'packed bf16':>11} {'ratio':>6} | {'fp32':>8}")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for out_f, in_f in SHAPES:
            for rows in (int(r) for r in args.rows.split(",")):
                w = torch.randn(out_f, in_f, generator=g).bfloat16()
                x = torch.randn(rows, in_f, generator=g).bfloat16()
                plain = time_us(lambda: F.linear(x, w), args.repeats)
                packed_text, ratio_text = "-", "-"
                if packable:
                    packed_w = OneDnnLinear(w.clone())
                    assert torch.equal(packed_w.apply(x), F.linear(x, w))
                    packed = time_us(lambda: packed_w.apply(x), args.repeats)
                    packed_text, ratio_text = f"{packed:.1f}", f"{plain / packed:.2f}"
                wf, xf = w.float(), x.float()
                fp32 = time_us(lambda: dense_linear(xf, wf), args.repeats)
                print(f"{out_f:>6}x{in_f:<5} {rows:>4} | {plain:>13.1f} {packed_text:>11} {ratio_text:>6} | {fp32:>8.1f}")


if __name__ == "__main__":
    main()
