"""``eaglet chat``: an interactive terminal chat keeping the conversation; ``/image PATH`` attaches
an image to the next message, ``/clear`` starts over, ``/quit`` (or end of input) leaves."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from eaglet.commands.model_args import add_model_arguments, add_sampling_arguments, configure_logging

HELP = "commands: /image PATH (attach to the next message), /clear, /quit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", help="a system message opening the conversation")
    add_sampling_arguments(parser)
    add_model_arguments(parser, default_log_level="warning")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    from eaglet.commands.generate import chat_prompt, generate, image_part, load_images, stats_line
    from eaglet.commands.model_args import build_engine, sampling_params

    params = sampling_params(args)
    engine = build_engine(args, show_progress=False)
    if engine.tokenizer is None or getattr(engine.tokenizer, "chat_template", None) is None:
        raise SystemExit("eaglet: this model has no chat template; use `eaglet generate --raw`")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, Any]] = list(opening)
    history_images: list = []
    pending_images: list = []
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/clear":
            history, history_images, pending_images = list(opening), [], []
            continue
        if text.startswith("/image"):
            path = text.removeprefix("/image").strip()
            if not path:
                print("usage: /image PATH", file=sys.stderr)
                continue
            try:
                pending_images += load_images([path])
            except SystemExit as exc:  # a bad path must not end the session
                print(exc, file=sys.stderr)
                continue
            print(f"(image attached to the next message: {path})", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(HELP, file=sys.stderr)
            continue
        content: Any = [image_part() for _ in pending_images] + [{"type": "text", "text": text}] if pending_images else text
        messages = history + [{"role": "user", "content": content}]
        images = history_images + pending_images
        try:
            prompt = chat_prompt(engine, messages, images)
            out, seconds = generate(engine, prompt, params, on_text=lambda delta: print(delta, end="", flush=True))
        except SystemExit as exc:  # e.g. the conversation outgrew the context: say so, keep the session
            print(exc, file=sys.stderr)
            continue
        print()
        print(stats_line(out, seconds), file=sys.stderr)
        history = messages + [{"role": "assistant", "content": out.text or ""}]
        history_images = images
        pending_images = []
