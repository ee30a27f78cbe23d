"""llama.cpp's part of a checkpoint's bench: each GGUF type's decode rows at ``--llama-cpp-batch-sizes``
and prefill row at ``--prefill-len``, and the check that its float32 conversion decodes the tokens
transformers does in float32 (so both engines do the same work)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eaglet.bench.llama_cpp_peer import (
    GGUF_TYPES,
    LLAMA_CPP_SETUP_HINT,
    LlamaCppError,
    decode_rows,
    gguf_file,
    gguf_path,
    greedy_ids,
    llama_cpp_source,
    llama_cpp_tool,
    prefill_runs,
)
from eaglet.bench.results_table import row_line
from eaglet.bench.row_summary import prefill_row
from eaglet.bench.spec_shapes import parse_ints
from eaglet.bench.transformers_peer import load_transformers, run_transformers

# The GGUF type doing the same arithmetic on the same stored weights as eaglet: the ratio the table
# shows. Q4_0 is int4 in groups of 32 with an fp16 scale: Kimi-K2.5's int4 up to the scale's rounding.
MATCHING_TYPE = {"float32": "f32", "bfloat16": "bf16", "int4": "q4_0-experts"}
AUTO_TYPES = {"float32": ["f32"], "bfloat16": ["bf16", "q4_0"], "int4": ["q4_0-experts", "q4_0"]}
CHECK_TOKENS = 16
# transformers needs the whole model in float32 for the token check.
CHECK_MAX_PARAMS = 2_000_000_000


def gguf_types(spec: str, weight_format: str) -> list[str]:
    """``--llama-cpp-types`` for a checkpoint of ``weight_format``; unknown names stop the run."""
    types = AUTO_TYPES[weight_format] if spec == "auto" else [t for t in spec.split(",") if t]
    unknown = [t for t in types if t not in GGUF_TYPES]
    if unknown:
        raise SystemExit(f"--llama-cpp-types: unknown {', '.join(unknown)}; choose from auto, {', '.join(GGUF_TYPES)}")
    return types


def check_tokens(name: str, ckpt: dict, root: Path, prompt: list[int], params: int, threads: int) -> dict:
    """Greedy tokens of llama.cpp's f32 conversion against transformers in float32, first prompt."""
    if params > CHECK_MAX_PARAMS:
        return {"skipped": f"{params / 1e9:.1f}B parameters: too large for transformers in float32 here"}
    ours = greedy_ids(root, gguf_file(root, ckpt["target"], "f32"), prompt, CHECK_TOKENS, threads)
    theirs = run_transformers(load_transformers(ckpt["target"], torch.float32), [prompt], CHECK_TOKENS)["tokens"][0]
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
    threads = torch.get_num_threads()  # what eaglet ran with
    batch_sizes = parse_ints(args.llama_cpp_batch_sizes)
    types = gguf_types(args.llama_cpp_types, weight_format)
    bf16 = gguf_path(ckpt["target"], "bf16")
    bf16_kept = bf16.is_file() or "bf16" in types
    rows: list[dict] = []
    check = None
    try:
        check = check_tokens(name, ckpt, root, prompts[0]["prompt_token_ids"], params, threads)
        for gguf_type in types:
            gguf = gguf_file(root, ckpt["target"], gguf_type)
            print(f"[{name}] llama.cpp ({llama_cpp_source(root)}) on {gguf.name}", flush=True)
            for row in decode_rows(root, gguf, gguf_type, batch_sizes, args.prompt_len, args.new_tokens,
                                   args.repeats, threads, args.llama_cpp_timeout):
                rows.append(row)
                print(row_line(name, row), flush=True)
            if args.prefill_len:
                runs = prefill_runs(root, gguf, args.prefill_len, args.repeats, threads, args.llama_cpp_timeout)
                rows.append(prefill_row("llama.cpp", f"prefill-{gguf_type}", args.prefill_len, runs, gguf=gguf.name))
                print(row_line(name, rows[-1]), flush=True)
    except Exception as exc:  # a peer that fails must not lose eaglet's figures: the run goes on
        notes.append(f"llama.cpp stopped: {type(exc).__name__}: {exc}")
        print(f"[{name}] {notes[-1]}", flush=True)
    finally:
        if not bf16_kept:
            bf16.unlink(missing_ok=True)
    return rows, check
