"""The OpenAI-compatible server, live: uvicorn on 127.0.0.1 (a free port) in a background thread,
driven by the official ``openai`` client and raw ``httpx`` requests.

Two servers share one tiny Kimi-K2.5 "echo" target (eaglet/testing/echo_checkpoints.py) with a tokenizer and
its chat template: one with an EAGLE-3 echo draft (speculation on), one without (and with an API
key). Speculation is lossless, so both must return the same greedy text.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from eaglet.testing.checkpoints import write_tiny_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from eaglet.testing.images import make_image
from eaglet.testing.echo_checkpoints import echo_draft, echo_kimi_target

from eaglet.engine.async_engine import AsyncEngine
from eaglet.engine.engine import Engine, EngineConfig
from eaglet.server import ImageLimits, ServerConfig, StepTally, create_app, start_engine

MODEL = "echo-kimi"
API_KEY = "test-key"
MAX_REQUEST_BYTES = 1 << 20
IMAGE_LIMITS = ImageLimits(max_images=3, max_pixels=200 * 200)


@dataclass
class LiveServer:
    base_url: str
    engine: Engine
    async_engine: AsyncEngine
    initial_free_blocks: int
    api_key: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics as (name, sorted labels without model_name) -> value."""
        text = httpx.get(f"{self.base_url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                samples[(sample.name, labels)] = sample.value
        return samples


def _serve(engine: Engine, api_key: str | None, log_interval_steps: int = 50) -> Iterator[LiveServer]:
    config = ServerConfig(
        model_name=MODEL, api_key=api_key, max_request_bytes=MAX_REQUEST_BYTES, max_n=4, image_limits=IMAGE_LIMITS
    )
    yield from serve(engine, config, log_interval_steps)


def serve(engine: Engine, config: ServerConfig, log_interval_steps: int = 50) -> Iterator[LiveServer]:
    """A live server on 127.0.0.1 for the engine (shut down when the generator is closed)."""
    initial_free = engine.num_free_blocks()
    tally = StepTally()
    async_engine = start_engine(engine, tally, log_interval_steps=log_interval_steps, log_min_interval_s=0.0)
    app = create_app(async_engine, config, tally)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, async_engine, initial_free, config.api_key or "unused")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        async_engine.shutdown()
        sock.close()


def _engine(target: Path, draft: Path | None) -> Engine:
    spec = {}
    if draft is not None:
        # Not adaptive: every decode step speculates, so there are statistics to check.
        spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft), speculative_num_steps=3,
                    speculative_eagle_topk=1, speculative_num_draft_tokens=4, speculative_adaptive=False)
    return Engine(EngineConfig(model=str(target), dtype="float32", max_running_requests=40, show_progress=False, **spec))


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = echo_kimi_target(tmp_path_factory.mktemp("target"), alpha=2.0)
    write_tiny_tokenizer(path, 256, chat_style="kimi")
    return path


@pytest.fixture(scope="module")
def spec_server(target, tmp_path_factory) -> Iterator[LiveServer]:
    draft = echo_draft(target, tmp_path_factory.mktemp("draft"), kind="mla", seed=5)
    yield from _serve(_engine(target, draft), api_key=None, log_interval_steps=1)


@pytest.fixture(scope="module")
def plain_server(target) -> Iterator[LiveServer]:
    yield from _serve(_engine(target, None), api_key=API_KEY)


