"""Synthetic scenes: a few coloured shapes at named positions, drawn with PIL, and templated
questions, answers and descriptions whose text is fully determined by the scene."""

from __future__ import annotations

import random
from dataclasses import dataclass

import PIL.Image
import PIL.ImageDraw

IMAGE_SIZE = 112
BACKGROUND = (245, 245, 240)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
# Centre of each named position, as fractions of the image side.
POSITIONS: dict[str, tuple[float, float]] = {
    "left": (0.2, 0.5),
    "right": (0.8, 0.5),
    "top": (0.5, 0.2),
    "bottom": (0.5, 0.8),
    "center": (0.5, 0.5),
}
POSITION_PHRASES = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "center": "in the center",
}
NUMBER_WORDS = {1: "one", 2: "two", 3: "three"}
MAX_OBJECTS = 3
QUESTION_TYPES = ("colour", "shape", "position", "count", "describe")


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    position: str


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    jitter: tuple[tuple[int, int], ...]  # pixel offset of each object from its position's centre
    size: tuple[int, ...]  # half-extent of each object in pixels


@dataclass(frozen=True)
class SceneQuestion:
    kind: str  # one of QUESTION_TYPES
    question: str
    answer: str


def random_scene(rng: random.Random) -> Scene:
    """1-3 objects with distinct shapes, distinct colours and distinct positions, so every
    question below has exactly one right answer."""
    n = rng.randint(1, MAX_OBJECTS)
    shapes = rng.sample(SHAPES, n)
    colours = rng.sample(sorted(COLOURS), n)
    positions = rng.sample(sorted(POSITIONS), n)
    objects = tuple(SceneObject(s, c, p) for s, c, p in zip(shapes, colours, positions))
    jitter = tuple((rng.randint(-4, 4), rng.randint(-4, 4)) for _ in range(n))
    size = tuple(rng.randint(12, 16) for _ in range(n))
    return Scene(objects, jitter, size)


def render_scene(scene: Scene) -> PIL.Image.Image:
    image = PIL.Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = PIL.ImageDraw.Draw(image)
    for obj, (dx, dy), r in zip(scene.objects, scene.jitter, scene.size):
        fx, fy = POSITIONS[obj.position]
        cx, cy = fx * IMAGE_SIZE + dx, fy * IMAGE_SIZE + dy
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif obj.shape == "square":
            s = r * 0.85
            draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
        elif obj.shape == "triangle":
            draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=fill)
        elif obj.shape == "diamond":
            draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
        else:
            raise ValueError(f"unknown shape {obj.shape!r}")
    return image


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def describe(scene: Scene) -> str:
    """The whole scene in one templated sentence, objects in reading order (top to bottom, left
    to right by position centre)."""
    order = sorted(scene.objects, key=lambda o: (POSITIONS[o.position][1], POSITIONS[o.position][0]))
    parts = [f"{_article(o.colour)} {o.colour} {o.shape} {POSITION_PHRASES[o.position]}" for o in order]
    n = len(parts)
    if n == 1:
        return f"The image shows one shape: {parts[0]}."
    listed = ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"The image shows {NUMBER_WORDS[n]} shapes: {listed}."


def question_about(scene: Scene, kind: str, rng: random.Random) -> SceneQuestion:
    obj = rng.choice(scene.objects)
    if kind == "colour":
        return SceneQuestion(kind, f"What colour is the {obj.shape}?", f"The {obj.shape} is {obj.colour}.")
    if kind == "shape":
        return SceneQuestion(
            kind, f"What shape is the {obj.colour} object?", f"The {obj.colour} object is {_article(obj.shape)} {obj.shape}."
        )
    if kind == "position":
        return SceneQuestion(
            kind, f"Where is the {obj.colour} {obj.shape}?", f"The {obj.colour} {obj.shape} is {POSITION_PHRASES[obj.position]}."
        )
    if kind == "count":
        n = len(scene.objects)
        noun = "shape" if n == 1 else "shapes"
        return SceneQuestion(kind, "How many shapes are there?", f"There {'is' if n == 1 else 'are'} {NUMBER_WORDS[n]} {noun}.")
    if kind == "describe":
        return SceneQuestion(kind, rng.choice(("Describe the image.", "What is in the picture?")), describe(scene))
    raise ValueError(f"unknown question kind {kind!r}")


def answer_matches(kind: str, expected: str, generated: str) -> bool:
    """A generated answer is right when its first sentence equals the templated one."""
    return generated.strip().split("\n")[0].strip() == expected
