"""The speculative shapes a bench run drafts: (num_steps, eagle_topk, num_draft_tokens) per mode."""

from __future__ import annotations

import argparse

from eaglet.errors import ConfigError
from eaglet.spec.config import SpeculativeConfig

Shape = tuple[int, int, int]

# ``adaptive`` is the deepest shape the adaptive policy may draft; it picks the depth per batch
# size (eaglet.spec.policy), the engine's default. ``adaptive-tree`` is the engine's default for
# the tree shape: the policy may also draft chains.
SPEC_SHAPES: dict[str, Shape] = {"chain": (3, 1, 4), "tree": (4, 2, 8), "adaptive": (7, 1, 8), "adaptive-tree": (4, 2, 8)}
# The demo's trained draft accepts every token of a depth-7 chain on its task (accept length 7.00,
# the cap), so its adaptive mode may draft deeper; on the echo checkpoints acceptance falls with
# depth, and exploring levels up to 15 costs more in 32-token runs than it finds.
DEMO_ADAPTIVE_SHAPE: Shape = (15, 1, 16)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def spec_shapes(args: argparse.Namespace, checkpoint: str | None = None) -> dict[str, Shape]:
    """The speculative shapes of this run (--chain-shape / --tree-shape / --adaptive-shape /
    --adaptive-tree-shape, else SPEC_SHAPES; the demo's adaptive mode DEMO_ADAPTIVE_SHAPE)."""
    shapes = dict(SPEC_SHAPES)
    if checkpoint == "demo":
        shapes["adaptive"] = DEMO_ADAPTIVE_SHAPE
    for mode in shapes:
        text = getattr(args, f"{mode.replace('-', '_')}_shape", None)
        if text:
            values = parse_ints(text)
            if len(values) != 3 or min(values) < 1:
                raise SystemExit(f"--{mode}-shape takes num_steps,eagle_topk,num_draft_tokens, got {text!r}")
            try:  # the engine's own check (e.g. more draft tokens than the steps can propose)
                SpeculativeConfig("draft", num_steps=values[0], eagle_topk=values[1], num_draft_tokens=values[2])
            except ConfigError as exc:
                raise SystemExit(f"--{mode}-shape {text}: {exc}") from None
            shapes[mode] = (values[0], values[1], values[2])
    if shapes["chain"][1] != 1:
        raise SystemExit("--chain-shape drafts a chain: eagle_topk must be 1")
    return shapes


def shapes_record(shapes: dict[str, Shape]) -> dict[str, dict[str, int]]:
    """The shapes as the JSON record keeps them: {mode: {num_steps, eagle_topk, num_draft_tokens}}."""
    return {mode: dict(zip(("num_steps", "eagle_topk", "num_draft_tokens"), shape)) for mode, shape in shapes.items()}
