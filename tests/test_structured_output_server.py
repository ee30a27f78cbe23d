"""Structured output through a live server and the official ``openai`` client, on the demo model:
``response_format`` json_schema (20 prompts, validated with ``jsonschema``, with and without
speculation, streamed == non-streamed), json_object, ``tool_choice`` required / named giving
calls whose arguments validate against the tool's parameters, and 400 for a bad schema."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from test_server import LiveServer, serve

from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR, demo_model_available
from eaglet.engine.engine import Engine, EngineConfig
from eaglet.server import ServerConfig

pytestmark = pytest.mark.skipif(not demo_model_available(), reason="the demo model is not built")

MODEL = "demo"
SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square", "triangle", "star"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "where": {"type": "string", "maxLength": 20},
    },
    "required": ["shape", "count", "where"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True}}
QUESTIONS = [f"How many {c} shapes are in scene {i}? Answer in JSON." for i, c in enumerate(
    ["red", "green", "blue", "yellow", "purple"] * 4)]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
    "additionalProperties": False}}}
COUNT = {"type": "function", "function": {"name": "count_shapes", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
    "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, COUNT)}


# float32, as tests/test_structured_output.py: near-tied allowed tokens in text the demo model never
# saw must not flip between a request alone and one sharing its prompt's cached blocks.
def _server(draft: bool) -> Iterator[LiveServer]:
    spec = {}
    if draft:
        spec = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(DEMO_DRAFT_DIR),
                "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                "speculative_adaptive": False}
    engine = Engine(EngineConfig(model=str(DEMO_TARGET_DIR), dtype="float32", max_running_requests=48,
                                 show_progress=False, **spec))
    yield from serve(engine, ServerConfig(model_name=MODEL))


@pytest.fixture(scope="module", params=["plain", "speculative"])
def server(request) -> Iterator[LiveServer]:
    yield from _server(request.param == "speculative")


NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def _answer(client, messages: list[dict], stream: bool, **kwargs) -> dict:
    """The message as a client joins it up: content, tool calls (name, arguments), finish reason."""
    kwargs = {"model": MODEL, "messages": messages, "temperature": 0.0, "max_tokens": 96, **kwargs}
    if not stream:
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return {"content": choice.message.content or "", "calls": calls, "finish_reason": choice.finish_reason}
    content, calls, finish = "", [], None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content, "calls": [tuple(c) for c in calls], "finish_reason": finish}


def answers(server: LiveServer, requests: list[tuple[list[dict], dict]]) -> list[tuple[dict, dict]]:
    """Each request's (non-streamed, streamed) answer, all sent at once (one batch for the engine)."""
    async def run() -> list[dict]:
        client = server.async_client()
        jobs = [_answer(client, m, stream, **kw) for m, kw in requests for stream in (False, True)]
        return await asyncio.gather(*jobs)
    flat = asyncio.run(run())
    return list(zip(flat[::2], flat[1::2]))


def test_json_schema_answers_validate_and_stream_the_same(server: LiveServer) -> None:
    # Thinking off: the demo model thinks only about its own tasks (its thinking before JSON is free
    # text that may run past max_tokens); test_json_object below keeps thinking on.
    results = answers(server, [(user(q), {"response_format": RESPONSE_FORMAT, "extra_body": NO_THINKING})
                               for q in QUESTIONS])
    for whole, streamed in results:
        assert whole == streamed
        assert whole["finish_reason"] == "stop" and not whole["calls"]
        jsonschema.validate(json.loads(whole["content"]), SCHEMA)
    assert server.engine.num_free_blocks() == server.initial_free_blocks


def test_json_object(server: LiveServer) -> None:
    [(whole, streamed)] = answers(server, [(user("Describe the scene."), {"response_format": {"type": "json_object"}})])
    assert whole == streamed and isinstance(json.loads(whole["content"]), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "count_shapes"}}],
                         ids=["required", "named"])
def test_constrained_tool_choice_gives_calls_whose_arguments_validate(server: LiveServer, tool_choice) -> None:
    results = answers(server, [(user(q), {"tools": [WEATHER, COUNT], "tool_choice": tool_choice,
                                          "max_tokens": 128}) for q in QUESTIONS[:4]])
    for whole, streamed in results:
        assert whole == streamed and whole["finish_reason"] == "tool_calls" and whole["calls"]
        for name, arguments in whole["calls"]:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        if tool_choice != "required":
            assert [name for name, _ in whole["calls"]] == ["count_shapes"]


@pytest.mark.parametrize(
    ("response_format", "param", "message"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, None, "invalid JSON schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "needs a schema"),
        ({"type": "json_schema"}, "response_format.json_schema", "needs a json_schema"),
        ({"type": "xml"}, "response_format.type", "json_schema"),
    ],
)
def test_a_bad_response_format_is_a_400(server: LiveServer, response_format: dict, param: str | None, message: str) -> None:
    body = {"model": MODEL, "messages": user("hi"), "max_tokens": 4, "response_format": response_format}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
