"""The demo model's task: scene questions, "continue the text" requests and the ``count_shapes``
tool (a call, then an answer from the tool's result), each with Kimi-K2.5's thinking on or off, in
its chat format; the training mix, and held-out prompt sets drawn from RNG streams training never
uses.

tools/demo trains and evaluates on it; the bench times the demo on its held-out prompts. The
prompt builders here spell out what the demo tokenizer's chat template (``KIMI_K25_TOOLS_TEMPLATE``)
renders, so training does not need jinja for every example; tests/test_demo_tools.py checks that
they agree with the server's rendering.
"""

from __future__ import annotations

import json
import random
from typing import Any

from eaglet.server.kimi_k2_output import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_CLOSE,
    THINK_OPEN,
)
from eaglet.testing import scenes
from eaglet.testing.docs_corpus import docs_paragraphs
from eaglet.testing.tool_checkpoints import KIMI_K25_TOOLS_TEMPLATE

CHAT_TEMPLATE = KIMI_K25_TOOLS_TEMPLATE

# Relative frequencies of the training tasks ("tool_call": the first turn of a count_shapes
# request, which calls the tool; "tool_answer": the turn after the tool's result).
TASK_WEIGHTS = {"describe": 4, "colour": 3, "shape": 3, "position": 3, "count": 1, "docs": 1,
                "tool_call": 3, "tool_answer": 3}
SCENE_TASKS = ("describe", "colour", "shape", "position", "count")
TOOL_TASKS = ("tool_call", "tool_answer")
DOCS_PROMPT_CHARS = 100
DOCS_ANSWER_CHARS = 120

COUNT_SHAPES_TOOL = {
    "type": "function",
    "function": {
        "name": "count_shapes",
        "description": "Count the shapes of one colour in the image.",
        "parameters": {
            "type": "object",
            "properties": {"color": {"type": "string", "description": "a colour name, e.g. red"}},
            "required": ["color"],
        },
    },
}
TOOL_CALL_ID = "functions.count_shapes:0"
TOOL_QUESTIONS = (
    "How many {colour} shapes are there? Use the tool.",
    "Use the count_shapes tool: how many {colour} shapes are in the image?",
    "Count the {colour} shapes with the tool.",
)
MEDIA = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


def tools_turn(tools: list[dict[str, Any]] | None = None) -> str:
    """The template's tool_declare system turn (tojson with compact separators)."""
    tools = [COUNT_SHAPES_TOOL] if tools is None else tools
    return f"<|im_system|>tool_declare<|im_middle|>{json.dumps(tools, separators=(',', ':'))}<|im_end|>"


def generation_prompt(thinking: bool) -> str:
    return "<|im_assistant|>assistant<|im_middle|>" + (THINK_OPEN if thinking else THINK_OPEN + THINK_CLOSE)


def user_turn(question: str, *, with_image: bool) -> str:
    return f"<|im_user|>user<|im_middle|>{MEDIA if with_image else ''}{question}<|im_end|>"


def user_prompt(question: str, *, with_image: bool, thinking: bool = False, tools: bool = False) -> str:
    """The template's rendering of one user turn plus the generation prompt: thinking off (the
    prompt ends with ``<think></think>``) unless ``thinking``; ``tools`` declares count_shapes."""
    return (tools_turn() if tools else "") + user_turn(question, with_image=with_image) + generation_prompt(thinking)


def tool_call_text(colour: str) -> str:
    """The assistant's count_shapes call, as the model writes it (after any thinking)."""
    arguments = json.dumps({"color": colour})
    return f"{SECTION_BEGIN}{CALL_BEGIN}{TOOL_CALL_ID}{ARGUMENT_BEGIN}{arguments}{CALL_END}{SECTION_END}"


def tool_result_prompt(question: str, colour: str, result: str, *, thinking: bool = False,
                       reasoning: str | None = None) -> str:
    """The second turn's prompt: the request, the assistant's call (its reasoning rendered when the
    client sends it back and thinking is on), the tool's result, the generation prompt."""
    think = f"{THINK_OPEN}{reasoning if thinking and reasoning else ''}{THINK_CLOSE}"
    return (tools_turn() + user_turn(question, with_image=True)
            + f"<|im_assistant|>assistant<|im_middle|>{think}{tool_call_text(colour)}<|im_end|>"
            + f"<|im_system|>tool<|im_middle|>## Return of {TOOL_CALL_ID}\n{result}<|im_end|>"
            + generation_prompt(thinking))


def tool_answer(colour: str, result: str) -> str:
    """The answer to a count_shapes request once the tool has said ``result``."""
    if result.strip() == "1":
        return f"There is 1 {colour} shape."
    return f"There are {result.strip()} {colour} shapes."


def count_colour(scene: scenes.Scene, colour: str) -> int:
    """What count_shapes returns for the scene."""
    return sum(obj.colour == colour for obj in scene.objects)


