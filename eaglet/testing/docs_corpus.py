"""Plain English/Python text that every Python installation carries: the pydoc help topics and
the docstrings of a fixed list of standard-library modules. Deterministic for a given Python
version; no network."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings

STDLIB_MODULES = (
    "builtins", "collections", "functools", "itertools", "json", "pathlib", "re", "string",
    "textwrap", "os", "math", "random", "statistics", "datetime", "heapq", "bisect", "shutil",
    "argparse", "logging", "typing", "dataclasses", "enum", "csv", "io", "subprocess",
)


def _clean(text: str) -> str:
    text = inspect.cleandoc(text)
    text = re.sub(r"[^\x20-\x7e\n]", "", text)  # ASCII only keeps the small vocabulary small
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def docs_paragraphs(min_chars: int = 80) -> list[str]:
    """Paragraphs of at least ``min_chars`` characters, in a fixed order."""
    from pydoc_data.topics import topics

    texts: list[str] = [topics[name] for name in sorted(topics)]
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        if module.__doc__:
            texts.append(module.__doc__)
        for name in sorted(dir(module)):
            if name.startswith("_"):
                continue
            with warnings.catch_warnings():  # typing.io / typing.re warn on access
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = getattr(getattr(module, name, None), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    seen: set[str] = set()
    paragraphs: list[str] = []
    for text in texts:
        for paragraph in _clean(text).split("\n\n"):
            paragraph = paragraph.strip()
            if len(paragraph) >= min_chars and paragraph not in seen:
                seen.add(paragraph)
                paragraphs.append(paragraph)
    return paragraphs
