"""The demo model's task: scene questions and "continue the text" requests in its chat format,
the training mix, and held-out prompt sets drawn from RNG streams training never uses.

tools/demo trains and evaluates on it; the bench times the demo on its held-out prompts.
"""

from __future__ import annotations

import random
from typing import Any

from eaglet.testing import scenes
from eaglet.testing.docs_corpus import docs_paragraphs
from eaglet.testing.kimi_template import CHAT_TEMPLATE

# Relative frequencies of the training tasks.
TASK_WEIGHTS = {"describe": 4, "colour": 3, "shape": 3, "position": 3, "count": 1, "docs": 1}
DOCS_PROMPT_CHARS = 100
DOCS_ANSWER_CHARS = 120


def user_prompt(question: str, *, with_image: bool) -> str:
    """CHAT_TEMPLATE's rendering of one user turn plus the generation prompt (kept in Python
    too so training does not need jinja for every example)."""
    image = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" if with_image else ""
    return f"<|im_user|>user<|im_middle|>{image}{question}<|im_end|><|im_assistant|>assistant<|im_middle|>"


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


def held_out_prompts(count: int, seed: int = 0, kinds: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Held-out prompts in the training task mix (scene questions of every type and docs
    continuations; or only ``kinds``), for acceptance measurements."""
    rng = random.Random(f"held-out-prompts-{seed}-{kinds}" if kinds else f"held-out-prompts-{seed}")
    kinds = list(kinds or TASK_WEIGHTS)
    docs = docs_paragraphs() if "docs" in kinds else []  # reading the docs draws nothing from rng
    prompts = []
    for _ in range(count):
        kind = rng.choices(kinds, weights=[TASK_WEIGHTS[k] for k in kinds])[0]
        if kind == "docs":
            prompt, _ = docs_prompt_and_answer(docs, rng)
            prompts.append({"prompt": user_prompt(prompt, with_image=False)})
        else:
            scene = scenes.random_scene(rng)
            qa = scenes.question_about(scene, kind, rng)
            prompts.append({"prompt": user_prompt(qa.question, with_image=True), "images": [scenes.render_scene(scene)]})
    return prompts
