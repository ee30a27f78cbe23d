"""Log-probabilities in the OpenAI shapes: per token for chat, per token with text offsets for
completions (where ``echo`` puts the prompt's tokens first, the very first without a logprob)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglet.executor.request import RequestOutput, TokenLogprob
from eaglet.server import protocol as P


@dataclass(frozen=True)
class LogprobEntry:
    token_id: int
    logprob: float | None  # None for a prompt's first token: nothing comes before it
    top: list[tuple[int, float]] | None


class TokenTexts:
    """Each token id's text, decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
            self._cache[token_id] = text
        return text


def output_entries(logprobs: list[TokenLogprob]) -> list[LogprobEntry]:
    return [LogprobEntry(e.token_id, e.logprob, e.top) for e in logprobs]


def prompt_entries(out: RequestOutput) -> list[LogprobEntry]:
    entries = out.prompt_logprobs or []
    return [
        LogprobEntry(out.prompt_token_ids[i], None, None) if e is None else LogprobEntry(e.token_id, e.logprob, e.top)
        for i, e in enumerate(entries)
    ]


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenTexts) -> P.ChatLogprobs:
    content = []
    for entry in entries:
        top = [P.TopLogprob(token=token_text(t), logprob=lp, bytes=list(token_text(t).encode())) for t, lp in entry.top]
        text = token_text(entry.token_id)
        content.append(P.TokenLogprobEntry(token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=top))
    return P.ChatLogprobs(content=content)


def completion_logprobs(
    prompt: list[LogprobEntry], output: list[LogprobEntry], output_offset: int, token_text: TokenTexts
) -> P.CompletionLogprobs:
    """The prompt's entries (echo) with offsets from 0, then the output's from ``output_offset``
    (where the output's text starts in the choice's text)."""
    tokens: list[str] = []
    offsets: list[int] = []
    for entries, start in ((prompt, 0), (output, output_offset)):
        offset = start
        for entry in entries:
            text = token_text(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
    entries = prompt + output
    return P.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[None if e.top is None else {token_text(t): lp for t, lp in e.top} for e in entries],
        text_offset=offsets,
    )
