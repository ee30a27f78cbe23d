"""Structured output under EAGLE-3 on the demo model: accept length with the grammar on and off,
and what the grammar's work costs.

    python -m eaglet.bench.structured_output [--prompts 8] [--max-new-tokens 48] [--dtype bfloat16] [--json out.json]

Greedy decoding of the same text prompts (the demo task's docs continuations) four ways: plain and
EAGLE-3 chain (3 steps, 4 tokens), each free and constrained to a JSON schema. Reported per run:
mean accept length (accepted drafts + bonus per verify step), decode tokens/s, and for the
constrained speculative run the grammar's share of a round (cutting rejected drafts and masking the
verify logits, from the worker's phase timer). For plain decoding the mask's cost per token is
measured by replaying the constrained outputs through a fresh grammar (mask, apply it to a row of
logits, advance), against the plain constrained run's time per decode step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from eaglet.api import LLM
from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from eaglet.grammar.matcher import mask_logits
from eaglet.sampling_params import SamplingParams, StructuredOutput
from eaglet.testing.demo_task import held_out_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square", "triangle", "star"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "where": {"type": "string", "maxLength": 40},
    },
    "required": ["shape", "count", "where"],
    "additionalProperties": False,
}
CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}


def _llm(speculative: bool, dtype: str) -> LLM:
    spec: dict[str, Any] = {}
    if speculative:
        spec = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(DEMO_DRAFT_DIR),
                "speculative_adaptive": False, **CHAIN}
    llm = LLM(str(DEMO_TARGET_DIR), dtype=dtype, show_progress=False, max_running_requests=1, **spec)
    llm.generate(["warm-up"], SamplingParams(max_new_tokens=8, temperature=0.0))  # first-call costs out of the timings
    return llm


def _run(llm: LLM, prompts: list[dict[str, Any]], params: SamplingParams) -> dict[str, Any]:
    """One prompt at a time (batch 1); decode time excludes each prompt's prefill step."""
    outputs, decode_seconds, decode_tokens = [], 0.0, 0
    engine = llm.engine
    for k, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"bench-{k}")
        engine.step()  # prefill and the first token
        start = time.perf_counter()
        done = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done = out
        decode_seconds += time.perf_counter() - start
        decode_tokens += len(done.token_ids) - 1
        outputs.append(done)
    steps = [n for o in outputs for n in o.spec_accept_lengths]
    return {
        "outputs": outputs,
        "accept_length": statistics.mean(steps) if steps else None,
        "decode_tokens_per_s": decode_tokens / decode_seconds,
        "seconds_per_decode_step": decode_seconds / (len(steps) if steps else decode_tokens),
    }


def mask_seconds_per_token(llm: LLM, outputs: list, structured: StructuredOutput) -> float:
    """Mean time to mask one row of logits and advance the grammar, over the outputs' tokens."""
    engine = llm.engine
    logits = torch.zeros(1, engine.model_config.text.vocab_size)
    seconds, count = 0.0, 0
    for out in outputs:
        grammar = engine.grammars.matcher(structured, tuple(sorted(engine.eos_token_ids)))
        for token in out.token_ids:
            start = time.perf_counter()
            mask_logits(logits, [grammar])
            if token not in engine.eos_token_ids:
                grammar.accept(token)
            seconds += time.perf_counter() - start
            count += 1
    return seconds / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    prompts = held_out_prompts(args.prompts, seed=11, kinds=("docs",))
    structured = StructuredOutput(json_schema=SCHEMA)
    free = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    constrained = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, structured_output=structured)
    record: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    record["dtype"] = args.dtype
    plain = _llm(speculative=False, dtype=args.dtype)
    for name, params in (("plain_free", free), ("plain_grammar", constrained)):
        record[name] = _run(plain, prompts, params)
    spec = _llm(speculative=True, dtype=args.dtype)
    worker = spec.engine.spec_worker
    for name, params in (("spec_free", free), ("spec_grammar", constrained)):
        worker.timer.reset()
        record[name] = _run(spec, prompts, params)
        record[name]["phase_share"] = worker.timer.shares()
    same = [o.token_ids for o in record["spec_grammar"]["outputs"]] == [o.token_ids for o in record["plain_grammar"]["outputs"]]
    mask = mask_seconds_per_token(plain, record["plain_grammar"]["outputs"], structured)
    record["spec_grammar_equals_plain_grammar"] = same
    record["mask_us_per_token"] = mask * 1e6
    record["mask_share_of_plain_step"] = mask / record["plain_grammar"]["seconds_per_decode_step"]
    for name in ("plain_free", "plain_grammar", "spec_free", "spec_grammar"):
        row = record[name]
        row.pop("outputs")
        accept = f"{row['accept_length']:.2f}" if row["accept_length"] else "  - "
        grammar_share = row.get("phase_share", {}).get("grammar")
        share = f"  grammar {grammar_share:.1%} of a round" if grammar_share is not None and name == "spec_grammar" else ""
        print(f"{name:14} accept length {accept}  {row['decode_tokens_per_s']:7.1f} tok/s{share}")
    print(f"mask + advance: {record['mask_us_per_token']:.0f} us per token, "
          f"{record['mask_share_of_plain_step']:.1%} of a plain decode step; speculative == plain under the grammar: {same}")
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
