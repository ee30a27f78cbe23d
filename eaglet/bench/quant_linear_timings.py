"""Decode-sized products with a weight larger than the last-level cache, in each stored form:
bfloat16 (F.linear, and the PyTorch backend's method for it on this CPU), int4 and FP8 through
eaglet's kernels (``int4_linear`` / ``fp8_linear``), int4 through the PyTorch fallback.

    python -m eaglet.bench.quant_linear_timings                  # [16384, 7168], rows 1, 4, 16
    python -m eaglet.bench.quant_linear_timings --shape 4096x7168 --rows 1

Per form and row count: milliseconds per call (median of 5 timings) and the weight's stored bytes
read per second (codes + scales for int4 / FP8): every call streams the whole matrix from DRAM.
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F

from eaglet import kernels
from eaglet.backends import torch_backend
from eaglet.backends.cpu.quantized_weights import KernelQuantizedLinear
from eaglet.backends.pytorch.quantized_weights import DequantizingLinear
from eaglet.backends.quantized_matrix import QuantizedMatrix, quantize_int4
from eaglet.bench.linear_timings import time_us


def fp8_of(weight: torch.Tensor) -> QuantizedMatrix:
    """e4m3 codes with one float32 scale per row per 128 columns."""
    groups = weight.float().view(weight.shape[0], -1, 128)
    scales = groups.abs().amax(-1) / 448.0
    codes = (groups / scales[..., None]).to(torch.float8_e4m3fn).view(weight.shape)
    return QuantizedMatrix("fp8", codes, scales, 128, weight.shape[1])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="16384x7168", help="out x in")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fallback", action="store_true", help="also time the PyTorch int4 fallback (slow)")
    args = parser.parse_args()
    out_f, in_f = (int(v) for v in args.shape.split("x"))
    weight = (torch.randn(out_f, in_f) * 0.02).bfloat16()
    int4, fp8 = quantize_int4(weight, args.group_size), fp8_of(weight)
    bf16_method = torch_backend().weights.linear(weight)
    forms: dict[str, tuple[int, object]] = {
        "bf16 F.linear": (weight.numel() * 2, lambda x: F.linear(x, weight)),
        "bf16 backend": (weight.numel() * 2, bf16_method.apply),
    }
    if kernels.available():
        forms["int4 kernel"] = (int4.nbytes, KernelQuantizedLinear(int4).apply)
        forms["fp8 kernel"] = (fp8.nbytes, KernelQuantizedLinear(fp8).apply)
    if args.fallback:
        forms["int4 pytorch"] = (int4.nbytes, DequantizingLinear(int4).apply)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; weight [{out_f}, {in_f}]: "
          f"bf16 {weight.numel() * 2 / 2**20:.0f} MiB, int4 g{args.group_size} {int4.nbytes / 2**20:.0f} MiB, "
          f"fp8 {fp8.nbytes / 2**20:.0f} MiB")
    print(f"{'form':>14} {'rows':>4} {'ms/call':>9} {'GB/s':>7}")
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f).bfloat16()
            for name, (nbytes, fn) in forms.items():
                us = time_us(lambda: fn(x), args.repeats)
                print(f"{name:>14} {rows:>4} {us / 1e3:>9.2f} {nbytes / us / 1e3:>7.1f}")


if __name__ == "__main__":
    main()
