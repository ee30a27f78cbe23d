"""llama.cpp as a peer: its own tools (built by tools/bench_setup_llama_cpp.sh from the llama.cpp
that the ``llama-cpp-python`` source package vendors) on the bench checkpoint converted to GGUF by
its own converter (eaglet.bench.gguf_convert), quantized by its own ``llama-quantize``.

- decode: ``llama-batched-bench`` with the bench's prompt length, new tokens and batch sizes; its
  ``speed_tg`` (batch x new tokens / decode time) is the figure eaglet's tokens/s is measured as;
- prefill: ``llama-bench -p N -n 0`` (prompt tokens/s);
- tokens: ``llama-greedy-ids`` (tools/llama_cpp_greedy.cpp) decodes the bench's first prompt ids
  greedily, for the check against transformers in float32.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

LLAMA_CPP_SETUP_HINT = ("bash tools/bench_setup_llama_cpp.sh  (builds llama.cpp's tools into "
                        "~/.cache/eaglet/llama.cpp, 6-20 min on 2 cores)")
DEFAULT_LLAMA_CPP_DIR = Path(os.environ.get("EAGLET_LLAMA_CPP_DIR", Path.home() / ".cache" / "eaglet" / "llama.cpp"))
# Written by the converter itself; the other types are made from bf16 by llama-quantize's arguments.
CONVERTER_TYPES = ("f32", "bf16", "f16", "q8_0")
QUANTIZE_TYPES = {
    "q4_0": ["Q4_0"],
    "q4_k": ["Q4_K_M"],
    # Routed experts Q4_0, everything else bf16: what an int4 compressed-tensors checkpoint stores.
    # llama-quantize applies per-tensor types only under a quantized base type, so the base is Q4_0
    # (--pure: no per-layer mixture) and attention, shared experts, dense MLPs and the two
    # vocabulary matrices are named back to bf16.
    "q4_0-experts": ["--pure", "--token-embedding-type", "bf16", "--output-tensor-type", "bf16",
                     "--tensor-type", "attn_=bf16", "--tensor-type", "shexp=bf16",
                     "--tensor-type", r"ffn_(gate|up|down)\.weight=bf16", "Q4_0"],
}
GGUF_TYPES = CONVERTER_TYPES + tuple(QUANTIZE_TYPES)
# Weights read into memory, not mapped: every timed run then reads what eaglet's warmed-up engine
# reads, with no page faults on experts a short warm-up never touched.
NO_MMAP = ["-lm", "none"]


class LlamaCppError(RuntimeError):
    pass


def llama_cpp_tool(root: Path, name: str) -> Path | None:
    tool = root / "build" / "bin" / name
    return tool if tool.is_file() else None


def llama_cpp_source(root: Path) -> str | None:
    marker = root / "src" / "EAGLET_SOURCE"
    return marker.read_text().strip() if marker.is_file() else None


def _run(cmd: list[str], timeout: float) -> str:
    try:
        # Tools print tensor names and model metadata as they are, not always valid UTF-8.
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"{Path(cmd[0]).name} exceeded {timeout:.0f}s") from None
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
        raise LlamaCppError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}): {tail}")
    return proc.stdout


def gguf_file(root: Path, checkpoint: Path, gguf_type: str, timeout: float = 7200.0) -> Path:
    """``<checkpoint>.<gguf_type>.gguf`` beside the checkpoint, made once (a quantized type from the
    bf16 conversion, which stays: the caller removes it when nobody asked for it)."""
    out = gguf_path(checkpoint, gguf_type)
    if out.is_file():
        return out
    partial = out.with_name(out.name + ".partial")
    try:
        if gguf_type in CONVERTER_TYPES:
            _run([sys.executable, "-m", "eaglet.bench.gguf_convert", str(root / "src"), str(checkpoint),
                  "--outtype", gguf_type, "--outfile", str(partial)], timeout)
        elif gguf_type in QUANTIZE_TYPES:
            quantize = llama_cpp_tool(root, "llama-quantize")
            if quantize is None:
                raise LlamaCppError(f"no llama-quantize under {root}; build it with: {LLAMA_CPP_SETUP_HINT}")
            source = gguf_file(root, checkpoint, "bf16", timeout)
            *options, ftype = QUANTIZE_TYPES[gguf_type]
            _run([str(quantize), *options, str(source), str(partial), ftype, str(os.cpu_count() or 1)], timeout)
        else:
            raise LlamaCppError(f"unknown GGUF type {gguf_type!r}; choose from {', '.join(GGUF_TYPES)}")
        partial.rename(out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def gguf_path(checkpoint: Path, gguf_type: str) -> Path:
    return checkpoint.with_name(f"{checkpoint.name}.{gguf_type}.gguf")


def greedy_ids(root: Path, gguf: Path, prompt_ids: list[int], new_tokens: int, threads: int) -> list[int]:
    tool = llama_cpp_tool(root, "llama-greedy-ids")
    if tool is None:
        raise LlamaCppError(f"no llama-greedy-ids under {root}; build it with: {LLAMA_CPP_SETUP_HINT}")
    out = _run([str(tool), "-m", str(gguf), "-n", str(new_tokens), "-t", str(threads),
                ",".join(map(str, prompt_ids))], timeout=600)
    try:
        return [int(t) for t in out.strip().splitlines()[-1].split(",")]
    except (IndexError, ValueError):
        raise LlamaCppError(f"llama-greedy-ids printed no token ids: {out[-200:]!r}") from None


def decode_rows(root: Path, gguf: Path, gguf_type: str, batch_sizes: list[int], prompt_len: int,
                new_tokens: int, repeats: int, threads: int, timeout: float) -> list[dict]:
    """One row per batch size: medians of ``repeats`` llama-batched-bench runs, interleaved."""
    tool = llama_cpp_tool(root, "llama-batched-bench")
    if tool is None:
        raise LlamaCppError(f"no llama-batched-bench under {root}; build it with: {LLAMA_CPP_SETUP_HINT}")
    # batched-bench skips a batch whose sequences do not fit the context (it rounds it up to 256).
    ctx = (prompt_len + new_tokens) * max(batch_sizes) + 256
    cmd = [str(tool), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len),
           "-ntg", str(new_tokens), "-npl", ",".join(map(str, batch_sizes)), "-t", str(threads),
           "-tb", str(threads), "--output-format", "jsonl", *NO_MMAP]
    runs: dict[int, list[dict]] = {b: [] for b in batch_sizes}
    for _ in range(repeats):
        for line in _run(cmd, timeout).splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                runs[record["pl"]].append(record)
    rows = []
    for batch, records in runs.items():
        if not records:
            raise LlamaCppError(f"llama-batched-bench reported nothing for batch {batch}")
        t_tg = statistics.median(r["t_tg"] for r in records)
        rows.append({"engine": "llama.cpp", "mode": gguf_type, "batch": batch, "repeats": len(records),
                     "tokens_per_s": statistics.median(r["speed_tg"] for r in records),
                     "ttft_ms": 1e3 * statistics.median(r["t_pp"] for r in records),
                     "itl_ms": 1e3 * t_tg / new_tokens,
                     "tokens_per_s_runs": [r["speed_tg"] for r in records], "gguf": gguf.name})
    return rows


def prefill_runs(root: Path, gguf: Path, prompt_len: int, repeats: int, threads: int, timeout: float) -> list[float]:
    """Prompt tokens/s of ``llama-bench -p prompt_len -n 0``, one figure per repetition."""
    tool = llama_cpp_tool(root, "llama-bench")
    if tool is None:
        raise LlamaCppError(f"no llama-bench under {root}; build it with: {LLAMA_CPP_SETUP_HINT}")
    out = _run([str(tool), "-m", str(gguf), "-p", str(prompt_len), "-n", "0", "-r", str(repeats),
                "-t", str(threads), "-o", "json", *NO_MMAP], timeout)
    try:
        return [float(ts) for ts in json.loads(out)[0]["samples_ts"]]
    except (json.JSONDecodeError, IndexError, KeyError) as exc:
        raise LlamaCppError(f"llama-bench output not understood ({exc!r}): {out[-200:]!r}") from None

