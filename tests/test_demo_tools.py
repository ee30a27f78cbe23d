"""The bundled demo model calls the count_shapes tool and thinks, through a live server with
speculation on (its EAGLE-3 draft, as ``eaglet serve`` runs it by default) and the official
``openai`` client: a two-turn tool conversation on a rendered scene whose count the test works out
from the scene itself, streamed and not, and the thinking section on and off per request.
"""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Iterator

import pytest
from test_server import LiveServer, serve
from test_tool_calls_server import answer
from transformers import AutoTokenizer

from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR, demo_model_available
from eaglet.engine.engine import Engine, EngineConfig
from eaglet.server import ServerConfig
from eaglet.server.chat import render_chat_prompt, template_messages, template_tools
from eaglet.server.protocol import ChatMessage, ToolDefinition
from eaglet.testing import demo_task, scenes

MODEL = "eaglet-demo"
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}

pytestmark = pytest.mark.skipif(not demo_model_available(), reason="the demo model is not built")


def image_part(scene: scenes.Scene) -> dict:
    buffer = io.BytesIO()
    scenes.render_scene(scene).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def scene_with_colour() -> tuple[scenes.Scene, str]:
    """A fixed fresh scene and a colour in it (so the tool's answer is not 0)."""
    rng = random.Random("test-demo-tools")
    scene = next(s for s in (scenes.random_scene(rng) for _ in range(100)) if len(s.objects) >= 2)
    return scene, scene.objects[1].colour


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = Engine(EngineConfig(
        model=str(DEMO_TARGET_DIR), dtype="float32", show_progress=False, speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(DEMO_DRAFT_DIR), speculative_num_steps=3, speculative_eagle_topk=1,
        speculative_num_draft_tokens=4, speculative_adaptive=False))
    yield from serve(engine, ServerConfig(model_name=MODEL))


def chat(server: LiveServer, messages: list[dict], **kwargs):
    kwargs.setdefault("max_tokens", 64)
    return server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0.0, **kwargs)


def streamed(server: LiveServer, messages: list[dict], **kwargs) -> dict:
    """The stream joined up as a client joins it, in answer()'s form."""
    content, reasoning, calls, finish = "", "", [], []
    for chunk in chat(server, messages, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    calls.append({"id": call.id, "name": call.function.name, "arguments": call.function.arguments or ""})
                else:
                    calls[call.index]["arguments"] += call.function.arguments
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    assert len(finish) == 1
    return {"content": content or None, "reasoning_content": reasoning or None, "tool_calls": calls,
            "finish_reason": finish[0]}


def test_demo_task_prompts_are_the_templates() -> None:
    """The prompts the demo was trained on are what the server renders."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET_DIR))
    scene, colour = scene_with_colour()
    question = demo_task.tool_question(colour, random.Random(0))
    call = {"id": demo_task.TOOL_CALL_ID, "type": "function",
            "function": {"name": "count_shapes", "arguments": json.dumps({"color": colour})}}
    tools = template_tools([ToolDefinition.model_validate(demo_task.COUNT_SHAPES_TOOL)])
    user = {"role": "user", "content": [image_part(scene), {"type": "text", "text": question}]}
    for thinking in (True, False):
        kwargs = {} if thinking else {"thinking": False}
        cases = [
            ([user], tools, demo_task.user_prompt(question, with_image=True, thinking=thinking, tools=True)),
            ([user, {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "tool_call_id": demo_task.TOOL_CALL_ID, "content": "1"}], tools,
             demo_task.tool_result_prompt(question, colour, "1", thinking=thinking)),
        ]
        for messages, with_tools, expected in cases:
            rendered, _ = template_messages([ChatMessage.model_validate(m) for m in messages])
            assert render_chat_prompt(tokenizer, rendered, with_tools, kwargs) == expected


@pytest.mark.parametrize("template", [{}, NO_THINKING], ids=["thinking", "no-thinking"])
def test_two_turn_tool_conversation(server: LiveServer, template: dict) -> None:
    scene, colour = scene_with_colour()
    count = demo_task.count_colour(scene, colour)
    question = f"How many {colour} shapes are there? Use the tool."
    messages = [{"role": "user", "content": [image_part(scene), {"type": "text", "text": question}]}]
    tools = [demo_task.COUNT_SHAPES_TOOL]

    first = chat(server, messages, tools=tools, extra_body=template)
    full = answer(first)
    assert full["finish_reason"] == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "count_shapes" and call.id == demo_task.TOOL_CALL_ID
    assert json.loads(call.function.arguments) == {"color": colour}
    if template:
        assert "reasoning_content" not in first.choices[0].message.model_extra
    else:
        assert full["reasoning_content"] and "count_shapes" in full["reasoning_content"]
    assert streamed(server, messages, tools=tools, extra_body=template) == full

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": str(count)},
    ]
    second = chat(server, messages, tools=tools, extra_body=template)
    final = answer(second)
    assert final["finish_reason"] == "stop" and not final["tool_calls"]
    assert final["content"] == demo_task.tool_answer(colour, str(count))
    assert (final["reasoning_content"] is None) == bool(template)
    assert streamed(server, messages, tools=tools, extra_body=template) == final


def test_thinking_on_and_off_for_a_scene_question(server: LiveServer) -> None:
    scene, _ = scene_with_colour()
    qa = scenes.question_about(scene, "shape", random.Random(1))
    messages = [{"role": "user", "content": [image_part(scene), {"type": "text", "text": qa.question}]}]
    thinking = answer(chat(server, messages))
    assert thinking["reasoning_content"] and thinking["content"] == qa.answer
    plain = chat(server, messages, extra_body=NO_THINKING)
    assert "reasoning_content" not in plain.choices[0].message.model_extra
    assert plain.choices[0].message.content == qa.answer