def data_url(width: int, height: int, seed: int, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    make_image(width, height, seed).save(buffer, format=fmt)
    media = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{media};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def user(text: str, *image_urls: str) -> list[dict]:
    if not image_urls:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def chat(server: LiveServer, messages: list[dict], **kwargs):
    return server.client().chat.completions.create(model=MODEL, messages=messages, **kwargs)


def stream_chat(server: LiveServer, messages: list[dict], **kwargs) -> tuple[dict[int, str], list]:
    """Texts per choice index joined from the stream, and every chunk."""
    texts: dict[int, str] = {}
    chunks = list(server.client().chat.completions.create(model=MODEL, messages=messages, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, chunks


# ---- the openai client ---------------------------------------------------------------------


def test_models_health_and_auth(spec_server, plain_server) -> None:
    assert [m.id for m in spec_server.client().models.list()] == [MODEL]
    assert httpx.get(f"{spec_server.base_url}/health").status_code == 200
    assert [m.id for m in plain_server.client().models.list()] == [MODEL]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{plain_server.base_url}/v1/chat/completions", headers=headers,
                              json={"model": MODEL, "messages": user("hi")})
        assert response.status_code == 401, headers
        assert "API key" in response.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{plain_server.base_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_sampled_stream_equals_non_stream(spec_server) -> None:
    messages = user("Tell me about the quick brown fox.")
    kwargs = dict(temperature=0.8, seed=1234, max_tokens=24)
    full = chat(spec_server, messages, **kwargs)
    texts, chunks = stream_chat(spec_server, messages, stream_options={"include_usage": True}, **kwargs)
    assert full.choices[0].message.content  # sampled text, not empty
    assert texts[0] == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    # Speculative statistics: on each choice, and on the final chunk of a stream.
    stats = full.choices[0].model_extra["speculative"]
    assert stats["verify_steps"] > 0 and stats["accept_length"] >= 1.0
    assert stats["accept_length"] == pytest.approx((stats["accepted_tokens"] + stats["verify_steps"]) / stats["verify_steps"])
    assert finals[0].choices[0].model_extra["speculative"] == stats
    usage = full.usage
    assert usage.completion_tokens == 24 or full.choices[0].finish_reason == "stop"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_images_in_chat(spec_server) -> None:
    images = [data_url(32, 24, 1, "PNG"), data_url(20, 28, 2, "JPEG"), data_url(24, 24, 3, "WEBP")]
    text_only = chat(spec_server, user("Describe."), max_tokens=8, **GREEDY)
    one = chat(spec_server, user("Describe.", images[0]), max_tokens=8, **GREEDY)
    three = chat(spec_server, user("Describe.", *images), max_tokens=8, **GREEDY)
    # Each image adds its placeholder tokens (the template's one placeholder expanded by the engine).
    assert text_only.usage.prompt_tokens < one.usage.prompt_tokens < three.usage.prompt_tokens
    texts, _ = stream_chat(spec_server, user("Describe.", *images), max_tokens=8, **GREEDY)
    assert texts[0] == three.choices[0].message.content
    other = chat(spec_server, user("Describe.", data_url(32, 24, 99, "PNG")), max_tokens=8, **GREEDY)
    assert other.usage.prompt_tokens == one.usage.prompt_tokens  # same size, other pixels: same prompt length


def test_stop_strings(spec_server) -> None:
    messages = user("Count the ways.")
    reference = chat(spec_server, messages, max_tokens=40, **GREEDY).choices[0].message.content
    assert len(reference) >= 8
    # A stop string from the middle of the output: the text ends right before its first occurrence.
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    expected = reference[: reference.index(stop)]
    for stop_field in (stop, [stop, "\x00never"]):
        result = chat(spec_server, messages, max_tokens=40, stop=stop_field, **GREEDY)
        assert result.choices[0].message.content == expected
        assert result.choices[0].finish_reason == "stop"
    texts, _ = stream_chat(spec_server, messages, max_tokens=40, stop=[stop], **GREEDY)
    assert texts[0] == expected


def test_n_samples(spec_server) -> None:
    messages = user("Write something.")
    full = chat(spec_server, messages, n=3, temperature=0.8, seed=7, max_tokens=16)
    assert [c.index for c in full.choices] == [0, 1, 2]
    contents = [c.message.content for c in full.choices]
    assert len(set(contents)) > 1  # seeds 7, 8, 9
    assert full.usage.completion_tokens > 16  # the three completions together
    texts, _ = stream_chat(spec_server, messages, n=3, temperature=0.8, seed=7, max_tokens=16)
    assert [texts[j] for j in range(3)] == contents
    # The largest seed: sample 1's seed wraps around to 0, as torch reads seeds (modulo 2**64).
    largest = chat(spec_server, messages, n=2, temperature=0.8, seed=2**64 - 1, max_tokens=8)
    zero = chat(spec_server, messages, temperature=0.8, seed=0, max_tokens=8)
    assert largest.choices[1].message.content == zero.choices[0].message.content


def test_logprobs(spec_server, target) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    result = chat(spec_server, user("Logprobs please."), max_tokens=10, logprobs=True, top_logprobs=3, **GREEDY)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 10
    for entry in content:
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # Greedy picks the most likely token (under the raw distribution the logprobs report).
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(tops[0])
        assert bytes(entry.bytes).decode() == entry.token
    tokens = tokenizer.encode(result.choices[0].message.content, add_special_tokens=False)
    assert tokenizer.decode(tokens) == "".join(e.token for e in content)
    completion = spec_server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=6, logprobs=2,
                                                         temperature=0.0, extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_completions_text_and_token_ids(spec_server, target) -> None:
    from transformers import AutoTokenizer

    token_ids = AutoTokenizer.from_pretrained(str(target)).encode("The quick brown fox", add_special_tokens=False)
    client = spec_server.client()
    by_text = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=12, **GREEDY)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(token_ids) and by_text.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=token_ids, max_tokens=12, stream=True, **GREEDY) if c.choices)
    assert streamed == by_text.choices[0].text
    default = client.completions.create(model=MODEL, prompt="Hi", temperature=0.0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_post_bodies_must_be_json(spec_server) -> None:
    """A browser sends a form or text/plain body to any origin without asking first, so a page on
    any site could make a local server generate: only JSON bodies are taken."""
    for path, body in (("chat/completions", _body()), ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})):
        url = f"{spec_server.base_url}/v1/{path}"
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"Origin": "https://elsewhere.example"} | ({"Content-Type": content_type} if content_type else {})
            response = httpx.post(url, content=json.dumps(body), headers=headers, timeout=30)
            assert response.status_code == 415, (content_type, response.text)
            assert "application/json" in response.json()["error"]["message"]
        response = httpx.post(url, content=json.dumps(body), headers={"Content-Type": "application/json; charset=utf-8"},
                              timeout=30)
        assert response.status_code == 200, response.text


