"""Measures the demo model: scene-question accuracy per question type on held-out generated
scenes, EAGLE-3 accept length (chain and tree) with eaglet's own speculative decoding, and batch
invariance of acceptance on multimodal prompts.

    python -m tools.demo.evaluate [--target DIR --draft DIR] [--per-kind 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.api import LLM
from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from eaglet.sampling_params import SamplingParams
from eaglet.testing import scenes
from eaglet.testing.demo_task import held_out_prompts, user_prompt

SCENE_KINDS = ("colour", "shape", "position", "count", "describe")
CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
TREE = {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 16}
MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class SceneItem:
    kind: str
    request: dict[str, Any]
    expected: str


def held_out_scene_items(per_kind: int, seed: int = 0) -> list[SceneItem]:
    """Fresh random scenes (an RNG stream training never uses), ``per_kind`` questions of each type."""
    rng = random.Random(f"held-out-scenes-{seed}")
    items = []
    for kind in SCENE_KINDS:
        for _ in range(per_kind):
            scene = scenes.random_scene(rng)
            qa = scenes.question_about(scene, kind, rng)
            request = {"prompt": user_prompt(qa.question, with_image=True), "images": [scenes.render_scene(scene)]}
            items.append(SceneItem(kind, request, qa.answer))
    return items


def greedy(max_new_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


def scene_accuracy(llm: LLM, items: list[SceneItem]) -> dict[str, float]:
    outputs = llm.generate([item.request for item in items], greedy())
    correct: dict[str, list[bool]] = {}
    for item, out in zip(items, outputs):
        correct.setdefault(item.kind, []).append(scenes.answer_matches(item.kind, item.expected, out.text))
    return {kind: sum(flags) / len(flags) for kind, flags in correct.items()}


def speculative_llm(target: Path, draft: Path, shape: dict[str, int], dtype: str, **kwargs: Any) -> LLM:
    return LLM(
        str(target), dtype=dtype, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
        speculative_adaptive=False, show_progress=False, **shape, **kwargs,
    )


def accept_length(target: Path, draft: Path, prompts: list[dict[str, Any]], shape: dict[str, int],
                  dtype: str) -> dict[str, Any]:
    llm = speculative_llm(target, draft, shape, dtype)
    llm.generate(prompts, greedy())
    metrics = llm.spec_metrics()
    assert metrics is not None
    return metrics


def mean_accept_length(outputs: list) -> float:
    verify = sum(o.spec_verify_ct for o in outputs)
    return sum(sum(o.spec_accept_lengths) for o in outputs) / max(1, verify)


def batch_invariance(target: Path, draft: Path, prompts: list[dict[str, Any]], shape: dict[str, int],
                     dtype: str) -> dict[str, Any]:
    """Mean accept length of ``prompts`` decoded as one batch and each alone (prefix cache off,
    so the runs alone share nothing), and whether every request's tokens are the same."""
    llm = speculative_llm(target, draft, shape, dtype, enable_prefix_caching=False)
    batched = llm.generate(prompts, greedy())
    alone = [llm.generate([p], greedy())[0] for p in prompts]
    return {
        "batched_accept_length": mean_accept_length(batched),
        "alone_accept_length": mean_accept_length(alone),
        "same_tokens": all(a.token_ids == b.token_ids for a, b in zip(batched, alone)),
    }


def evaluate(target: Path, draft: Path, *, per_kind: int, num_prompts: int, dtype: str, log=print) -> dict[str, Any]:
    report: dict[str, Any] = {"dtype": dtype}
    began = time.monotonic()
    plain = LLM(str(target), dtype=dtype, show_progress=False)
    report["scene_accuracy"] = scene_accuracy(plain, held_out_scene_items(per_kind))
    report["scene_questions_per_kind"] = per_kind
    log(f"scene accuracy {report['scene_accuracy']} ({time.monotonic() - began:.0f}s)")
    if not (draft / "config.json").is_file():
        log(f"no draft at {draft}: acceptance not measured")
        return report
    prompts = held_out_prompts(num_prompts)
    report["accept_prompts"] = num_prompts
    prompt_sets = {"mix": prompts, "describe": held_out_prompts(num_prompts, kinds=("describe",))}
    for set_name, prompt_set in prompt_sets.items():
        for name, shape in (("chain", CHAIN), ("tree", TREE)):
            metrics = accept_length(target, draft, prompt_set, shape, dtype)
            report[f"{set_name}_{name}_{shape['speculative_num_steps']}_{shape['speculative_eagle_topk']}_"
                   f"{shape['speculative_num_draft_tokens']}"] = metrics
            log(f"{set_name} prompts, {name} {shape}: accept length {metrics['accept_length']:.3f} "
                f"({time.monotonic() - began:.0f}s)")
    multimodal = [p for p in prompts if "images" in p][:8]
    report["batch_invariance_chain"] = batch_invariance(target, draft, multimodal, CHAIN, dtype)
    log(f"batch invariance {report['batch_invariance_chain']} ({time.monotonic() - began:.0f}s)")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=DEMO_TARGET_DIR)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFT_DIR)
    parser.add_argument("--per-kind", type=int, default=40, help="held-out scene questions per question type")
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts for accept length")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    report = evaluate(args.target, args.draft, per_kind=args.per_kind, num_prompts=args.prompts, dtype=args.dtype)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
