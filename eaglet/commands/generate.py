"""``eaglet generate``: one prompt (optionally with images) to completion; prints the text, then
the speculation statistics (accept length, verify steps) and the decode speed on stderr."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from eaglet.commands.model_args import add_model_arguments, add_sampling_arguments, configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message (or the raw prompt with --raw)")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="an image file to attach (repeatable; needs a vision model)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_sampling_arguments(parser)
    add_model_arguments(parser, default_log_level="warning")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    from eaglet.commands.model_args import build_engine, sampling_params

    params = sampling_params(args)
    images = load_images(args.image)
    engine = build_engine(args, show_progress=False)
    if args.raw:
        if images:
            raise SystemExit("eaglet: --image needs the chat template (leave out --raw)")
        prompt: Any = args.prompt
    else:
        content: list[dict[str, Any]] = [image_part() for _ in images] + [{"type": "text", "text": args.prompt}]
        prompt = chat_prompt(engine, [{"role": "user", "content": content if images else args.prompt}], images)
    out, seconds = generate(engine, prompt, params, on_text=lambda delta: print(delta, end="", flush=True))
    print()
    print(stats_line(out, seconds), file=sys.stderr)
    return 0


def image_part() -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "<image>"}}


def load_images(paths: list[str]) -> list:  # -> list[PIL.Image.Image]
    from eaglet.errors import ImageError
    from eaglet.multimodal.image_processor import load_image

    images = []
    for path in paths:
        try:
            with open(path, "rb") as file:
                images.append(load_image(file.read()))
        except OSError as exc:
            raise SystemExit(f"eaglet: cannot read image {path!r}: {exc.strerror or exc}") from exc
        except ImageError as exc:
            raise SystemExit(f"eaglet: {path}: {exc}") from exc
    return images


def chat_prompt(engine, messages: list[dict[str, Any]], images: list) -> dict[str, Any]:
    from eaglet.errors import InvalidRequestError
    from eaglet.server.chat import render_chat_prompt

    if images and engine.image_processor is None:
        raise SystemExit("eaglet: this model has no vision tower; it cannot take --image")
    try:
        return {"prompt": render_chat_prompt(engine.tokenizer, messages), "images": list(images)}
    except InvalidRequestError as exc:
        raise SystemExit(f"eaglet: {exc}") from exc


def generate(engine, prompt: Any, params, on_text: Callable[[str], None] | None = None):
    """Runs one request alone; returns its final RequestOutput and the seconds from admission to finish."""
    from eaglet.errors import InvalidRequestError

    start = time.perf_counter()
    try:
        request_id = engine.add_request(prompt, params)
    except InvalidRequestError as exc:
        raise SystemExit(f"eaglet: {exc}") from exc
    shown = ""
    while True:
        for out in engine.step(stream_text=on_text is not None):
            if out.request_id != request_id:
                continue
            text = out.text or ""
            if on_text is not None and len(text) > len(shown):
                on_text(text[len(shown) :])
                shown = text
            if out.finished:
                return out, time.perf_counter() - start


def stats_line(out, seconds: float) -> str:
    num_tokens = len(out.token_ids)
    speed = num_tokens / max(seconds, 1e-9)
    line = f"[eaglet] {num_tokens} tokens in {seconds:.2f} s ({speed:.1f} tokens/s), finish: {out.finish_reason}"
    if out.spec_verify_ct:
        accept_length = (out.spec_accepted_tokens + out.spec_verify_ct) / out.spec_verify_ct
        line += (f"; accept length {accept_length:.2f} over {out.spec_verify_ct} verify steps "
                 f"({out.spec_accepted_tokens} accepted draft tokens)")
    return line
