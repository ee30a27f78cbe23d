"""The bundled demo model (eaglet/demo_model/, built by tools/demo/build.py): it sees the scenes it
is asked about, its EAGLE-3 draft is lossless and batch invariant; and the build pipeline itself
runs end to end at a tiny size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.api import LLM
from eaglet.sampling_params import SamplingParams
from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR, demo_model_available

from tools.demo import evaluate

REPO_ROOT = Path(__file__).resolve().parents[1]

needs_demo = pytest.mark.skipif(
    not demo_model_available(),
    reason="the demo model is not built (run `python -m tools.demo.build` to make eaglet/demo_model/{target,draft})",
)


@pytest.fixture(scope="module")
def plain():
    return LLM(str(DEMO_TARGET_DIR), dtype="bfloat16", show_progress=False)


# Per question type: chance (one of 6 colours, 4 shapes, 5 positions, 3 counts) and the accuracy
# the shipped model must reach on the fixed scenes below (README "Demo model" has the full numbers:
# 97.5-100% on 40 scenes per type).
CHANCE = {"colour": 1 / 6, "shape": 1 / 4, "position": 1 / 5, "count": 1 / 3}
REQUIRED = {"colour": 0.8, "shape": 0.8, "position": 0.8, "count": 0.9}


@needs_demo
def test_answers_held_out_scene_questions(plain):
    """Ten fresh scenes per question type (an RNG stream training never used), greedy answers
    compared with the templated truth."""
    items = [item for item in evaluate.held_out_scene_items(per_kind=10, seed=1) if item.kind in REQUIRED]
    outputs = plain.generate([item.request for item in items], evaluate.greedy())
    right: dict[str, list[bool]] = {}
    for item, out in zip(items, outputs):
        right.setdefault(item.kind, []).append(evaluate.scenes.answer_matches(item.kind, item.expected, out.text))
    accuracy = {kind: sum(flags) / len(flags) for kind, flags in right.items()}
    for kind, required in REQUIRED.items():
        assert required > CHANCE[kind]
        assert accuracy[kind] >= required, accuracy


@needs_demo
@pytest.mark.parametrize("shape", [evaluate.CHAIN, evaluate.TREE], ids=["chain", "tree"])
def test_speculative_greedy_equals_plain_greedy(plain, shape):
    prompts = evaluate.held_out_prompts(6, seed=2)
    expected = [o.token_ids for o in plain.generate(prompts, evaluate.greedy(32))]
    spec = evaluate.speculative_llm(DEMO_TARGET_DIR, DEMO_DRAFT_DIR, shape, "bfloat16")
    outputs = spec.generate(prompts, evaluate.greedy(32))
    assert [o.token_ids for o in outputs] == expected
    assert spec.spec_metrics()["accept_length"] > 1.5  # the draft really predicts the target


@needs_demo
def test_chains_stop_where_every_request_drafted_its_end_of_turn(plain):
    """Answers end at their end of turn, which the draft predicts: once every request of a round
    drafted a token that ends it, the chain stops (drafts after it could never be kept). Output =
    plain decoding; fused and per-step drafting stop at the same places; the statistics count the
    tokens emitted. With ignore_eos, or a sampled request in the batch, chains keep their depth."""
    prompts = evaluate.held_out_prompts(3, seed=5, kinds=("describe",))
    params = evaluate.greedy(64)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert all(len(tokens) < 64 for tokens in expected)  # every answer ended at its end of turn
    chains: dict[str, list[tuple[int, int]]] = {}
    for mode in ("fused", "per step", "ignore_eos", "one sampled"):
        spec = evaluate.speculative_llm(DEMO_TARGET_DIR, DEMO_DRAFT_DIR, {**evaluate.CHAIN, "speculative_num_steps": 7,
                                                                          "speculative_num_draft_tokens": 8}, "bfloat16")
        worker = spec.engine.spec_worker
        if mode == "per step":  # the per-step drafting, each draft forward layer by layer
            worker.drafter = getattr(worker.drafter, "fallback", worker.drafter)
            worker.draft.stack = None
        draft_chain = worker._draft_chain
        rounds = chains[mode] = []

        def spy(requests, round_rows, length, draft_chain=draft_chain, rounds=rounds):
            tree = draft_chain(requests, round_rows, length)
            rounds.append((len(requests), tree.tokens.shape[1] - 1))
            return tree

        worker._draft_chain = spy
        if mode in ("ignore_eos", "one sampled"):
            sampled = SamplingParams(max_new_tokens=64, temperature=0.8, seed=1)
            batch_params = [SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)] * 3
            if mode == "one sampled":
                batch_params = [params, params, sampled]
            spec.generate(prompts, batch_params)
            assert {drafted for _, drafted in rounds} == {7}, mode
            continue
        outputs = spec.generate(prompts, params)
        assert [o.token_ids for o in outputs] == expected
        # Statistics count emitted tokens: every token after the first came from a verify step,
        # and drafts past a request's end of turn are not counted as proposed.
        assert [sum(o.spec_accept_lengths) for o in outputs] == [len(o.token_ids) - 1 for o in outputs]
        assert spec.spec_metrics()["num_draft_tokens"] <= sum(batch * drafted for batch, drafted in rounds)
    assert chains["fused"] == chains["per step"]
    assert min(drafted for _, drafted in chains["fused"]) < 7 <= max(drafted for _, drafted in chains["fused"])


@needs_demo
def test_batch_of_eight_images_accepts_as_much_as_each_alone():
    prompts = [p for p in evaluate.held_out_prompts(40, seed=3) if "images" in p][:8]
    assert len(prompts) == 8
    result = evaluate.batch_invariance(DEMO_TARGET_DIR, DEMO_DRAFT_DIR, prompts, evaluate.CHAIN, "bfloat16")
    assert result["same_tokens"]
    assert result["batched_accept_length"] == pytest.approx(result["alone_accept_length"], rel=0.02)


def test_smoke_build_pipeline(tmp_path):
    """tools/demo/build.py --smoke: tokenizer, target training, export in the published layout
    (checked against transformers inside the build), draft trained by eaglet train-draft; the
    result loads and speculates in eaglet."""
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-m", "tools.demo.build", "--smoke", "--out", str(out), "--work", str(tmp_path / "work")],
        check=True, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    config = json.loads((out / "target" / "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and config["text_config"]["model_type"] == "kimi_k2"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                 "generation_config.json"):
        assert (out / "target" / name).is_file(), name
    draft_config = json.loads((out / "draft" / "config.json").read_text())
    assert draft_config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    prompt = evaluate.held_out_prompts(4, seed=4)
    plain = LLM(str(out / "target"), dtype="float32", show_progress=False)
    spec = evaluate.speculative_llm(out / "target", out / "draft", evaluate.CHAIN, "float32")
    params = evaluate.greedy(8)
    assert [o.token_ids for o in spec.generate(prompt, params)] == [o.token_ids for o in plain.generate(prompt, params)]
