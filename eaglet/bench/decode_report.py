"""The decode benchmark's table and the figures it derives from its runs."""

from __future__ import annotations

import argparse
import statistics


def pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def max_foreign(runs: list[dict]) -> float | None:
    vals = [r["foreign_cpu"] for r in runs if r.get("foreign_cpu") is not None]
    return max(vals) if vals else None


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def token_match(a: list[list[int]], b: list[list[int]]) -> dict:
    """Rows identical, and the mean length of the common greedy prefix (bf16 may diverge)."""
    same_rows = sum(x == y for x, y in zip(a, b))
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"identical_rows": same_rows, "rows": len(a), "mean_common_prefix": statistics.fmean(prefixes)}


def rescale_floor(res: dict, read_gbps: float) -> None:
    f = res["floor"]
    f["read_gbps"] = read_gbps
    f["mem_floor_ms"] = 1e3 * f["bytes"]["total"] / (read_gbps * 1e9)
    f["roofline_floor_ms"] = max(f["mem_floor_ms"], f["compute_floor_ms"])
    e = res["eaglet"]
    e["achieved_over_mem_floor"] = e["step_ms"] / f["mem_floor_ms"]
    e["achieved_over_roofline"] = e["step_ms"] / f["roofline_floor_ms"]


def print_table(results: list[dict], bw: dict, bw_end: dict, counts: dict, args: argparse.Namespace) -> None:
    print(f"\n=== greedy decode, {counts['total'] / 1e6:.1f}M-param DeepSeek-V3, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, median of {args.repeats} ===")
    print(f"read bandwidth {bw['read_gbps']:.1f} GB/s (start) / {bw_end['read_gbps']:.1f} GB/s (end); "
          f"floors use the higher, {max(bw['read_gbps'], bw_end['read_gbps']):.1f} GB/s")
    hdr = (f"{'dtype':<9}{'B':>3} | {'eaglet tok/s':>12} {'HF tok/s':>9} {'ratio':>6} | {'step ms':>8} "
           f"{'HF ms':>7} | {'MB/step':>8} {'mem flr':>8} {'cmp flr':>8} {'ach/mem':>8} {'ach/roof':>8} | "
           f"{'experts':>7} {'prefill e/HF ms':>16} {'match':>7} {'busy':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        e, f = r["eaglet"], r["floor"]
        h = r.get("transformers")
        m = r.get("token_match")
        print(
            f"{r['dtype']:<9}{r['batch']:>3} | {e['decode_tok_s']:>12.1f} "
            f"{(h['decode_tok_s'] if h else float('nan')):>9.1f} {r.get('ratio_eaglet_over_transformers', float('nan')):>6.2f} | "
            f"{e['step_ms']:>8.2f} {(h['step_ms'] if h else float('nan')):>7.2f} | "
            f"{f['bytes']['total'] / 1e6:>8.1f} {f['mem_floor_ms']:>8.2f} {f['compute_floor_ms']:>8.2f} "
            f"{e['achieved_over_mem_floor']:>8.2f} {e['achieved_over_roofline']:>8.2f} | "
            f"{f['mean_distinct_experts_per_moe_layer']:>7.2f} "
            f"{e['prefill_ms']:>7.1f}/{(h['prefill_ms'] if h else float('nan')):<8.1f} "
            f"{(str(m['identical_rows']) + '/' + str(m['rows'])) if m else '-':>7} "
            f"{pct(r['max_foreign_cpu']):>5}"
        )
    print("\ncolumns: ratio = eaglet/transformers decode tok/s; step ms = mean decode step; MB/step = bytes a "
          "step must read (embedding rows, all non-expert weights, distinct active experts, KV cache at the mean "
          "length); mem flr = MB/step / read bandwidth; cmp flr = FLOPs / measured GEMM rate; ach/mem = step ms / "
          "mem flr; ach/roof = step ms / max(mem flr, cmp flr); experts = mean distinct routed experts per MoE layer "
          "per step; match = rows whose greedy tokens are identical between the engines; busy = most CPU other "
          "processes used during any timed run of that row (share of all cores; > ~10% means a noisy number)")
    print("goals: batch 1 ach/mem <= 1.25; ratio >= 1.5 at batch 1, >= 5 at batch 16")
    for r in results:
        goals = []
        if r["batch"] == 1:
            goals.append(f"ach/mem {r['eaglet']['achieved_over_mem_floor']:.2f} "
                         f"{'OK' if r['eaglet']['achieved_over_mem_floor'] <= 1.25 else 'MISS'} (<=1.25)")
        target = 1.5 if r["batch"] == 1 else 5.0 if r["batch"] >= 16 else None
        if target is not None and "ratio_eaglet_over_transformers" in r:
            ratio = r["ratio_eaglet_over_transformers"]
            goals.append(f"ratio {ratio:.2f} {'OK' if ratio >= target else 'MISS'} (>={target})")
        if goals:
            print(f"  {r['dtype']} B={r['batch']}: " + "; ".join(goals))
