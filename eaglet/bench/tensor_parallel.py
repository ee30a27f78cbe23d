"""``eaglet bench --tp-size N``: the same checkpoint decoded at TP=1, TP=N (each routed expert split
across the ranks) and TP=N with expert parallelism (whole experts divided), side by side in one run,
at each batch size; with rank 0's share of the step spent in collectives and whether every layout
made the same tokens."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

from eaglet import LLM
from eaglet.bench.bench_checkpoints import build_checkpoint
from eaglet.bench.bench_prompts import random_prompt_ids
from eaglet.bench.eaglet_runs import run_eaglet_steps
from eaglet.bench.machine import machine_info
from eaglet.bench.results_files import write_record
from eaglet.models.registry import load_model_config


def layouts(tp_size: int) -> dict[str, dict]:
    return {
        "tp1": {},
        f"tp{tp_size}": {"tp_size": tp_size},
        f"tp{tp_size}-ep": {"tp_size": tp_size, "ep_size": tp_size},
    }


def bench_layout(ckpt: dict, layout: dict, batch_sizes: list[int], args: argparse.Namespace) -> dict:
    llm = LLM(model=str(ckpt["target"]), dtype=ckpt["dtype"], show_progress=False, max_running_requests=64, **layout)
    vocab = load_model_config(ckpt["target"]).text.vocab_size
    engine = llm.engine
    rows = {}
    try:
        for batch in batch_sizes:
            prompts = random_prompt_ids(batch, args.prompt_len, vocab)
            run_eaglet_steps(llm, prompts, args.new_tokens)  # warm-up
            runs = []
            for _ in range(args.repeats):
                before = engine.collective_time()
                run = run_eaglet_steps(llm, prompts, args.new_tokens)
                after = engine.collective_time()
                if before is not None and after is not None:
                    run["collective_s"] = after.seconds - before.seconds
                    run["collective_calls"] = after.calls - before.calls
                runs.append(run)
            busy = [r["prefill_s"] + r["decode_s"] for r in runs]
            rows[batch] = {
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                "step_ms_median": statistics.median(r["step_ms_median"] for r in runs),
                "collective_share": statistics.median(r.get("collective_s", 0.0) / b for r, b in zip(runs, busy)),
                "collectives_per_step": statistics.median(
                    r.get("collective_calls", 0) / (r["prefill_steps"] + r["decode_steps"]) for r in runs
                ),
                "tokens": runs[0]["tokens"],
            }
    finally:
        engine.close()
    return rows


def main(args: argparse.Namespace) -> int:
    if args.tp_size < 2:
        raise SystemExit("--tp-size must be at least 2 to compare with TP=1")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    names = ["deepseek"] if args.checkpoints == "all" else [n for n in args.checkpoints.split(",") if n]
    started = time.time()
    results = []
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eaglet-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        for name in names:
            ckpt = build_checkpoint(name, workdir, args.alpha, args.size)
            by_layout = {}
            for label, layout in layouts(args.tp_size).items():
                print(f"{name} {label} ...", flush=True)
                by_layout[label] = bench_layout(ckpt, layout, batch_sizes, args)
            reference_tokens = {batch: row["tokens"] for batch, row in by_layout["tp1"].items()}
            for rows in by_layout.values():
                for batch, row in rows.items():
                    row["same_tokens_as_tp1"] = row.pop("tokens") == reference_tokens[batch]
            results.append({"checkpoint": name, "dtype": ckpt["dtype"], "layouts": by_layout})
    record = {
        "benchmark": "eaglet-bench-tp",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.time() - started,
        "machine": machine_info(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")},
        "checkpoints": results,
    }
    print_table(record)
    out = write_record(args.results_dir, "bench-tp", record)
    print(f"\nwrote {out} (total {record['wall_s']:.0f}s)")
    return 0


def print_table(record: dict) -> None:
    print(f"\n{'checkpoint':<20}{'layout':<10}{'batch':>6}{'tok/s':>10}{'vs tp1':>8}{'step ms':>9}{'comm %':>8}"
          f"{'coll/step':>10}  same tokens")
    for result in record["checkpoints"]:
        reference = result["layouts"]["tp1"]
        for label, rows in result["layouts"].items():
            for batch, row in rows.items():
                ratio = row["decode_tok_s"] / reference[batch]["decode_tok_s"]
                print(f"{result['checkpoint'] + ' ' + result['dtype']:<20}{label:<10}{batch:>6}{row['decode_tok_s']:>10.1f}"
                      f"{ratio:>7.2f}x{row['step_ms_median']:>9.2f}{100 * row['collective_share']:>7.1f}%"
                      f"{row['collectives_per_step']:>10.1f}  {row.get('same_tokens_as_tp1', True)}")
