"""The demo model under load gives every request what it gets alone and cold: 16 ragged requests
(scene questions with their images, "continue the text" prompts; all share the chat template's
prefix), greedy and seeded, with their top-2 log-probabilities, through the engine (plain and
speculative, float32 and bfloat16) and through the server with the official ``openai`` client."""

from __future__ import annotations

import base64
import contextlib
import io
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server import serve

from eaglet import LLM, SamplingParams, kernels
from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR, demo_model_available
from eaglet.engine.engine import Engine, EngineConfig
from eaglet.server import ServerConfig
from eaglet.testing import scenes
from eaglet.testing.demo_task import docs_prompt_and_answer, user_prompt
from eaglet.testing.docs_corpus import docs_paragraphs

pytestmark = [
    pytest.mark.skipif(not demo_model_available(), reason="the demo model is not built"),
    pytest.mark.skipif(not kernels.available(), reason=f"kernels not built: {kernels.unavailable_reason()}"),
]

NEW_TOKENS = 8
CHAIN = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEMO_DRAFT_DIR), speculative_adaptive=False,
             speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)


def _tasks() -> list[tuple[str, object | None]]:
    """(question or docs prompt, scene image or None): 12 scene questions of every kind, 4 docs prompts."""
    rng = random.Random("invariance")
    tasks: list[tuple[str, object | None]] = []
    for kind in ["describe", "colour", "shape", "position", "count", "describe"] * 2:
        scene = scenes.random_scene(rng)
        tasks.append((scenes.question_about(scene, kind, rng).question, scenes.render_scene(scene)))
    docs = docs_paragraphs()
    tasks += [(docs_prompt_and_answer(docs, rng)[0], None) for _ in range(4)]
    rng.shuffle(tasks)
    return tasks


def _requests() -> list[dict]:
    return [{"prompt": user_prompt(text, with_image=image is not None), **({"images": [image]} if image else {})}
            for text, image in _tasks()]


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, logprobs=2)
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=1000 + i, logprobs=2)


def _result(out) -> tuple:
    return out.token_ids, [(e.token_id, e.logprob, e.top) for e in out.logprobs]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "chain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sixteen_requests_together_and_warm_get_what_each_gets_alone_and_cold(dtype, spec):
    requests, extra = _requests(), CHAIN if spec else {}
    params = [_params(i) for i in range(len(requests))]
    cold = LLM(str(DEMO_TARGET_DIR), dtype=dtype, show_progress=False, enable_prefix_caching=False, **extra)
    alone = [_result(cold.generate([r], p)[0]) for r, p in zip(requests, params)]
    llm = LLM(str(DEMO_TARGET_DIR), dtype=dtype, show_progress=False, **extra)
    together = [_result(out) for out in llm.generate(requests, params)]
    warm = [_result(out) for out in llm.generate(requests, params)]
    assert llm.engine.prefix_cache.num_evictable_blocks > 0
    assert together == alone
    assert warm == alone
    if spec:  # lossless: greedy requests decode the tokens of plain decoding
        plain = LLM(str(DEMO_TARGET_DIR), dtype=dtype, show_progress=False, enable_prefix_caching=False)
        for i in range(0, len(requests), 2):
            assert alone[i][0] == plain.generate([requests[i]], params[i])[0].token_ids


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


def _messages(text: str, image) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": _data_url(image)}})
    return [{"role": "user", "content": content}]


def _ask(server, i: int, text: str, image) -> tuple:
    sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i}
    response = server.client().chat.completions.create(
        model="demo", messages=_messages(text, image), max_tokens=NEW_TOKENS, logprobs=True, top_logprobs=2, **sampling,
    )
    choice = response.choices[0]
    return choice.message.content, [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                    for t in choice.logprobs.content]


@pytest.mark.parametrize(("dtype", "spec"), [("float32", False), ("bfloat16", True)], ids=["float32-plain", "bfloat16-chain"])
def test_a_loaded_warm_server_answers_as_a_cold_server_answers_one_request(dtype, spec):
    tasks = _tasks()
    config = ServerConfig(model_name="demo")

    def engine(prefix_caching: bool) -> Engine:
        return Engine(EngineConfig(model=str(DEMO_TARGET_DIR), dtype=dtype, show_progress=False,
                                   enable_prefix_caching=prefix_caching, **(CHAIN if spec else {})))

    live = contextlib.contextmanager(serve)
    with live(engine(False), config) as cold:
        alone = [_ask(cold, i, text, image) for i, (text, image) in enumerate(tasks)]
    with live(engine(True), config) as warm, ThreadPoolExecutor(len(tasks)) as pool:
        for _ in range(2):  # cold cache under load, then warm
            together = list(pool.map(lambda item: _ask(warm, item[0], *item[1]), enumerate(tasks)))
            assert together == alone
