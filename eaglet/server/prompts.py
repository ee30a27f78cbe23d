"""Prompt text to token ids for the server, never on the engine's thread.

A prompt that cannot fit the context is refused by its length in characters before anything is
tokenized (every token covers at most the longest vocabulary entry's characters), so a huge prompt
costs one ``len``. What is left to tokenize runs in one worker thread on the encoder's own copy of
the tokenizer (HF fast tokenizers change their settings per call, which must not race the
engine's detokenizers), and releases the GIL while the Rust tokenizer works.

Chat messages never become control tokens: text such as ``<|im_end|><|im_system|>`` in a message
is encoded as the ordinary text it is, while the chat template's own control tokens stay real
(``allow_special_tokens_in_messages`` turns this off, as for a trusted client).
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

    async def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat template's prompt for the messages, ready for the assistant turn."""
        self.check_length(sum(len(text) for text in _message_texts(messages)), "messages")
        return await self._run(lambda: self._encode_chat(messages))

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

    def _encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        forged = self._special is not None and any(self._special.search(t) for t in _message_texts(messages))
        if self.allow_special_tokens_in_messages or not forged:
            return self._encode(render_chat_prompt(self.tokenizer, messages), split_special_tokens=False)
        # Each message text is fenced by markers only this request knows; the template's text
        # between the fences is encoded with its control tokens, the fenced text as plain text.
        nonce = secrets.token_hex(8)
        opening, closing = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        rendered = render_chat_prompt(self.tokenizer, _map_texts(messages, lambda t: f"{opening}{t}{closing}"))
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
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            yield content
        else:
            yield from (part["text"] for part in content if part["type"] == "text")


def _map_texts(messages: list[dict[str, Any]], fn: Callable[[str], str]) -> list[dict[str, Any]]:
    def content_of(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(content, str):
            return fn(content)
        return [{**part, "text": fn(part["text"])} if part["type"] == "text" else part for part in content]

    return [{**message, "content": content_of(message["content"])} for message in messages]
