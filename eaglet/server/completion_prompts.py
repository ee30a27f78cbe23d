"""The prompts of a ``/v1/completions`` request: one text or list of token ids, or a batch of them.

Checked here rather than by a pydantic union: a union validates a list of millions of token ids
against every branch (seconds, holding the GIL that the engine's thread needs too), where this
refuses a list longer than the context at once and checks the rest in one pass.
"""

from __future__ import annotations

from typing import Any

from eaglet.server.errors import APIError

_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def completion_prompts(prompt: Any, max_prompts: int, max_prompt_tokens: int) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise APIError(400, f"prompt must be {_SHAPES}", "prompt")
    if not prompt:
        raise APIError(400, "prompt is an empty list", "prompt")
    if type(prompt[0]) is int:
        return [_token_ids(prompt, "prompt", max_prompt_tokens)]
    if len(prompt) > max_prompts:
        raise APIError(400, f"{len(prompt)} prompts in one request; the limit is {max_prompts}", "prompt")
    prompts: list[str | list[int]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list):
            prompts.append(_token_ids(item, f"prompt.{i}", max_prompt_tokens))
        else:
            raise APIError(400, f"prompt.{i}: expected a string or a list of token ids, got {type(item).__name__}", "prompt")
    return prompts


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0  # not bool, a subclass of int


def _token_ids(ids: list[Any], where: str, max_prompt_tokens: int) -> list[int]:
    if len(ids) > max_prompt_tokens:
        raise APIError(400, f"{where} has {len(ids)} tokens; this server's context holds at most {max_prompt_tokens} "
                            f"prompt tokens", "prompt")
    for i, value in enumerate(ids):
        if not _is_token_id(value):
            raise APIError(400, f"{where}.{i}: expected a token id (an integer >= 0), got {value!r}", "prompt")
    return ids
