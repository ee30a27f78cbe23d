"""llama.cpp's part of a checkpoint's bench: each GGUF type's decode rows at ``--llama-cpp-batch-sizes``
and prefill row at ``--prefill-len``, and the check that its float32 conversion decodes the tokens
transformers does in float32 (so both engines do the same work)."""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from eaglet.bench.llama_cpp_peer import (
    LLAMA_CPP_SETUP_HINT,
    LlamaCppError,
    decode_rows,
    gguf_file,
    greedy_ids,
    llama_cpp_source,
    llama_cpp_tool,
    prefill_tokens_per_s,
)
from eaglet.bench.results_table import row_line
from eaglet.bench.spec_shapes import parse_ints
from eaglet.bench.transformers_peer import load_transformers

# The GGUF type doing the same arithmetic on the same stored weights as eaglet: the ratio the table shows.
MATCHING_TYPE = {"float32": "f32", "bfloat16": "bf16", "int4": "q4_0"}
CHECK_TOKENS = 16
# transformers needs the whole model in float32 for the token check.
CHECK_MAX_PARAMS = 2_000_000_000


def gguf_types(args: argparse.Namespace, weight_format: str) -> list[str]:
    if args.llama_cpp_types != "auto":
        return [t for t in args.llama_cpp_types.split(",") if t]
    return {"float32": ["f32"], "bfloat16": ["bf16", "q4_0"], "int4": ["q4_0"]}[weight_format]


def check_tokens(name: str, ckpt: dict, root, prompt: list[int], params: int, threads: int) -> dict:
    """Greedy tokens of llama.cpp's f32 conversion against transformers in float32, first prompt."""
    if params > CHECK_MAX_PARAMS:
        return {"skipped": f"{params / 1e9:.1f}B parameters: too large for transformers in float32 here"}
    ours = greedy_ids(root, gguf_file(root, ckpt["target"], "f32"), prompt, CHECK_TOKENS, threads)
    model = load_transformers(ckpt["target"], torch.float32)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=CHECK_TOKENS, min_new_tokens=CHECK_TOKENS,
                             eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(prompt):].tolist()
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"[{name}] llama.cpp f32 greedy tokens vs transformers float32: {same}/{CHECK_TOKENS} equal", flush=True)
    return {"same_tokens": ours == theirs, "equal_positions": same, "tokens": CHECK_TOKENS}


def llama_cpp_rows(name: str, ckpt: dict, prompts: list[dict], args: argparse.Namespace, weight_format: str,
                   params: int, notes: list[str]) -> tuple[list[dict], dict | None]:
    """(rows, token check) for llama.cpp on this checkpoint; a note and no rows when it cannot run."""
    root = args.llama_cpp_dir
    if llama_cpp_tool(root, "llama-batched-bench") is None:
        notes.append(f"llama.cpp skipped: not built under {root}; build it with: {LLAMA_CPP_SETUP_HINT}")
        print(f"[{name}] {notes[-1]}", flush=True)
        return [], None
    threads = args.threads or os.cpu_count() or 1
    batch_sizes = parse_ints(args.llama_cpp_batch_sizes)
    rows: list[dict] = []
    check = None
    try:
        check = check_tokens(name, ckpt, root, prompts[0]["prompt_token_ids"], params, threads)
        for gguf_type in gguf_types(args, weight_format):
            gguf = gguf_file(root, ckpt["target"], gguf_type)
            print(f"[{name}] llama.cpp ({llama_cpp_source(root)}) on {gguf.name}", flush=True)
            for row in decode_rows(root, gguf, gguf_type, batch_sizes, args.prompt_len, args.new_tokens,
                                   args.repeats, threads, args.llama_cpp_timeout):
                rows.append(row)
                print(row_line(name, row), flush=True)
            if args.prefill_len:
                runs = prefill_tokens_per_s(root, gguf, args.prefill_len, args.repeats, threads, args.llama_cpp_timeout)
                tps = statistics.median(runs)
                rows.append({"engine": "llama.cpp", "mode": f"prefill-{gguf_type}", "batch": 1, "repeats": len(runs),
                             "tokens_per_s": tps, "ttft_ms": 1e3 * args.prefill_len / tps, "itl_ms": None,
                             "tokens_per_s_runs": runs, "prompt_len": args.prefill_len, "gguf": gguf.name})
                print(row_line(name, rows[-1]), flush=True)
    except LlamaCppError as exc:
        notes.append(f"llama.cpp stopped: {exc}")
        print(f"[{name}] {notes[-1]}", flush=True)
    return rows, check
