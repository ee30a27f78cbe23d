"""Prompt text to token ids for the server, never on the engine's thread.

A prompt that cannot fit the context is refused by its length in characters before anything is
tokenized (every token covers at most the longest vocabulary entry's characters), so a huge prompt
costs one ``len``. What is left to tokenize runs in one worker thread on the encoder's own copy of
the tokenizer (HF fast tokenizers change their settings per call, which must not race the
engine's detokenizers), and releases the GIL while the Rust tokenizer works.

Chat messages never become control tokens: text such as ``<|im_end|><|im_system|>`` in a message
(its content, an earlier call's arguments, its reasoning) is encoded as the ordinary text it is,
while the chat template's own control tokens stay real. Names, ids, tool definitions and template
variables are rendered where message text cannot be fenced off (inside JSON, in lookups), so
special-token text there is refused (``allow_special_tokens_in_messages`` allows both, as for a
trusted client).
"""

from __future__ import annotations

import asyncio
import copy
import re
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from eaglet.errors import InvalidRequestError
from eaglet.server.chat import render_chat_prompt
from eaglet.server.errors import APIError

T = TypeVar("T")


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most input characters one token can stand for, or None where the tokenizer gives no such
    bound (a normalizer may delete characters; an added token may swallow the whitespace around it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.normalizer is not None:
        return None
    if any(token.lstrip or token.rstrip for token in tokenizer.added_tokens_decoder.values()):
        return None
    return max(len(token) for token in tokenizer.get_vocab())


def special_token_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """What the tokenizer would turn into a special (control) token, longest first."""
    texts = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_prompt_tokens: int, allow_special_tokens_in_messages: bool = False) -> None:
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.max_prompt_tokens = max_prompt_tokens
        self.allow_special_tokens_in_messages = allow_special_tokens_in_messages
        chars = max_chars_per_token(self.tokenizer) if self.tokenizer is not None else None
        self.max_prompt_chars = None if chars is None else max_prompt_tokens * chars
        self._special = special_token_pattern(self.tokenizer) if self.tokenizer is not None else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eaglet-tokenizer")

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def check_length(self, num_chars: int, param: str) -> None:
        """Refuses text that has more characters than the longest prompt that fits can have."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {num_chars} characters; this server's context holds at most "
                f"{self.max_prompt_tokens} prompt tokens, which cover at most {self.max_prompt_chars} characters",
                param,
            )

    async def encode_text(self, text: str, param: str) -> list[int]:
        """A raw prompt (``/v1/completions``): special-token text in it is parsed, as the client wrote a whole prompt."""
        self.check_length(len(text), param)
        return await self._run(lambda: self._encode(text, split_special_tokens=False))

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat template's prompt for the messages (and tools, and template variables), ready for
        the assistant turn."""
        self.check_length(sum(len(text) for text in _message_texts(messages)), "messages")
        return await self._run(lambda: self._encode_chat(messages, tools, template_kwargs))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(lambda: self.tokenizer.decode(token_ids, skip_special_tokens=False))

    async def _run(self, fn: Callable[[], T]) -> T:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send the prompt as token ids (/v1/completions)")
        return await asyncio.wrap_future(self._worker.submit(fn))

    def _encode(self, text: str, split_special_tokens: bool) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special_tokens))

    def _refuse_special_tokens(self, texts: Iterator[tuple[str, str]]) -> None:
        if self._special is None:
            return
        for param, text in texts:
            if found := self._special.search(text):
                raise APIError(
                    400, f"{param} holds special-token text ({found.group()!r}); it is refused outside message text", param
                )

    def _encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None
    ) -> list[int]:
        if not self.allow_special_tokens_in_messages:
            self._refuse_special_tokens(_unfenced_texts(messages, tools, template_kwargs))
        forged = self._special is not None and any(self._special.search(t) for t in _message_texts(messages))
        if self.allow_special_tokens_in_messages or not forged:
            return self._encode(render_chat_prompt(self.tokenizer, messages, tools, template_kwargs), split_special_tokens=False)
        # Each message text is fenced by markers only this request knows; the template's text
        # between the fences is encoded with its control tokens, the fenced text as plain text.
        nonce = secrets.token_hex(8)
        opening, closing = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        fenced_messages = _map_texts(messages, lambda t: f"{opening}{t}{closing}")
        rendered = render_chat_prompt(self.tokenizer, fenced_messages, tools, template_kwargs)
        token_ids: list[int] = []
        start = 0
        for fenced in re.finditer(f"{opening}(.*?){closing}", rendered, flags=re.DOTALL):
            token_ids += self._encode_template_text(rendered[start : fenced.start()], nonce)
            token_ids += self._encode(fenced.group(1), split_special_tokens=True)
            start = fenced.end()
        return token_ids + self._encode_template_text(rendered[start:], nonce)

    def _encode_template_text(self, text: str, nonce: str) -> list[int]:
        if nonce in text:  # a fence the template cut in two: the text's extent is unknown
            raise InvalidRequestError(
                "a message holds special-token text and the chat template rewrites message text, so that text "
                "cannot be kept out of the control tokens; remove it (or start the server with "
                "--allow-special-tokens-in-messages)"
            )
        return self._encode(text, split_special_tokens=False)


def _message_texts(messages: list[dict[str, Any]]) -> Iterator[str]:
    """The free text of the messages: what may be fenced (content, reasoning, call arguments)."""
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            yield content
        else:
            yield from (part["text"] for part in content if part["type"] == "text")
        if "reasoning_content" in message:
            yield message["reasoning_content"]
        yield from (call["function"]["arguments"] for call in message.get("tool_calls", []))


def _map_texts(messages: list[dict[str, Any]], fn: Callable[[str], str]) -> list[dict[str, Any]]:
    def content_of(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(content, str):
            return fn(content)
        return [{**part, "text": fn(part["text"])} if part["type"] == "text" else part for part in content]

    def call_of(call: dict[str, Any]) -> dict[str, Any]:
        return {**call, "function": {**call["function"], "arguments": fn(call["function"]["arguments"])}}

    mapped = []
    for message in messages:
        message = {**message, "content": content_of(message["content"])}
        if "reasoning_content" in message:
            message["reasoning_content"] = fn(message["reasoning_content"])
        if "tool_calls" in message:
            message["tool_calls"] = [call_of(call) for call in message["tool_calls"]]
        mapped.append(message)
    return mapped


def _unfenced_texts(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None
) -> Iterator[tuple[str, str]]:
    """(field, text) of every other string a request brings to the template."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls", [])):
            yield f"messages.{i}.tool_calls.{j}.id", call["id"]
            yield f"messages.{i}.tool_calls.{j}.function.name", call["function"]["name"]
        if "tool_call_id" in message:
            yield f"messages.{i}.tool_call_id", message["tool_call_id"]
    yield from _json_strings(tools or [], "tools")
    yield from _json_strings(template_kwargs or {}, "chat_template_kwargs")


def _json_strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string in a JSON value, keys included, with where it is."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield path, key
            yield from _json_strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _json_strings(item, f"{path}.{i}")
