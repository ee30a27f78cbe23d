"""Pieces of Lark grammars in llguidance's syntax, for grammars the server builds (tool calls,
JSON after an open thinking section)."""

from __future__ import annotations

import json
from typing import Any

# Whitespace between JSON tokens: nothing or one space. llguidance's default (any run of
# whitespace) lets a model that favours newlines write them until max_tokens without ever closing
# the object; the compact form is what models write anyway.
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": "[ ]?"}


def json_value(schema: dict[str, Any]) -> str:
    """A grammar expression for JSON text matching ``schema`` (its own ``x-guidance`` options win)."""
    options = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def literal(text: str, special_token_id: int | None = None) -> str:
    """``text`` as a grammar expression: the special token itself where the tokenizer has one for
    it (text never matches a special token), else the characters."""
    if special_token_id is not None:
        return f"<[{special_token_id}]>"
    return json.dumps(text, ensure_ascii=False)


def text_up_to(end: str) -> str:
    """A rule body for any text ending at the first ``end`` (a lazy lexeme, ``end`` included)."""
    return "/(?s:.*)" + _regex_escape(end) + "/"


def _regex_escape(text: str) -> str:
    special = set(r"\.^$|?*+()[]{}/")
    return "".join("\\" + c if c in special else c for c in text)
