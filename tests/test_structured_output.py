"""Structured output on the demo model through ``LLM.generate``: outputs match their schema,
speculative greedy output equals plain greedy output under the grammar (chain and tree),
sampled speculation stays inside the grammar, logprobs are those of the masked distribution."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from eaglet.api import LLM
from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR, demo_model_available
from eaglet.sampling_params import SamplingParams, StructuredOutput
from eaglet.testing.demo_task import held_out_prompts
from tools.demo import evaluate

pytestmark = pytest.mark.skipif(not demo_model_available(), reason="the demo model is not built")

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue", "yellow", "purple", "orange"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "note": {"type": "string", "maxLength": 16},
    },
    "required": ["colour", "count", "note"],
    "additionalProperties": False,
}
PROMPTS = held_out_prompts(6, seed=4, kinds=("docs",))  # text only: no vision tower in the loop
# float32: constrained to JSON, the demo model writes text it never saw, where the best allowed
# tokens can be near-tied; bfloat16's verify and decode logits differ in the last bits there.
DTYPE = "float32"


def constrained(max_new_tokens: int = 96, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, structured_output=StructuredOutput(json_schema=SCHEMA), **kwargs)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(str(DEMO_TARGET_DIR), dtype=DTYPE, show_progress=False)


@pytest.fixture(scope="module")
def plain_greedy(plain: LLM) -> list:
    return plain.generate(PROMPTS, constrained(temperature=0.0))


def test_greedy_outputs_match_the_schema(plain_greedy) -> None:
    for out in plain_greedy:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({out.text for out in plain_greedy}) > 1  # the model, not the grammar alone, picks the values


@pytest.mark.parametrize("shape", [evaluate.CHAIN, evaluate.TREE], ids=["chain", "tree"])
def test_speculative_greedy_equals_plain_greedy_under_the_grammar(plain_greedy, shape) -> None:
    spec = evaluate.speculative_llm(DEMO_TARGET_DIR, DEMO_DRAFT_DIR, shape, DTYPE)
    outputs = spec.generate(PROMPTS, constrained(temperature=0.0))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_greedy]
    assert all(o.spec_verify_ct > 0 for o in outputs)
    seeded = spec.generate(PROMPTS[:3], constrained(temperature=1.0, seed=7))
    for out in seeded:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_logprobs_are_those_of_the_masked_distribution(plain: LLM) -> None:
    """As vLLM: logprobs of the grammar-masked logits, so tokens the grammar forbids have -inf and
    the first token's alternatives are only tokens that open the object."""
    out = plain.generate(PROMPTS[:1], constrained(temperature=0.0, logprobs=5))[0]
    first = [t for t, lp in out.logprobs[0].top if lp > -math.inf]
    assert first and all(plain.tokenizer.decode([t]).startswith("{") for t in first)
    for entry in out.logprobs:
        assert entry.top[0] == (entry.token_id, entry.logprob)  # greedy: the most likely allowed token
    unconstrained = plain.generate(PROMPTS[:1], SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5))[0]
    assert not plain.tokenizer.decode(unconstrained.token_ids).startswith("{")  # so the mask changed the first token


def test_a_bad_schema_is_a_value_error(plain: LLM) -> None:
    bad = SamplingParams(structured_output=StructuredOutput(json_schema={"type": "objekt"}))
    with pytest.raises(ValueError, match="invalid JSON schema"):
        plain.generate(PROMPTS[:1], bad)
