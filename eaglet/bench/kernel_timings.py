"""eaglet's fused CPU kernels (eaglet/kernels) against the PyTorch ops they replace, in one process.

    python -m eaglet.bench.kernel_timings [--reps 30]

Per op and shape: median microseconds of each and the ratio PyTorch / kernel (above 1: the kernel
is faster), with the largest difference between the two outputs. Shapes: the bench's 72M
DeepSeek-V3 (hidden 512, 8 heads, 8 experts of 256) and the 0.55B one (hidden 2048, 16 heads,
8 experts of 768), at decode (T = batch) and verify (T = batch x 5) token counts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from eaglet import kernels
from eaglet.backends import cpu_backend, torch_backend
from eaglet.backends.cpu.mla_attention import CpuMLAAttention
from eaglet.backends.pytorch.mla_attention import TorchMLAAttention
from eaglet.layers.norms import RMSNorm
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.runtime.kv_cache import KVCacheManager


def median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def report(name: str, torch_fn: Callable[[], torch.Tensor], kernel_fn: Callable[[], torch.Tensor], reps: int) -> None:
    diff = (torch_fn().float() - kernel_fn().float()).abs().max().item()
    t_torch, t_kernel = median_us(torch_fn, reps), median_us(kernel_fn, reps)
    print(f"{name:44s} pytorch {t_torch:9.1f} us   kernel {t_kernel:9.1f} us   x{t_torch / t_kernel:5.2f}   max diff {diff:.1e}")


def bench_rms_norm(reps: int) -> None:
    for hidden, tokens in [(512, 1), (512, 16), (2048, 80)]:
        norm = RMSNorm(hidden, 1e-6, torch_backend().layers).bfloat16()
        norm.weight.data.normal_()
        x = torch.randn(tokens, hidden).bfloat16()
        fused = RMSNorm(hidden, 1e-6, cpu_backend().layers).bfloat16()
        fused.weight.data.copy_(norm.weight)
        report(f"rms_norm hidden {hidden} T {tokens}", lambda: norm(x), lambda: fused(x), reps)


def bench_linear(reps: int) -> None:
    for out_features, in_features in [(960, 512), (512, 256), (32000, 512), (2304, 2048)]:
        weight = (torch.randn(out_features, in_features) / in_features**0.5).bfloat16()
        reference, tiled = torch_backend().weights.linear(weight), cpu_backend().weights.linear(weight)
        for rows in [1, 16, 80, 512]:
            x = torch.randn(rows, in_features).bfloat16()
            report(f"linear {out_features}x{in_features} rows {rows}", lambda: reference.apply(x), lambda: tiled.apply(x), reps)


def bench_experts(reps: int) -> None:
    for num_experts, hidden, inter in [(8, 512, 256), (8, 2048, 768)]:
        w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).bfloat16()
        w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).bfloat16()
        reference, tiled = torch_backend().weights.experts(w13, w2), cpu_backend().weights.experts(w13, w2)
        for tokens in [1, 4, 16, 80, 320]:
            x = torch.randn(tokens, hidden).bfloat16()
            ids = torch.stack([torch.randperm(num_experts)[:2] for _ in range(tokens)])
            weights = torch.rand(tokens, 2)
            report(f"routed experts {num_experts}x{hidden}x{inter} T {tokens}", lambda: reference.apply(x, weights, ids),
                   lambda: tiled.apply(x, weights, ids), reps)


class _Layer:
    def __init__(self, heads: int) -> None:
        self.layer_id, self.num_heads, self.kv_lora_rank = 0, heads, 512
        self.qk_nope_head_dim = self.qk_rope_head_dim = self.v_head_dim = 64
        self.w_uk = torch.randn(heads, 64, 512) / 8
        self.w_uv_t = torch.randn(heads, 512, 64) / 20
        self.scaling = 128**-0.5
        self.absorbed_projections: tuple[torch.Tensor, ...] = ()


def bench_attention(reps: int) -> None:
    for heads, batch, new, prefix in [(8, 1, 1, 100), (8, 1, 5, 100), (8, 16, 1, 100), (8, 16, 5, 100),
                                      (8, 64, 1, 150), (16, 16, 1, 300)]:
        cache = KVCacheManager(num_layers=1, kv_cache_dim=576, num_blocks=batch * (prefix + new) // 16 + batch + 2,
                               block_size=16, max_requests=batch, max_context_len=prefix + new + 16, dtype=torch.bfloat16,
                               ops=cpu_backend().cache)
        cache.target.kv.normal_()
        rows = [cache.alloc_row() for _ in range(batch)]
        slots = torch.cat([cache.grow(r, prefix + new)[-new:] for r in rows])
        forward_batch = ForwardBatch.build(
            input_ids=[0] * (batch * new), req_pool_indices=rows, extend_prefix_lens=[prefix] * batch,
            extend_seq_lens=[new] * batch, out_cache_loc=slots, mode=ForwardMode.DECODE if new == 1 else ForwardMode.VERIFY,
        )
        layer = _Layer(heads)
        q_nope = torch.randn(batch * new, heads, 64).bfloat16()
        q_pe = torch.randn(batch * new, heads, 64).bfloat16()
        reference, fused = TorchMLAAttention(cache), CpuMLAAttention(cache)
        report(f"mla attention H {heads} B {batch} n {new} keys {prefix + new}",
               lambda: reference._absorbed(layer, q_nope, q_pe, forward_batch),
               lambda: fused._absorbed(layer, q_nope, q_pe, forward_batch), reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if not kernels.available():
        print(f"eaglet CPU kernels unavailable: {kernels.unavailable_reason()}")
        return 1
    with torch.no_grad():  # not inference_mode: packed weights track their version
        bench_rms_norm(args.reps)
        backend = kernels.tile_backend()
        if backend is not None:
            print(f"tile-layout kernels on {backend}")
            bench_linear(args.reps)
            bench_experts(args.reps)
        else:
            print("amx_linear / routed experts: this build has no tile GEMM (AMX, AVX512-BF16 or AVX2), the kernels are not used")
        bench_attention(args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