def test_completions_batched_prompts(spec_server, target) -> None:
    from transformers import AutoTokenizer

    client = spec_server.client()
    texts = ["The quick brown fox", "Hello there, how"]
    sampled = dict(max_tokens=8, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    alone = [client.completions.create(model=MODEL, prompt=text, n=2, **sampled) for text in texts]
    batch = client.completions.create(model=MODEL, prompt=texts, n=2, **sampled)
    # OpenAI's order: choice i * n + j is sample j of prompt i.
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [c.text for result in alone for c in result.choices]
    assert batch.usage.prompt_tokens == sum(result.usage.prompt_tokens for result in alone)
    assert batch.usage.completion_tokens == sum(result.usage.completion_tokens for result in alone)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    token_ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    by_ids = client.completions.create(model=MODEL, prompt=token_ids, n=2, **sampled)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    streamed: dict[int, str] = {}
    chunks = list(client.completions.create(model=MODEL, prompt=texts, n=2, stream=True,
                                            stream_options={"include_usage": True}, **sampled))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in batch.choices}
    assert chunks[-1].usage.model_dump() == batch.usage.model_dump()


def test_completions_echo(spec_server, target) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    client = spec_server.client()
    prompt = "The quick brown fox"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, echo=True, **GREEDY)
    generated = plain.choices[0].text
    assert echoed.choices[0].text == prompt + generated
    lp = echoed.choices[0].logprobs
    num_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 6
    # The first prompt token has nothing before it; every other token has its logprob and top 2.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == echoed.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    # The generated text fed back as prompt: its echoed logprobs are the ones it was generated with.
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    generated_ids = tokenizer.encode(generated, add_special_tokens=False)
    again = client.completions.create(model=MODEL, prompt=prompt_ids + generated_ids, max_tokens=1, logprobs=2, echo=True,
                                      **GREEDY)
    assert again.choices[0].text.startswith(prompt + generated)
    again_lp = again.choices[0].logprobs.token_logprobs
    assert again_lp[len(prompt_ids) : len(prompt_ids) + 6] == pytest.approx(lp.token_logprobs[num_prompt:], abs=1e-4)
    # Streamed: the prompt (and its logprobs) first, then the tokens as they come.
    chunks = [c for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, echo=True,
                                                   stream=True, **GREEDY) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    assert chunks[0].choices[0].text.startswith(prompt)
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    # Without logprobs, echo still prepends the prompt; n choices each get it.
    two = client.completions.create(model=MODEL, prompt=[prompt_ids, prompt_ids], n=2, max_tokens=6, echo=True, **GREEDY)
    assert [c.text for c in two.choices] == [tokenizer.decode(prompt_ids) + generated] * 4