def reasoning_for(kind: str, scene: scenes.Scene | None = None, question: str = "", colour: str = "",
                  result: str = "") -> str:
    """The short thinking sentence the demo writes before answering (thinking on)."""
    if kind == "tool_call":
        return f"The user wants the number of {colour} shapes, so I call count_shapes."
    if kind == "tool_answer":
        return f"The count_shapes tool returned {result.strip()}."
    if kind == "docs":
        return "The user wants the text continued."
    if kind == "describe":
        return "The user wants a description of the image."
    if kind == "count":
        return "I count the shapes in the image."
    words = question.rstrip("?").split()
    if kind == "colour":  # What colour is the SHAPE?
        return f"The question asks for the colour of the {words[-1]}."
    if kind == "shape":  # What shape is the COLOUR object?
        return f"The question asks for the shape of the {words[-2]} object."
    if kind == "position":  # Where is the COLOUR SHAPE?
        return f"The question asks where the {words[-2]} {words[-1]} is."
    raise ValueError(f"unknown task kind {kind!r}")


def with_reasoning(reasoning: str, answer: str, thinking: bool) -> str:
    """What the model writes after the generation prompt."""
    return f"{reasoning}{THINK_CLOSE}{answer}" if thinking else answer


def tool_question(colour: str, rng: random.Random) -> str:
    return rng.choice(TOOL_QUESTIONS).format(colour=colour)


def docs_prompt_and_answer(docs: list[str], rng: random.Random) -> tuple[str, str]:
    """A "continue the text" request on a random docs paragraph and its true continuation, both
    cut at spaces."""
    paragraph = rng.choice(docs)
    if len(paragraph) > DOCS_PROMPT_CHARS + 40:
        start = rng.randrange(0, max(1, len(paragraph) - DOCS_PROMPT_CHARS - DOCS_ANSWER_CHARS))
        start = paragraph.rfind(" ", 0, start) + 1 if start else 0
        split = paragraph.find(" ", start + DOCS_PROMPT_CHARS)
        split = split if split != -1 else start + DOCS_PROMPT_CHARS
        head, tail = paragraph[start:split], paragraph[split:split + DOCS_ANSWER_CHARS]
    else:
        half = paragraph.find(" ", len(paragraph) // 2)
        head, tail = paragraph[:half], paragraph[half:]
    cut = tail.rfind(" ")
    tail = tail if len(tail) < DOCS_ANSWER_CHARS or cut <= 0 else tail[:cut]
    return f"Continue the text:\n{head}", tail


def tool_request(rng: random.Random) -> tuple[scenes.Scene, str, str]:
    """A scene, a colour to count (one in the scene two times in three) and the question."""
    scene = scenes.random_scene(rng)
    if rng.random() < 2 / 3:
        colour = rng.choice(scene.objects).colour
    else:
        colour = rng.choice(sorted(scenes.COLOURS))
    return scene, colour, tool_question(colour, rng)


def held_out_tool_items(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Held-out count_shapes requests: scene, colour, question, and the tool's true result."""
    rng = random.Random(f"held-out-tools-{seed}")
    items = []
    for _ in range(count):
        scene, colour, question = tool_request(rng)
        items.append({"scene": scene, "colour": colour, "question": question,
                      "result": str(count_colour(scene, colour))})
    return items


def held_out_prompts(count: int, seed: int = 0, kinds: tuple[str, ...] | None = None,
                     thinking: bool | None = False) -> list[dict[str, Any]]:
    """Held-out prompts in the training task mix (scene questions of every type, docs
    continuations, count_shapes calls and answers; or only ``kinds``), for acceptance
    measurements. Thinking off unless ``thinking`` (None: on for about half, drawn)."""
    rng = random.Random(f"held-out-prompts-{seed}-{kinds}" if kinds else f"held-out-prompts-{seed}")
    kinds = list(kinds or TASK_WEIGHTS)
    docs = docs_paragraphs() if "docs" in kinds else []  # reading the docs draws nothing from rng
    prompts = []
    for _ in range(count):
        kind = rng.choices(kinds, weights=[TASK_WEIGHTS[k] for k in kinds])[0]
        think = rng.random() < 0.5 if thinking is None else thinking
        if kind == "docs":
            prompt, _ = docs_prompt_and_answer(docs, rng)
            prompts.append({"prompt": user_prompt(prompt, with_image=False, thinking=think)})
        elif kind in TOOL_TASKS:
            scene, colour, question = tool_request(rng)
            if kind == "tool_call":
                text = user_prompt(question, with_image=True, thinking=think, tools=True)
            else:
                text = tool_result_prompt(question, colour, str(count_colour(scene, colour)), thinking=think)
            prompts.append({"prompt": text, "images": [scenes.render_scene(scene)]})
        else:
            scene = scenes.random_scene(rng)
            qa = scenes.question_about(scene, kind, rng)
            prompts.append({"prompt": user_prompt(qa.question, with_image=True, thinking=think),
                            "images": [scenes.render_scene(scene)]})
    return prompts
