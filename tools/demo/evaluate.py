"""Measures the demo model: scene-question accuracy per question type on held-out generated
scenes (thinking off, and with thinking on the answer after ``</think>``), the count_shapes tool
(the first turn's call has the question's colour; the answer after the tool's result copies its
number), EAGLE-3 accept length (chain and tree) with eaglet's own speculative decoding, and batch
invariance of acceptance on multimodal prompts.

    python -m tools.demo.evaluate [--target DIR --draft DIR] [--per-kind 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.api import LLM
from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from eaglet.sampling_params import SamplingParams
from eaglet.testing import scenes
from eaglet.server.kimi_k2_output import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, THINK_CLOSE
from eaglet.testing.demo_task import (
    TOOL_CALL_ID,
    held_out_prompts,
    held_out_tool_items,
    tool_answer,
    tool_result_prompt,
    user_prompt,
)

SCENE_KINDS = ("colour", "shape", "position", "count", "describe")
CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
TREE = {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 16}
MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class SceneItem:
    kind: str
    request: dict[str, Any]
    expected: str


def held_out_scene_items(per_kind: int, seed: int = 0, thinking: bool = False) -> list[SceneItem]:
    """Fresh random scenes (an RNG stream training never uses), ``per_kind`` questions of each type."""
    rng = random.Random(f"held-out-scenes-{seed}")
    items = []
    for kind in SCENE_KINDS:
        for _ in range(per_kind):
            scene = scenes.random_scene(rng)
            qa = scenes.question_about(scene, kind, rng)
            request = {"prompt": user_prompt(qa.question, with_image=True, thinking=thinking),
                       "images": [scenes.render_scene(scene)]}
            items.append(SceneItem(kind, request, qa.answer))
    return items


def greedy(max_new_tokens: int = MAX_NEW_TOKENS, skip_special_tokens: bool = True) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, skip_special_tokens=skip_special_tokens)


def answer_part(text: str, thinking: bool) -> str | None:
    """What follows the thinking section (None: thinking on and no ``</think>``)."""
    text = text.replace("<|im_end|>", "")
    if not thinking:
        return text
    return text.split(THINK_CLOSE, 1)[1] if THINK_CLOSE in text else None


def scene_accuracy(llm: LLM, items: list[SceneItem], thinking: bool = False) -> dict[str, float]:
    params = greedy(skip_special_tokens=not thinking)
    outputs = llm.generate([item.request for item in items], params)
    correct: dict[str, list[bool]] = {}
    for item, out in zip(items, outputs):
        answer = answer_part(out.text, thinking)
        correct.setdefault(item.kind, []).append(
            answer is not None and scenes.answer_matches(item.kind, item.expected, answer))
    return {kind: sum(flags) / len(flags) for kind, flags in correct.items()}


_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(ARGUMENT_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)


def parse_call(text: str) -> tuple[str, dict] | None:
    """The first tool call's id and JSON arguments in raw output (None: no call, or bad JSON)."""
    match = _CALL.search(text)
    if match is None:
        return None
    try:
        return match.group(1), json.loads(match.group(2))
    except json.JSONDecodeError:
        return None


def tool_accuracy(llm: LLM, count: int, thinking: bool, seed: int = 0) -> dict[str, Any]:
    """On ``count`` held-out count_shapes requests: the share whose first turn calls count_shapes
    with the question's colour (and nothing before the call but the thinking), and the share
    whose answer after the tool's result (the scene's true count; and a random 2-9 the scene
    cannot give) is the templated answer with that number."""
    items = held_out_tool_items(count, seed)
    params = greedy(skip_special_tokens=False)
    images = [[scenes.render_scene(item["scene"])] for item in items]
    first = llm.generate([{"prompt": user_prompt(item["question"], with_image=True, thinking=thinking, tools=True),
                           "images": image} for item, image in zip(items, images)], params)
    calls_right = 0
    for item, out in zip(items, first):
        call = parse_call(answer_part(out.text, thinking) or "")
        calls_right += call == (TOOL_CALL_ID, {"color": item["colour"]})
    rng = random.Random(f"tool-results-{seed}")
    report: dict[str, Any] = {"requests": count, "call_correct": calls_right / count}
    for name, results in (("answer_correct", [item["result"] for item in items]),
                          ("answer_correct_other_numbers", [str(rng.randint(2, 9)) for _ in items])):
        second = llm.generate([{"prompt": tool_result_prompt(item["question"], item["colour"], result, thinking=thinking),
                                "images": image} for item, image, result in zip(items, images, results)], params)
        right = copied = 0
        for item, out, result in zip(items, second, results):
            answer = (answer_part(out.text, thinking) or "").replace("<|im_end|>", "").strip()
            right += answer == tool_answer(item["colour"], result)
            copied += re.search(rf"\b{result}\b", answer) is not None
        report[name] = right / count
        report[name.replace("answer_correct", "number_copied")] = copied / count
    return report


def speculative_llm(target: Path, draft: Path, shape: dict[str, int], dtype: str, **kwargs: Any) -> LLM:
    return LLM(
        str(target), dtype=dtype, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
        speculative_adaptive=False, show_progress=False, **shape, **kwargs,
    )


