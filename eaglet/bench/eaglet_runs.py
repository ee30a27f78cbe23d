"""eaglet under the bench: an LLM per mode, and timed runs driving ``engine.step()`` (what
``LLM.generate`` loops over) so that prefill and decoding are timed apart."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import fields
from typing import TYPE_CHECKING

from eaglet import LLM, SamplingParams
from eaglet.bench.cpu_load import ForeignCPU
from eaglet.bench.spec_shapes import SPEC_SHAPES, Shape

if TYPE_CHECKING:
    from eaglet.bench.roofline import ExpertCounter


def load_eaglet(ckpt: dict, mode: str, adaptive: bool, shape: Shape | None = None) -> LLM:
    """An LLM for ``mode``; speculative modes draft a fixed shape unless ``adaptive`` (always for
    the ``adaptive`` and ``adaptive-tree`` modes)."""
    from eaglet.engine.engine import EngineConfig

    kwargs: dict = {"dtype": ckpt["dtype"], "show_progress": False, "max_running_requests": 64}
    if ckpt.get("activation_quantization"):
        kwargs["activation_quantization"] = ckpt["activation_quantization"]
    if ckpt.get("quantized_layers") == "all":
        kwargs.update(quantization="int4", quantized_layers="all")
    if mode != "plain":
        steps, topk, draft_tokens = shape or SPEC_SHAPES[mode]
        kwargs.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(ckpt["draft"]),
                      speculative_num_steps=steps, speculative_eagle_topk=topk,
                      speculative_num_draft_tokens=draft_tokens)
        if "speculative_adaptive" in {f.name for f in fields(EngineConfig)}:
            kwargs["speculative_adaptive"] = adaptive or mode.startswith("adaptive")
    return LLM(model=str(ckpt["target"]), **kwargs)


def run_eaglet(llm: LLM, prompts: list, new_tokens: int, ignore_eos: bool = True) -> dict:
    """Drives engine.step(); TTFT = until every request holds a token, decode = the steps after.
    With ``ignore_eos`` every request makes ``new_tokens`` (the echo checkpoints); without (the
    demo), each stops at its end of turn, and tokens/s counts the tokens actually made."""
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


def prefill_tokens_per_s(llm: LLM, prompt_ids: list[int]) -> float:
    """Prompt tokens/s of one prompt to its first token; the caller passes a prompt the prefix
    cache has not seen."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    gc.collect()
    start = time.perf_counter()
    llm.engine.add_request({"prompt_token_ids": prompt_ids}, params)
    while llm.engine.has_unfinished():
        llm.engine.step(stream_text=False)
    return len(prompt_ids) / (time.perf_counter() - start)


def run_eaglet_steps(llm: LLM, prompts: list[list[int]], new_tokens: int, counter: ExpertCounter | None = None) -> dict:
    """Drives llm.engine.step() (what LLM.generate loops over) and times every step.

    The prefill phase is every step until each request holds its first output token (one step
    unless the scheduler chunks the prompts); the decode phase is every step after that, and its
    tokens are counted as produced (batch * (new_tokens - 1) when all prefills finish together).
    """
    engine = llm.engine
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    if counter is not None:
        counter.reset()
    reqs = [engine.requests[i] for i in ids]
    gc.collect()
    finished = []
    foreign = ForeignCPU().__enter__()
    t = time.perf_counter()
    prefill_steps = 0
    while engine.has_unfinished() and not all(r.output_token_ids for r in reqs):
        finished += engine.step(stream_text=False)  # admission + prefill (+ first token)
        prefill_steps += 1
    prefill_s = time.perf_counter() - t
    tokens_after_prefill = sum(len(r.output_token_ids) for r in reqs)
    if counter is not None:
        counter.decode = True
    steps: list[float] = []
    while engine.has_unfinished():
        t = time.perf_counter()
        finished += engine.step(stream_text=False)
        steps.append(time.perf_counter() - t)
    foreign.__exit__()
    if counter is not None:
        counter.decode = False
    by_id = {o.request_id: o.token_ids for o in finished}
    tokens = [by_id[i] for i in ids]
    assert all(len(t) == new_tokens for t in tokens), "eaglet stopped early"
    decode_tokens = len(prompts) * new_tokens - tokens_after_prefill
    decode_s = sum(steps)
    return {
        "prefill_s": prefill_s,
        "prefill_steps": prefill_steps,
        "decode_s": decode_s,
        "decode_steps": len(steps),
        "decode_tokens": decode_tokens,
        "step_ms_mean": 1e3 * decode_s / len(steps),
        "step_ms_median": 1e3 * statistics.median(steps),
        "decode_tok_s": decode_tokens / decode_s,
        "foreign_cpu": foreign.fraction,
        "tokens": tokens,
    }
