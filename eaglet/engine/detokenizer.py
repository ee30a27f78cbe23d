"""Incremental detokenization and stop strings over blocks of accepted tokens.

Speculative decoding appends several tokens to a request at once. Two things have to come out exactly as
if the tokens had arrived one at a time (contracts 13-15):

* the text: :class:`IncrementalDetokenizer` turns the growing list of generated ids into text deltas. It
  decodes a small window of ids (vLLM / SGLang's ``prefix_offset`` / ``read_offset`` scheme), so the text
  is right for tokens that split a multi-byte character and for tokenizers whose decode of a suffix is not
  the suffix of the decode (SentencePiece / metaspace leading spaces, byte-fallback runs). Characters the
  window still ends in U+FFFD on (an incomplete UTF-8 sequence) are held back until a later token
  completes them; everything before them is final. A block is processed token by token inside
  :meth:`IncrementalDetokenizer.append`, so the state after appending a block is the state after
  appending its tokens one by one, and the detokenizer records how much final text existed after each
  token (used to map a stop string back to a token).
* the stop: :class:`StopStringChecker` searches all newly final text, plus the last
  ``max(len(stop)) - 1`` characters before it (a stop string may start in earlier output), and returns
  the match that ENDS first (ties: the one that starts first). That is the match per-token checking
  finds, because per-token checking stops at the first token whose text completes any stop string.

The cut (``StopMatch.num_tokens``), the vLLM / SGLang convention:

* tokens: the generated tokens are kept up to AND INCLUDING the token that completes the stop string
  (the first token after which the final text contains the whole stop string). ``num_tokens`` counts
  generated tokens from the start of generation (not from the start of the block). The caller cuts
  ``output_token_ids``, the per-token logprobs and the KV-cache commits at ``num_tokens``: tokens after it
  (the rest of the accepted block) are dropped as if never generated, and ``finish_reason`` is ``"stop"``.
* text: cut at the START of the stop string (``include_stop_str_in_output=False``) or at its end (True).
  Text the completing token produced after the stop string is dropped, and with the default the stop
  string itself too, so ``StopMatch.text`` is a prefix (usually a strict one) of
  ``tokenizer.decode(output_token_ids[:num_tokens])``: the caller must report ``StopMatch.text`` and not
  re-decode the kept tokens. ``num_tokens`` is minimal: the text of the first ``num_tokens - 1`` tokens
  does not contain the whole matched occurrence.

How the engine is expected to use it, per request and per step (block = the accepted tokens of one
speculative round, or the one sampled token)::

    block = block[:n]   # n: through the first EOS / stop token id, and no further than max_new_tokens
    detok.append(block)
    match = checker.check(detok)
    if match is not None:          # a stop string beats an EOS / length finish at the same or a later token
        keep, text, reason = match.num_tokens, match.text, "stop"
    elif finished by EOS / stop token / length at the block's last token:
        detok.finish()             # flushes an incomplete last character as U+FFFD, like decode
        keep, text = all, detok.text
    stream = checker.stream_delta(detok, finished=...)   # never shows part of a stop string

Because only tokens up to the finish point are appended, a stop string can never match text after an
EOS or past max_new_tokens, and a stop string completed by the finishing token itself wins over it
(e.g. the EOS text with ``skip_special_tokens=False``). Stop strings only ever match generated text.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from eaglet.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"
# With use_prompt_context, how many prompt tokens the first window starts with (vLLM and SGLang use 5).
PROMPT_CONTEXT_TOKENS = 5


def _trailing_replacements(text: str) -> int:
    i = len(text)
    while i > 0 and text[i - 1] == REPLACEMENT_CHAR:
        i -= 1
    return len(text) - i


def _decode_function(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``, calling the Rust tokenizer directly when
    that gives the same string (a transformers ``TokenizersBackend`` whose ``_decode`` is not overridden and
    that applies no clean-up: about 3x cheaper than going through transformers)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except Exception:  # pragma: no cover - other transformers layouts
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        TokenizersBackend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and backend is not None
        and hasattr(backend, "decode")
    ):
        cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        if cleans_up and type(backend.model).__name__ == "BPE":
            cleans_up = bool(
                getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
            )
        if not cleans_up:
            return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    # transformers tokenizers of any kind, and a bare ``tokenizers.Tokenizer``
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas, correct for multi-byte characters split
    across tokens and for tokenizers whose decode of a suffix differs from the suffix of the decode (leading
    spaces, merges).

    Contract: after any sequence of :meth:`append` calls, ``text`` is a prefix of
    ``tokenizer.decode(generated ids, skip_special_tokens=...)`` that stops only before a trailing run of
    U+FFFD (an incomplete character, held back), and ``text + finish()`` equals that decode. Appending a
    block gives the same state, deltas concatenated, as appending its tokens one at a time.

    ``prompt_token_ids``: by default the text is that of the generated ids alone (what
    ``tokenizer.decode(output_token_ids)`` gives, and what ``RequestOutput.text`` has always been). With
    ``use_prompt_context=True`` the first window starts with the last ``PROMPT_CONTEXT_TOKENS`` prompt
    tokens, as vLLM and SGLang do: a SentencePiece tokenizer then keeps the leading space of the first
    generated word, and a character split between prompt and output comes out whole; the contract is then
    relative to ``decode(prompt tail + generated ids)`` minus the prompt tail's own text. Byte-level BPE
    tokenizers (DeepSeek, Kimi, GPT-style) give the same text either way, but for such a split character.

    Known limit (shared with vLLM / SGLang): text already returned is never taken back, so a tokenizer
    whose decode changes earlier characters when later tokens arrive (clean-up of spaces before
    punctuation; a byte-fallback run that first spells valid characters and then turns invalid) can make
    the deltas differ from the one-shot decode; ``finish()`` then returns the window's remainder. The
    window only slides when text grows, so a long run of tokens that decode to nothing (skipped special
    tokens, an endless invalid byte sequence) makes each step decode the whole run.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        use_prompt_context: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self._decode = _decode_function(tokenizer, skip_special_tokens)
        context = self.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if use_prompt_context else []
        self._num_context = len(context)
        self._ids: list[int] = list(context)  # context + generated ids
        # The window is self._ids[self._prefix:]; self._ids[self._prefix:self._read] is already final and
        # decodes to self._base characters; self._emitted characters of the window are already in text.
        self._prefix = 0
        self._read = len(context)
        context_text = self._decode(context) if context else ""
        self._base = len(context_text)
        self._emitted = len(context_text) - _trailing_replacements(context_text)
        self._context_text = context_text[: self._emitted]
        self._text = ""
        self._offsets: list[int] | None = []  # len(text) after each generated token (None: see finish)
        self._pending: list[int] = []  # generated ids taken by defer(), not yet turned into text
        self._finished = False

    # ---- reading ----------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """All final text so far (incomplete trailing characters held back)."""
        self._flush()
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """The generated ids appended so far (a copy)."""
        return self._ids[self._num_context :] + self._pending

    @property
    def num_tokens(self) -> int:
        return len(self._ids) - self._num_context + len(self._pending)

    @property
    def finished(self) -> bool:
        return self._finished

    def text_len_after(self, num_tokens: int) -> int:
        """Length of the final text once the first ``num_tokens`` generated tokens had been appended."""
        if num_tokens <= 0:
            return 0
        return self._per_token_offsets()[num_tokens - 1]

    def num_tokens_for_text(self, length: int) -> int:
        """The fewest generated tokens after which the final text had at least ``length`` characters: the
        number of tokens through the one that made character ``length - 1`` final."""
        if length <= 0:
            return 0
        if length > len(self.text):
            raise ValueError(f"text has {len(self._text)} characters, asked for {length}")
        return bisect.bisect_left(self._per_token_offsets(), length) + 1

    def _per_token_offsets(self) -> list[int]:
        """``_offsets``; after a finish in one decode, those of the same ids appended one at a time."""
        self._flush()
        if self._offsets is None:
            replay = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, self.skip_special_tokens,
                                            use_prompt_context=self._num_context > 0)
            replay.append(self.token_ids)
            replay.finish()
            self._offsets = replay._offsets
        return self._offsets

    # ---- writing ----------------------------------------------------------------------------
    def append(self, token_ids: Sequence[int]) -> str:
        """Appends generated tokens (a whole accepted block at once is fine); returns the text they made
        final, which may include characters completed for earlier tokens."""
        if self._finished:
            raise RuntimeError("append() after finish()")
        self._flush()
        start = len(self._text)
        for token in token_ids:
            self._step(int(token))
        return self._text[start:]

    def defer(self, token_ids: Sequence[int]) -> None:
        """Appends generated tokens without making text of them yet: the next read (``text``,
        offsets, ``append``) first appends them one at a time, so what it sees is what ``append``
        would have left. Ids deferred since the first token and never read are decoded in one call
        by ``finish`` (offline generation without stop strings reads the text only at the end:
        one decode per request instead of one or two per token)."""
        if self._finished:
            raise RuntimeError("defer() after finish()")
        self._pending.extend(int(t) for t in token_ids)

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            for token in pending:
                self._step(token)

    def _step(self, token: int) -> None:
        ids = self._ids
        ids.append(token)
        window = self._decode(ids[self._prefix :])
        held = _trailing_replacements(window)
        stable = len(window) - held
        if stable > self._emitted:
            self._text += window[self._emitted : stable]
            self._emitted = stable
        if held == 0 and len(window) > self._base:
            # The window ends on a complete character and grew: its new tokens are final. Slide it so the
            # next window starts at the tokens that were final before (the context that keeps merges and
            # leading spaces right) and reads from here.
            self._prefix, self._read = self._read, len(ids)
            self._base = self._emitted = len(self._decode(ids[self._prefix : self._read]))
        self._offsets.append(len(self._text))

    def finish(self) -> str:
        """Ends the sequence: returns the held-back remainder as ``tokenizer.decode`` renders it (U+FFFD for a
        character that was never completed) and adds it to ``text``. Later calls return ''."""
        if self._finished:
            return ""
        if self._pending and not self._offsets:  # every generated id deferred, none read: one decode
            self._ids.extend(self._pending)
            self._pending = []
            self._offsets = None  # per-token offsets, if ever asked for, are replayed
        else:
            self._flush()
        self._finished = True
        if self._offsets == []:
            return ""
        full = self._decode(self._ids)
        done = self._context_text + self._text
        if full.startswith(done):
            rest = full[len(done) :]
        else:  # a tokenizer that rewrote earlier text (see the class docstring): best effort
            rest = self._decode(self._ids[self._prefix :])[self._emitted :]
        self._text += rest
        if self._offsets is not None:
            self._offsets[-1] = len(self._text)
        return rest


@dataclass(frozen=True)
class StopMatch:
    """Where a request stops on a stop string (see the module docstring for the convention).

    ``num_tokens``: generated tokens to keep, counted from the first generated token, up to and including
    the token that completes the stop string; cut token ids, logprobs and KV commits here.
    ``text``: the output text, cut at the start of the stop string (at its end with
    ``include_stop_str_in_output``); not the decode of the kept tokens.
    ``stop``: the stop string that matched.
    """

    num_tokens: int
    text: str
    stop: str


class StopStringChecker:
    """Finds the first stop string in a request's output; one checker per request, fed the request's
    :class:`IncrementalDetokenizer` after each append (one token or a whole accepted block).

    ``check`` returns the same :class:`StopMatch` whether the tokens were appended one at a time (and
    checked after each) or in blocks of any sizes. Once a match is found, ``check`` keeps returning it.

    ``min_tokens`` (``SamplingParams.min_tokens``): as in vLLM and SGLang, no stop check runs before that
    many tokens exist, so a stop string completed by one of the first ``min_tokens - 1`` tokens is ignored
    (it stays in the text); one completed by token ``min_tokens`` or later counts.
    """

    def __init__(
        self, stops: Sequence[str] | str | None, include_stop_str_in_output: bool = False, min_tokens: int = 0
    ) -> None:
        if stops is None:
            stops = []
        elif isinstance(stops, str):
            stops = [stops]
        unique: list[str] = []
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
            if s not in unique:
                unique.append(s)
        self.stops = unique
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.max_stop_len = max((len(s) for s in unique), default=0)
        self._by_first_char: dict[str, list[str]] = {}
        for s in unique:
            self._by_first_char.setdefault(s[0], []).append(s)
        self._searched = 0  # characters of text already searched for stop strings that END in them
        self._match: StopMatch | None = None
        self._streamed = 0  # characters handed out by stream_delta

    @property
    def match(self) -> StopMatch | None:
        return self._match

    def check(self, detok: IncrementalDetokenizer) -> StopMatch | None:
        """Searches the text made final since the last check (plus the tail a stop string could have
        started in) and returns the match that ends first, or None."""
        if self._match is not None or not self.stops or detok.num_tokens < self.min_tokens:
            return self._match
        text = detok.text
        # a match must end past what was searched, and past the text of the first min_tokens - 1 tokens
        searched = max(self._searched, detok.text_len_after(self.min_tokens - 1))
        if len(text) <= searched:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            i = text.find(s, max(0, searched - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        self._searched = len(text)
        if best is None:
            return None
        end, start, stop = best
        cut = end if self.include_stop_str_in_output else start
        self._match = StopMatch(num_tokens=detok.num_tokens_for_text(end), text=text[:cut], stop=stop)
        return self._match

    def held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string (it could
        still become a stop string, so it must not be streamed yet)."""
        if self.max_stop_len < 2:
            return 0
        tail = text[-(self.max_stop_len - 1) :]
        for p, ch in enumerate(tail):  # longest suffix first
            stops = self._by_first_char.get(ch)
            if stops:
                rest = tail[p:]
                if any(len(s) > len(rest) and s.startswith(rest) for s in stops):
                    return len(rest)
        return 0

    def streamable_text(self, detok: IncrementalDetokenizer, finished: bool = False) -> str:
        """All the text that may be shown now: the stop-cut text once a stop string matched, else the final
        text minus a suffix that could still be the beginning of a stop string (everything when
        ``finished``: call ``detok.finish()`` first). Each result is a prefix of every later one and of the
        request's final text, so streamed output never holds part of a stop string that is later cut."""
        match = self.check(detok)
        if match is not None:
            return match.text
        text = detok.text
        if finished:
            return text
        return text[: len(text) - self.held_back(text)]

    def stream_delta(self, detok: IncrementalDetokenizer, finished: bool = False) -> str:
        """The part of :meth:`streamable_text` not handed out by an earlier call."""
        text = self.streamable_text(detok, finished)
        delta = text[self._streamed :]
        self._streamed = max(self._streamed, len(text))
        return delta