def accept_length(target: Path, draft: Path, prompts: list[dict[str, Any]], shape: dict[str, int],
                  dtype: str, **kwargs: Any) -> dict[str, Any]:
    llm = speculative_llm(target, draft, shape, dtype, **kwargs)
    llm.generate(prompts, greedy())
    metrics = llm.spec_metrics()
    assert metrics is not None
    return metrics


def mean_accept_length(outputs: list) -> float:
    verify = sum(o.spec_verify_ct for o in outputs)
    return sum(sum(o.spec_accept_lengths) for o in outputs) / max(1, verify)


def batch_invariance(target: Path, draft: Path, prompts: list[dict[str, Any]], shape: dict[str, int],
                     dtype: str, **kwargs: Any) -> dict[str, Any]:
    """Mean accept length of ``prompts`` decoded as one batch and each alone (prefix cache off,
    so the runs alone share nothing), and whether every request's tokens are the same."""
    llm = speculative_llm(target, draft, shape, dtype, enable_prefix_caching=False, **kwargs)
    batched = llm.generate(prompts, greedy())
    alone = [llm.generate([p], greedy())[0] for p in prompts]
    return {
        "batched_accept_length": mean_accept_length(batched),
        "alone_accept_length": mean_accept_length(alone),
        "same_tokens": all(a.token_ids == b.token_ids for a, b in zip(batched, alone)),
    }


def evaluate(target: Path, draft: Path, *, per_kind: int, num_prompts: int, dtype: str, tool_requests: int = 40,
             quantization: str | None = None, quantized_layers: str = "experts", log=print) -> dict[str, Any]:
    """``quantization``: the target's matrices that ``quantized_layers`` names quantized at load
    (``--quantization``, ``--quantized-layers``); the draft stays in ``dtype``."""
    report: dict[str, Any] = {"dtype": dtype, "quantization": quantization}
    engine_kwargs: dict[str, Any] = {}
    if quantization:
        engine_kwargs = {"quantization": quantization, "quantized_layers": quantized_layers}
        report["quantized_layers"] = quantized_layers
    began = time.monotonic()
    plain = LLM(str(target), dtype=dtype, show_progress=False, **engine_kwargs)
    report["scene_accuracy"] = scene_accuracy(plain, held_out_scene_items(per_kind))
    report["scene_questions_per_kind"] = per_kind
    log(f"scene accuracy {report['scene_accuracy']} ({time.monotonic() - began:.0f}s)")
    report["scene_accuracy_thinking"] = scene_accuracy(plain, held_out_scene_items(per_kind, thinking=True), thinking=True)
    log(f"scene accuracy, thinking on {report['scene_accuracy_thinking']} ({time.monotonic() - began:.0f}s)")
    for thinking in (False, True):
        key = "tools_thinking" if thinking else "tools"
        report[key] = tool_accuracy(plain, tool_requests, thinking)
        log(f"count_shapes, thinking {'on' if thinking else 'off'}: {report[key]} ({time.monotonic() - began:.0f}s)")
    if not (draft / "config.json").is_file():
        log(f"no draft at {draft}: acceptance not measured")
        return report
    prompts = held_out_prompts(num_prompts, thinking=None)  # the whole mix, thinking on for about half
    report["accept_prompts"] = num_prompts
    prompt_sets = {"mix": prompts, "describe": held_out_prompts(num_prompts, kinds=("describe",)),
                   "tools": held_out_prompts(num_prompts, kinds=("tool_call", "tool_answer"), thinking=None)}
    for set_name, prompt_set in prompt_sets.items():
        for name, shape in (("chain", CHAIN), ("tree", TREE)):
            metrics = accept_length(target, draft, prompt_set, shape, dtype, **engine_kwargs)
            report[f"{set_name}_{name}_{shape['speculative_num_steps']}_{shape['speculative_eagle_topk']}_"
                   f"{shape['speculative_num_draft_tokens']}"] = metrics
            log(f"{set_name} prompts, {name} {shape}: accept length {metrics['accept_length']:.3f} "
                f"({time.monotonic() - began:.0f}s)")
    multimodal = [p for p in prompts if "images" in p][:8]
    report["batch_invariance_chain"] = batch_invariance(target, draft, multimodal, CHAIN, dtype, **engine_kwargs)
    log(f"batch invariance {report['batch_invariance_chain']} ({time.monotonic() - began:.0f}s)")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=DEMO_TARGET_DIR)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFT_DIR)
    parser.add_argument("--per-kind", type=int, default=40, help="held-out scene questions per question type")
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts for accept length")
    parser.add_argument("--tool-requests", type=int, default=40, help="held-out count_shapes requests")
    parser.add_argument("--skip-accept", action="store_true", help="accuracy only")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=("int4", "int8"), default=None,
                        help="quantize the target at load, as `eaglet serve --quantization`")
    parser.add_argument("--quantized-layers", choices=("experts", "all"), default="experts",
                        help="what --quantization quantizes, as `eaglet serve --quantized-layers`")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    report = evaluate(args.target, args.draft if not args.skip_accept else Path("/nonexistent"), per_kind=args.per_kind,
                      num_prompts=args.prompts, dtype=args.dtype, tool_requests=args.tool_requests,
                      quantization=args.quantization, quantized_layers=args.quantized_layers)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