def test_speculative_and_plain_servers_agree(spec_server, plain_server) -> None:
    cases = [user("Hello there, how are you?"), user("The quick brown fox"), user("Look:", data_url(28, 20, 4))]
    spec_accepted = 0
    for messages in cases:
        spec = chat(spec_server, messages, max_tokens=32, **GREEDY)
        plain = chat(plain_server, messages, max_tokens=32, **GREEDY)
        assert spec.choices[0].message.content == plain.choices[0].message.content
        assert "speculative" not in (plain.choices[0].model_extra or {})
        spec_accepted += spec.choices[0].model_extra["speculative"]["accepted_tokens"]
    assert spec_accepted > 0  # the echo draft is accepted part of the time


# ---- concurrency, disconnects and metrics --------------------------------------------------


def test_concurrent_streams_with_disconnects(spec_server) -> None:
    prompts = [f"Prompt number {i}: tell a story about {w}." for i, w in enumerate("abcdefgh")]
    alone = [chat(spec_server, user(p), max_tokens=20, **GREEDY).choices[0].message.content for p in prompts]
    before = spec_server.metrics()
    num_clients, leaving = 32, set(range(0, 32, 4))

    async def one(i: int, client: openai.AsyncOpenAI) -> str | None:
        leaves = i in leaving
        stream = await client.chat.completions.create(
            model=MODEL, messages=user(prompts[i % len(prompts)]), stream=True,
            max_tokens=200 if leaves else 20, **GREEDY,
        )
        text = ""
        num_chunks = 0
        async for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            num_chunks += 1
            if leaves and num_chunks == 3:
                await stream.close()  # the client goes away mid-stream
                return None
        return text

    async def run_all() -> list[str | None]:
        async with spec_server.async_client() as client:
            return await asyncio.gather(*(one(i, client) for i in range(num_clients)))

    results = asyncio.run(run_all())
    for i, text in enumerate(results):
        if i not in leaving:
            assert text == alone[i % len(prompts)], i
    # The server notices the disconnects asynchronously: wait for the aborts to land.
    deadline = time.monotonic() + 20
    while True:
        after = spec_server.metrics()
        idle = after[("eaglet:num_requests_running", ())] == 0 and after[("eaglet:num_requests_waiting", ())] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle
    assert after[("eaglet:kv_cache_free_blocks", ())] == spec_server.initial_free_blocks
    assert after[("eaglet:kv_cache_total_blocks", ())] == spec_server.initial_free_blocks
    assert after[("eaglet:kv_cache_usage_perc", ())] == 0.0
    aborted = ("eaglet:request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) - before.get(aborted, 0) == len(leaving)  # cut short, not run to the end
    assert spec_server.engine.requests == {}


def test_non_streaming_client_that_leaves_is_aborted(spec_server, monkeypatch) -> None:
    # Each engine step is held back so the answer cannot be done before the client leaves, however fast decoding is.
    engine_step = spec_server.engine.step

    def slow_step():
        time.sleep(0.02)
        return engine_step()

    monkeypatch.setattr(spec_server.engine, "step", slow_step)
    before = spec_server.metrics()
    body = _body(messages=user("A long answer, please."), max_tokens=220, n=4, ignore_eos=True, temperature=0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{spec_server.base_url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.25))
    aborted = ("eaglet:request_success_total", (("finished_reason", "abort"),))
    deadline = time.monotonic() + 20
    while spec_server.metrics().get(aborted, 0) - before.get(aborted, 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = spec_server.metrics()
    assert after.get(aborted, 0) - before.get(aborted, 0) == 4
    assert after[("eaglet:num_requests_running", ())] == 0
    assert after[("eaglet:kv_cache_free_blocks", ())] == spec_server.initial_free_blocks


def test_metrics_agree_with_responses(spec_server) -> None:
    before = spec_server.metrics()
    totals = {"verify_steps": 0, "accepted_tokens": 0}
    completion_tokens = 0
    for i in range(3):
        result = chat(spec_server, user(f"Metrics {i}"), max_tokens=16, **GREEDY)
        completion_tokens += result.usage.completion_tokens
        for key in totals:
            totals[key] += result.choices[0].model_extra["speculative"][key]
    _, chunks = stream_chat(spec_server, user("Metrics stream"), n=2, max_tokens=16,
                            stream_options={"include_usage": True}, **GREEDY)
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                for key in totals:
                    totals[key] += choice.model_extra["speculative"][key]
    completion_tokens += chunks[-1].usage.completion_tokens
    after = spec_server.metrics()

    def delta(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert totals["verify_steps"] > 0
    assert delta("eaglet:spec_decode_num_drafts_total") == totals["verify_steps"]
    assert delta("eaglet:spec_decode_num_accepted_tokens_total") == totals["accepted_tokens"]
    # At most 3 drafts (4 draft tokens - root) per verify step: fewer where a round was cut by its request's finish.
    assert totals["accepted_tokens"] <= delta("eaglet:spec_decode_num_draft_tokens_total") <= 3 * totals["verify_steps"]
    per_position = [delta("eaglet:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),)) for p in range(3)]
    assert sum(per_position) == totals["accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)  # position k accepted only after k - 1
    assert delta("eaglet:generation_tokens_total") == completion_tokens
    assert delta("eaglet:time_to_first_token_seconds_count") == 5
    assert delta("eaglet:e2e_request_latency_seconds_count") == 5
    assert after[("eaglet:spec_decode_mean_accept_length", ())] >= 1.0
    assert 0.0 <= after[("eaglet:prefix_cache_hit_rate", ())] <= 1.0


def test_stats_log_line(spec_server, caplog) -> None:
    with caplog.at_level("INFO", logger="eaglet.stats"):
        chat(spec_server, user("Log me."), max_tokens=8, **GREEDY)
    lines = [r.getMessage() for r in caplog.records if r.name == "eaglet.stats"]
    assert lines, "no stats line logged"
    assert all(k in lines[-1] for k in ("#running-req", "#waiting-req", "cache usage", "gen throughput", "accept len"))


# ---- bad input -----------------------------------------------------------------------------


def _body(**overrides) -> dict:
    body = {"model": MODEL, "messages": user("hi"), "max_tokens": 2}
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()
_RANDOM_BYTES_B64 = base64.b64encode(bytes(range(256)) * 4).decode()

BAD_REQUESTS = [
    # (id, path, raw body or JSON, status, words the message must hold)
    ("bad-json", "chat", b'{"model": "echo-kimi", "messages": [', 400, "not valid json"),
    ("not-an-object", "chat", b"[1, 2, 3]", 400, "json object"),
    ("missing-messages", "chat", _body(messages=_DROP), 400, "messages"),
    ("empty-messages", "chat", _body(messages=[]), 400, "messages"),
    ("bad-role", "chat", _body(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("content-wrong-type", "chat", _body(messages=[{"role": "user", "content": 42}]), 400, "content"),
    ("unknown-part-type", "chat", _body(messages=[{"role": "user", "content": [{"type": "audio"}]}]), 400, "content"),
    ("unknown-model", "chat", _body(model="gpt-17"), 404, "gpt-17"),
    ("missing-model", "chat", _body(model=_DROP), 400, "model"),
    ("temperature-string", "chat", _body(temperature="hot"), 400, "temperature"),
    ("temperature-negative", "chat", _body(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", "chat", _body(top_p=0), 400, "top_p"),
    ("top-k-zero", "chat", _body(top_k=0), 400, "top_k"),
    ("max-tokens-zero", "chat", _body(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-float", "chat", _body(max_tokens=1.5), 400, "max_tokens"),
    ("max-tokens-bool", "chat", _body(max_tokens=True), 400, "max_tokens"),
    ("max-tokens-over-context", "chat", _body(max_tokens=100_000), 400, "context length"),
    ("n-too-large", "chat", _body(n=50), 400, "n must be at most 4"),
    ("n-zero", "chat", _body(n=0), 400, "n"),
    ("seed-string", "chat", _body(seed="abc"), 400, "seed"),
    ("presence-penalty-range", "chat", _body(presence_penalty=3), 400, "presence_penalty"),
    ("stream-not-bool", "chat", _body(stream="yes"), 400, "stream"),
    ("top-logprobs-without-logprobs", "chat", _body(top_logprobs=2), 400, "top_logprobs"),
    ("top-logprobs-too-many", "chat", _body(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("logit-bias-bad-key", "chat", _body(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-out-of-vocab", "chat", _body(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("logit-bias-value-range", "chat", _body(logit_bias={"5": 500}), 400, "logit_bias"),
    ("empty-stop-string", "chat", _body(stop=[""]), 400, "stop"),
    ("min-tokens-over-max", "chat", _body(min_tokens=5), 400, "min_tokens"),
    ("prompt-too-long", "chat", _body(messages=user("word " * 400), max_tokens=_DROP), 400, "context"),
    ("bad-base64", "chat", _body(messages=user("x", "data:image/png;base64,@@@notbase64@@@")), 400, "base64"),
    ("undecodable-image", "chat", _body(messages=user("x", f"data:image/png;base64,{_RANDOM_BYTES_B64}")), 400, "decode"),
    ("gif-media-type", "chat", _body(messages=user("x", "data:image/gif;base64,R0lGODlhAQABAAAAACw=")), 400, "media type"),
    ("not-base64-data-url", "chat", _body(messages=user("x", "data:image/png,rawbytes")), 400, "base64"),
    ("remote-url-refused", "chat", _body(messages=user("x", "https://example.com/cat.png")), 400, "remote image urls"),
    ("local-path-refused", "chat", _body(messages=user("x", "/etc/hostname")), 400, "local image paths"),
    ("file-url-refused", "chat", _body(messages=user("x", "file:///etc/hostname")), 400, "local image paths"),
    ("too-many-images", "chat", _body(messages=user("x", *[data_url(8, 8, i) for i in range(4)])), 400, "4 images"),
    ("too-many-pixels", "chat", _body(messages=user("x", data_url(300, 300, 0))), 400, "pixels"),
    # A raw prompt's special-token text is parsed (chat messages' is not): a placeholder without its image.
    ("placeholder-without-image", "completions", {"model": MODEL, "prompt": "<|media_pad|>"}, 400, "placeholder"),
    ("body-too-large", "chat", _body(messages=user("x" * (MAX_REQUEST_BYTES + 10))), 413, "exceeds the limit"),
    ("completion-missing-prompt", "completions", {"model": MODEL}, 400, "prompt"),
    ("completion-prompt-wrong-type", "completions", {"model": MODEL, "prompt": 123}, 400, "prompt"),
    ("completion-empty-prompt", "completions", {"model": MODEL, "prompt": ""}, 400, "prompt is empty"),
    ("completion-empty-ids", "completions", {"model": MODEL, "prompt": []}, 400, "empty list"),
    ("completion-ids-out-of-vocab", "completions", {"model": MODEL, "prompt": [1, 999_999]}, 400, "out of range"),
    ("completion-negative-id", "completions", {"model": MODEL, "prompt": [1, -3]}, 400, "prompt"),
    ("completion-logprobs-range", "completions", {"model": MODEL, "prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("completion-batch-bad-item", "completions", {"model": MODEL, "prompt": ["a", 1]}, 400, "prompt.1"),
    ("completion-batch-bad-id", "completions", {"model": MODEL, "prompt": [[1, 2], [3, -4]]}, 400, "prompt.1.1"),
    ("completion-batch-empty-ids", "completions", {"model": MODEL, "prompt": [[1], []]}, 400, "empty list"),
    ("completion-too-many-prompts", "completions", {"model": MODEL, "prompt": ["a"] * 65}, 400, "the limit is 64"),
    ("completion-ids-over-context", "completions", {"model": MODEL, "prompt": [1] * 300_000}, 400, "context holds"),
    # Bodies Python's json module takes and something later chokes on (500 before): a lone UTF-16
    # surrogate cannot be encoded again, deep nesting exhausts the stack, NaN is not JSON.
    ("lone-surrogate-in-content", "chat",
     b'{"model": "echo-kimi", "messages": [{"role": "user", "content": "x\\ud800y"}]}', 400, "surrogate pair"),
    ("lone-low-surrogate-in-model", "chat",
     b'{"model": "\\udc00", "messages": [{"role": "user", "content": "x"}]}', 400, "surrogate pair"),
    ("lone-surrogate-in-prompt", "completions", b'{"model": "echo-kimi", "prompt": "a\\ud83d"}', 400, "surrogate pair"),
    ("deeply-nested", "chat", b'{"model": "echo-kimi", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "nested too deeply"),
    ("nan", "chat", b'{"model": "echo-kimi", "messages": [], "temperature": NaN}', 400, "not valid json"),
    ("infinite-number", "chat",
     b'{"model": "echo-kimi", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e400}', 400,
     "finite number"),
    ("invalid-utf8", "chat", b'{"model": "echo-\xff"}', 400, "not valid json"),
    ("top-k-over-int64", "chat", _body(top_k=2**64), 400, "top_k"),
]


@pytest.mark.parametrize("path,body,status,words", [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(spec_server, path: str, body, status: int, words: str) -> None:
    url = f"{spec_server.base_url}/v1/{'chat/completions' if path == 'chat' else 'completions'}"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    else:
        response = httpx.post(url, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert words in error["message"].lower() or words in error["message"], error
    # The server carries on: healthy, and a good request is served.
    assert httpx.get(f"{spec_server.base_url}/health").status_code == 200
    assert chat(spec_server, user("still fine?"), max_tokens=2).choices[0].finish_reason in ("length", "stop")


def test_bad_request_names_the_field(spec_server) -> None:
    response = httpx.post(f"{spec_server.base_url}/v1/chat/completions",
                          json=_body(messages=[{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]))
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages.1.role"
    response = httpx.post(f"{spec_server.base_url}/v1/chat/completions", json=_body(temperature="warm"))
    assert response.json()["error"]["param"] == "temperature"


def test_tiny_temperature_is_sampled_not_a_500(spec_server) -> None:
    # Logits divided by 1e-320 overflow to inf; the server raises such a temperature to 0.01, as vLLM.
    result = chat(spec_server, user("Hi"), max_tokens=4, temperature=1e-320, seed=3)
    assert result.usage.completion_tokens >= 1


def test_engine_failure_is_a_500_and_the_server_goes_on(plain_server, monkeypatch) -> None:
    poison = 77  # prompts starting with this token make the model runner raise
    runner = plain_server.engine.runner
    extend = runner.extend

    def faulty_extend(requests, num_new, **kwargs):
        if any(r.prompt_token_ids[0] == poison for r in requests):
            raise RuntimeError("injected fault")
        return extend(requests, num_new, **kwargs)

    monkeypatch.setattr(runner, "extend", faulty_extend)
    url = f"{plain_server.base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for stream in (False, True):
        body = {"model": MODEL, "prompt": [poison, 5, 6], "max_tokens": 4, "stream": stream}
        response = httpx.post(url, json=body, headers=headers, timeout=30)
        assert response.status_code == 500 and "injected fault" in response.json()["error"]["message"]
    good = plain_server.client().completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, **GREEDY)
    assert good.usage.completion_tokens == 4
    assert plain_server.metrics()[("eaglet:kv_cache_free_blocks", ())] == plain_server.initial_free_blocks


def test_unknown_route_and_method(spec_server) -> None:
    assert httpx.get(f"{spec_server.base_url}/v1/nothing").status_code == 404
    response = httpx.get(f"{spec_server.base_url}/v1/chat/completions")
    assert response.status_code == 405 and "error" in response.json()
