"""`eaglet` command line: one module per subcommand under eaglet/commands/.

A command module defines ``add_arguments(parser)`` and ``run(args) -> int``; heavy imports (torch,
the engine, the server) happen inside ``run`` so that ``eaglet --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("eaglet.commands.serve", "OpenAI-compatible HTTP server"),
    "generate": ("eaglet.commands.generate", "one-shot generation with acceptance statistics"),
    "chat": ("eaglet.commands.chat", "interactive terminal chat (images by path)"),
    "bench": ("eaglet.commands.bench", "benchmarks against plain decoding and peers"),
    "train-draft": ("eaglet.commands.train_draft", "train an EAGLE-3 draft head for a target"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglet", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
