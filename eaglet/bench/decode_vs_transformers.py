"""Target-only greedy decode benchmark: eaglet vs transformers ``generate`` on one random checkpoint.

    python -m eaglet.bench.decode_vs_transformers                      # batch 1 and 16, float32 and bfloat16
    python -m eaglet.bench.decode_vs_transformers --batch-sizes 1 --dtypes float32 --repeats 5
    python -m eaglet.bench.decode_vs_transformers --skip-transformers --workdir /tmp/eaglet-bench

What it does, in one process:

1. Measures the machine's memory read bandwidth (``sum`` of a 1 GiB float32 buffer, all torch
   threads, median of several runs; a copy is reported too) and a GEMM throughput per dtype.
2. Writes (or reuses, with ``--workdir``) a random DeepSeek-V3 checkpoint of about 70M parameters
   in the published layout (``eaglet.testing.checkpoints``) and prints its exact parameter count.
3. For every dtype and batch size, decodes ``--new-tokens`` tokens greedily from the same
   ``--prompt-len`` random prompts (one distinct prompt per request) with eaglet and with
   transformers, interleaved, ``--repeats`` times each, and reports medians.

How prefill is excluded (the same way for both engines):

* eaglet: the script drives ``llm.engine.step()`` itself (what ``LLM.generate`` loops over). The
  steps until every request holds its first token (admission + prefill; one step here) are the
  prefill; each following step is one decode step producing one token per request. Decode time =
  sum of those steps.
* transformers: a ``StoppingCriteria`` records ``time.perf_counter()`` each time it is called, i.e.
  once per generated token, after that token was chosen. The first call comes right after the
  prefill forward; decode time = last call - first call.

Decode tokens/s = batch * (new_tokens - 1) / decode time.

The memory-bandwidth floor of one decode step is the bytes a step must read at least, divided by
the measured read bandwidth: the embedding rows of the batch, every attention / dense / shared
expert / router / norm weight, lm_head, for every MoE layer only the DISTINCT routed experts active
in that step (counted from eaglet's router choices during the first timed run: a wrapper around
``eaglet.layers.moe.RoutedExperts.forward``, in this process only, keeps a copy of each call's
expert ids and the distinct ones are counted afterwards), plus the latent KV cache of every
request at the mean decode length. A compute floor (FLOPs / measured GEMM throughput) is printed
beside it; the roofline floor is the larger of the two.

Results go to stdout as a table and to ``<--results-dir>/decode-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eaglet.bench.bench_checkpoints import DEEPSEEK_FULL, checkpoint_param_counts, random_deepseek_checkpoint
from eaglet.bench.bench_prompts import random_prompt_ids
from eaglet.bench.cpu_load import ForeignCPU, loadavg, wait_for_idle
from eaglet.bench.decode_report import max_foreign, med, pct, print_table, rescale_floor, token_match
from eaglet.bench.eaglet_runs import run_eaglet_steps
from eaglet.bench.machine import machine_info
from eaglet.bench.machine_rates import measure_bandwidth, measure_gemm
from eaglet.bench.results_files import write_record
from eaglet.bench.roofline import ExpertCounter, step_floor
from eaglet.bench.settings import DEFAULT_RESULTS_DIR
from eaglet.bench.transformers_peer import load_transformers, run_transformers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_bandwidth(args: argparse.Namespace, runs: int = 7) -> dict:
    """measure_bandwidth, redone (up to --retries times) when other processes were busy."""
    for attempt in range(args.retries + 1):
        if args.wait_idle or attempt:
            wait_for_idle(args.wait_idle or 30.0, window_s=1.0)
        with ForeignCPU() as f:
            bw = measure_bandwidth(args.bandwidth_gib, runs)
        bw["foreign_cpu"] = f.fraction
        if f.fraction is None or f.fraction <= args.max_foreign:
            break
    return bw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64,
                    help="tokens generated per request (default 64: 128 makes a default run ~17+ min here, "
                    "bf16 batch 16 being ~4x slower than fp32 on an AVX2-only CPU)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None, help="cache the checkpoint here (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                    help="before each repeat, wait up to S seconds for other processes to go below 15%% CPU")
    ap.add_argument("--max-foreign", type=float, default=0.10, metavar="F",
                    help="redo a timed run during which other processes used more than F of all CPUs")
    ap.add_argument("--retries", type=int, default=2, help="redos per timed run when it was noisy")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0)
    ap.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR)
    args = ap.parse_args(argv)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    dtype_names = [x for x in args.dtypes.split(",") if x]
    for d in dtype_names:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (one prefill token + at least one decode step)")
    if args.threads:
        torch.set_num_threads(args.threads)

    from eaglet import LLM

    started = time.time()
    info = machine_info()
    info["loadavg_start"] = loadavg()
    print(f"cpu: {info['cpu_model']} | {info['logical_cpus']} logical cpus | torch {info['torch_version']} "
          f"({info['torch_threads']} threads, {info['cpu_capability']}) | transformers {info['transformers_version']}")
    print(f"load average at start: {info['loadavg_start']}")
    bw = quiet_bandwidth(args)
    print(f"memory bandwidth: read (sum) {bw['read_gbps']:.1f} GB/s, copy (r+w) {bw['copy_gbps']:.1f} GB/s "
          f"(median of {len(bw['read_runs'])}, {args.bandwidth_gib} GiB buffer)")
    gemm = {d: measure_gemm(DTYPES[d]) for d in dtype_names}
    print("GEMM 256x1024x1024: " + ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in gemm.items()))

    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="eaglet-bench-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    try:
        path = random_deepseek_checkpoint(workdir)
        counts = checkpoint_param_counts(path)
        print(f"checkpoint: {counts['total']:,} parameters ({counts['total'] / 1e6:.2f}M): "
              + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in counts.items() if k != "total"))
        print("config: " + ", ".join(f"{k}={v}" for k, v in DEEPSEEK_FULL.items()))
        prompts_all = random_prompt_ids(max(batch_sizes), args.prompt_len, DEEPSEEK_FULL["vocab_size"])
        mean_seq_len = args.prompt_len + args.new_tokens / 2  # decode step k reads prompt_len + k tokens

        results = []
        for dname in dtype_names:
            dtype = DTYPES[dname]
            t = time.perf_counter()
            llm = LLM(model=str(path), dtype=dname, show_progress=False)
            print(f"\n[{dname}] eaglet loaded in {time.perf_counter() - t:.1f}s", flush=True)
            hf = None
            if not args.skip_transformers:
                t = time.perf_counter()
                hf = load_transformers(path, dtype)
                print(f"[{dname}] transformers loaded in {time.perf_counter() - t:.1f}s", flush=True)
            for batch in batch_sizes:
                prompts = prompts_all[:batch]
                # untimed warm-up of both engines (allocator, oneDNN/MKL kernels, first-call paths)
                run_eaglet_steps(llm, prompts, min(8, args.new_tokens))
                if hf is not None:
                    run_transformers(hf, prompts, min(8, args.new_tokens))
                e_runs, h_runs = [], []
                load_before = loadavg()
                discarded = 0

                def measure(fn: Callable[[], dict]) -> dict:
                    # The machine may be shared: a run during which other processes used more than
                    # --max-foreign of the CPUs is thrown away and redone (after waiting for quiet).
                    nonlocal discarded
                    for attempt in range(args.retries + 1):
                        if args.wait_idle or attempt:
                            wait_for_idle(args.wait_idle or 30.0, window_s=1.0)
                        run = fn()
                        noisy = run["foreign_cpu"] is not None and run["foreign_cpu"] > args.max_foreign
                        if not noisy or attempt == args.retries:
                            run["attempts"] = attempt + 1
                            run["noisy"] = noisy
                            return run
                        discarded += 1
                        print(f"  (discarded a run: other processes used {pct(run['foreign_cpu'])} of the CPUs)", flush=True)

                counter = ExpertCounter(llm.engine.model)
                with counter:  # an untimed run: the router's choices give the distinct experts
                    run_eaglet_steps(llm, prompts, args.new_tokens, counter)
                distinct = counter.mean_distinct()
                for r in range(args.repeats):
                    e_runs.append(measure(lambda: run_eaglet_steps(llm, prompts, args.new_tokens)))
                    msg = (f"[{dname} B={batch}] repeat {r + 1}: eaglet {e_runs[-1]['decode_tok_s']:.1f} tok/s"
                           f" (other processes {pct(e_runs[-1]['foreign_cpu'])} CPU)")
                    if hf is not None:
                        h_runs.append(measure(lambda: run_transformers(hf, prompts, args.new_tokens)))
                        msg += (f", transformers {h_runs[-1]['decode_tok_s']:.1f} tok/s"
                                f" (other processes {pct(h_runs[-1]['foreign_cpu'])} CPU)"
                                f", ratio {e_runs[-1]['decode_tok_s'] / h_runs[-1]['decode_tok_s']:.2f}")
                    print(msg, flush=True)
                floor = step_floor(llm.engine.model, llm.engine.model_config.text, dtype, batch, mean_seq_len,
                                   distinct, bw["read_gbps"], gemm[dname])
                res = {
                    "dtype": dname,
                    "batch": batch,
                    "loadavg_before": load_before,
                    "loadavg_after": loadavg(),
                    "eaglet": {
                        "decode_tok_s": med(e_runs, "decode_tok_s"),
                        "step_ms": med(e_runs, "step_ms_mean"),
                        "step_ms_median_step": med(e_runs, "step_ms_median"),
                        "prefill_ms": 1e3 * med(e_runs, "prefill_s"),
                        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in e_runs],
                    },
                    "floor": floor,
                    "distinct_experts_per_layer": distinct,
                    "max_foreign_cpu": max_foreign(e_runs + h_runs),
                    "discarded_noisy_runs": discarded,
                }
                res["eaglet"]["achieved_over_mem_floor"] = res["eaglet"]["step_ms"] / floor["mem_floor_ms"]
                res["eaglet"]["achieved_over_roofline"] = res["eaglet"]["step_ms"] / floor["roofline_floor_ms"]
                if h_runs:
                    res["transformers"] = {
                        "decode_tok_s": med(h_runs, "decode_tok_s"),
                        "step_ms": med(h_runs, "step_ms_mean"),
                        "step_ms_median_step": med(h_runs, "step_ms_median"),
                        "prefill_ms": 1e3 * med(h_runs, "prefill_s"),
                        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in h_runs],
                    }
                    ratios = [e["decode_tok_s"] / h["decode_tok_s"] for e, h in zip(e_runs, h_runs)]
                    res["ratio_eaglet_over_transformers"] = res["eaglet"]["decode_tok_s"] / res["transformers"]["decode_tok_s"]
                    res["ratio_per_repeat"] = ratios
                    res["token_match"] = token_match(e_runs[0]["tokens"], h_runs[0]["tokens"])
                results.append(res)
            del llm, hf
            gc.collect()
    finally:
        if tmp is not None:
            tmp.cleanup()

    info["loadavg_end"] = loadavg()
    bw_end = quiet_bandwidth(args, runs=5)
    # Contention can only lower a bandwidth measurement: the floors use the higher of the two medians.
    read_gbps = max(bw["read_gbps"], bw_end["read_gbps"])
    for res in results:
        rescale_floor(res, read_gbps)
    print_table(results, bw, bw_end, counts, args)
    report = {
        "benchmark": "decode",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.time() - started,
        "machine": info,
        "bandwidth": bw,
        "bandwidth_end": bw_end,
        "gemm_gflops": gemm,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_config": DEEPSEEK_FULL,
        "param_counts": counts,
        "timing_method": "eaglet: llm.engine.step() timed per step, first step (admit+prefill+1st token) "
                         "excluded; transformers: StoppingCriteria timestamps, last - first",
        "results": results,
    }
    out = write_record(args.results_dir, "decode", report)
    print(f"\nwrote {out} (total {report['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
