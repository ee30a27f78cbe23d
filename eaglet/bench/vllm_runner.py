"""Greedy decode timings from vLLM (CPU build), run INSIDE vLLM's own virtual environment.

``eaglet bench`` starts this script with the venv's python (tools/bench_setup_vllm.sh makes the
venv) and reads one JSON object from the last line of its stdout; everything else it prints (vLLM's
logs) goes to stderr. It imports nothing from eaglet, since that venv has its own torch.

    ~/.cache/eaglet/vllm-venv/bin/python eaglet/bench/vllm_runner.py '{"model": "/ckpt", "dtype": "float32",
        "prompts": [[5, 6, 7]], "batch_sizes": [1], "new_tokens": 16, "repeats": 3,
        "speculative": {"model": "/draft", "num_speculative_tokens": 3}}'

With ``speculative``, vLLM runs EAGLE-3 (``method: eagle3``) with that draft; each result then also
carries the accept length (bonus included) and per-position acceptance of its timed runs, from
vLLM's own ``spec_decode`` counters.

Per batch size and repeat: one ``generate`` with ``max_tokens=1`` gives the time to first token
(admission + prefill + one token), one with ``max_tokens=new_tokens`` the total; decode time =
total - TTFT, decode tokens/s = batch * (new_tokens - 1) / decode time, ITL = decode time /
(new_tokens - 1). Medians over the repeats (more of them, up to ``max_repeats``, until the timed
generates took ``min_seconds``), after one untimed warm-up per batch size.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1] if len(argv) > 1 else sys.stdin.read())
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # vLLM prints to stdout; the JSON line must be the only thing there
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 2)))
    # vLLM-CPU keeps one core for its frontend by default and binds OpenMP to the rest: on a small
    # machine that halves its threads. Measure it with every core, as eaglet and transformers run.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    new_tokens = int(spec["new_tokens"])
    dtype = spec.get("dtype", "float32")
    extra = {}
    if dtype == "float32":
        # vLLM-CPU's default MLA backend on AMX machines (AMX_MLA) packs only 16-bit weights.
        extra["attention_backend"] = "CPU_MLA"
    speculative = spec.get("speculative")
    if speculative:
        extra["speculative_config"] = {"method": "eagle3", "model": speculative["model"],
                                       "num_speculative_tokens": int(speculative["num_speculative_tokens"])}
        if "attention_backend" in extra:  # the draft's layers take their own backend, else AMX_MLA
            extra["speculative_config"]["attention_backend"] = extra["attention_backend"]
    llm = LLM(
        model=spec["model"],
        dtype=dtype,
        skip_tokenizer_init=True,
        max_model_len=int(spec.get("max_model_len", 512)),
        max_num_seqs=max(spec["batch_sizes"]),
        enforce_eager=bool(spec.get("enforce_eager", False)),
        seed=0,
        disable_log_stats=not speculative,  # the spec_decode counters need stat logging
        **extra,
    )

    def timed(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    def spec_counters() -> tuple[float, float, list[float]]:
        """(drafts, accepted tokens, accepted tokens per position) so far."""
        drafts, accepted, per_pos = 0.0, 0.0, []
        for metric in llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                drafts = float(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                accepted = float(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_pos = [float(v) for v in metric.values]
        return drafts, accepted, per_pos

    results = []
    for batch in spec["batch_sizes"]:
        prompts = spec["prompts"][:batch]
        timed(prompts, new_tokens)  # warm-up, full length (as eaglet's)
        runs = []
        tokens: list[list[int]] = []
        repeats, min_seconds = int(spec.get("repeats", 3)), float(spec.get("min_seconds", 0.0))
        max_repeats, spent = max(repeats, int(spec.get("max_repeats", repeats))), 0.0
        while len(runs) < repeats or (spent < min_seconds and len(runs) < max_repeats):
            ttft, _ = timed(prompts, 1)
            counters_before = spec_counters() if speculative else None
            total, tokens = timed(prompts, new_tokens)
            decode_s = max(total - ttft, 1e-9)
            run = {"ttft_ms": 1e3 * ttft, "total_s": total, "decode_s": decode_s,
                   "decode_tok_s": batch * (new_tokens - 1) / decode_s,
                   "itl_ms": 1e3 * decode_s / (new_tokens - 1)}
            if counters_before is not None:
                drafts0, accepted0, per_pos0 = counters_before
                drafts1, accepted1, per_pos1 = spec_counters()
                drafts = max(drafts1 - drafts0, 1.0)
                run["accept_length"] = 1.0 + (accepted1 - accepted0) / drafts
                run["per_position_acceptance"] = [
                    (b - a) / drafts for a, b in zip(per_pos0 or [0.0] * len(per_pos1), per_pos1)
                ]
            runs.append(run)
            spent += ttft + total
        result = {
            "batch": batch,
            "tokens_per_s": statistics.median(r["decode_tok_s"] for r in runs),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "itl_ms": statistics.median(r["itl_ms"] for r in runs),
            "runs": runs,
            "tokens": tokens,
        }
        if speculative:
            result["accept_length"] = statistics.median(r["accept_length"] for r in runs)
            result["per_position_acceptance"] = [
                statistics.median(r["per_position_acceptance"][k] for r in runs)
                for k in range(len(runs[0]["per_position_acceptance"]))
            ]
        results.append(result)
    import torch

    record = {"engine": "vllm", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
              "torch_threads": torch.get_num_threads(), "results": results}
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    real_stdout.write(json.dumps(record) + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
