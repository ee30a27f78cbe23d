"""Kimi-K2's output read as it streams: thinking, answer text and tool calls.

The format (Kimi-K2 / K2.5 chat templates; vLLM's ``kimi_k2`` tool and reasoning parsers and
SGLang's ``KimiK2Detector`` read the same)::

    [<think>]REASONING</think>CONTENT<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>
    ... more calls ...
    <|tool_calls_section_end|>

- Thinking: K2.5's template ends the prompt with ``<think>`` (thinking on) or ``<think></think>``
  (``chat_template_kwargs: {"thinking": false}``), so the output starts inside the reasoning when
  the prompt left one open; an output that itself starts with ``<think>`` opens one too. The
  reasoning ends at ``</think>``, or where a tool-call section starts (interleaved thinking).
  Elsewhere the tags are plain text.
- Tool calls: ``functions.NAME:IDX`` gives the name and the call's id (K2's templates render a
  call in the history by this id, and tool results answer it, so it is the OpenAI id as well);
  the arguments are the text between the markers, exactly as the model wrote it. Text between
  calls inside a section is ignored; text after the section is content again. A call whose header
  was cut off (the output ended before ``<|tool_call_argument_begin|>``) is dropped; one whose
  arguments were cut off keeps the arguments written so far.

The parser works on text (the markers are special tokens in Kimi's tokenizer, but any tokenizer
may spell them with ordinary tokens), through a ``MarkerScanner``: the events it returns, joined
up, are the same however the output arrives in pieces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum, auto

from eaglet.server.marker_scanner import Marker, MarkerScanner, Piece

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
REASONING_MARKERS = (THINK_OPEN, THINK_CLOSE)
TOOL_CALL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

_CALL_HEADER = re.compile(r"(?:functions\.)?(?P<name>.*):\d+", re.DOTALL)


@dataclass(frozen=True)
class ReasoningText:
    text: str


@dataclass(frozen=True)
class ContentText:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # the call's position in the message (OpenAI's index), not the model's IDX
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    text: str


OutputEvent = ReasoningText | ContentText | ToolCallStart | ToolCallArguments


@dataclass(frozen=True)
class OutputFormat:
    """What one request's output is read for."""

    reasoning: bool = False  # split off <think>...</think>
    starts_in_reasoning: bool = False  # the prompt ended inside an open <think>
    tool_calls: bool = False
    max_tool_calls: int | None = None  # calls past it are parsed and left out (parallel_tool_calls: false)
    dropped: frozenset[str] = frozenset()  # texts removed wherever they appear (skipped special tokens)

    @property
    def markers(self) -> tuple[str, ...]:
        return (REASONING_MARKERS if self.reasoning else ()) + (TOOL_CALL_MARKERS if self.tool_calls else ())


class _State(Enum):
    REASONING = auto()
    CONTENT = auto()
    SECTION = auto()  # inside a tool-call section, between calls
    HEADER = auto()  # after <|tool_call_begin|>: functions.NAME:IDX
    ARGUMENTS = auto()


# (state, marker) -> the next state; a marker with no entry for the state is plain text there.
_TRANSITIONS = {
    (_State.CONTENT, SECTION_BEGIN): _State.SECTION,
    (_State.REASONING, THINK_CLOSE): _State.CONTENT,
    (_State.REASONING, SECTION_BEGIN): _State.SECTION,  # interleaved thinking: a call ends the reasoning
    (_State.SECTION, CALL_BEGIN): _State.HEADER,
    (_State.SECTION, SECTION_END): _State.CONTENT,
    (_State.HEADER, ARGUMENT_BEGIN): _State.ARGUMENTS,
    (_State.HEADER, CALL_END): _State.SECTION,  # a call without arguments
    (_State.HEADER, CALL_BEGIN): _State.HEADER,  # the header left unfinished: no call
    (_State.HEADER, SECTION_END): _State.CONTENT,
    (_State.ARGUMENTS, CALL_END): _State.SECTION,
    (_State.ARGUMENTS, SECTION_END): _State.CONTENT,  # the call's end left out
    (_State.ARGUMENTS, CALL_BEGIN): _State.HEADER,
}


class KimiK2OutputParser:
    def __init__(self, output_format: OutputFormat) -> None:
        self._format = output_format
        self._dropped = output_format.dropped - set(output_format.markers)
        self._scanner = MarkerScanner((*output_format.markers, *self._dropped))
        self._state = _State.REASONING if output_format.starts_in_reasoning else _State.CONTENT
        self._at_start = True  # nothing of the output read yet
        self._header = ""
        self._num_calls = 0

    def feed(self, text: str) -> list[OutputEvent]:
        return self._read(self._scanner.feed(text))

    def finish(self) -> list[OutputEvent]:
        """The events of the held-back tail; a call header still open makes no call."""
        return self._read(self._scanner.finish())

    def _read(self, pieces: Iterable[Piece]) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for piece in pieces:
            if isinstance(piece, Marker):
                if piece.marker in self._dropped:
                    continue
                event = self._marker(piece.marker)
            else:
                event = self._text(piece.text)
            self._at_start = False
            if event is not None:
                events.append(event)
        return events

    def _marker(self, marker: str) -> OutputEvent | None:
        if marker == THINK_OPEN and self._at_start and self._state in (_State.CONTENT, _State.REASONING):
            self._state = _State.REASONING  # the output opens its thinking (or repeats the prompt's <think>)
            return None
        following = _TRANSITIONS.get((self._state, marker))
        if following is None:
            return self._text(marker)  # a marker out of place is plain text
        event = self._start_call() if self._state is _State.HEADER and marker in (ARGUMENT_BEGIN, CALL_END) else None
        self._state = following
        if following is _State.HEADER:
            self._header = ""
        return event

    def _text(self, text: str) -> OutputEvent | None:
        state = self._state
        if state is _State.CONTENT:
            return ContentText(text)
        if state is _State.REASONING:
            return ReasoningText(text)
        if state is _State.HEADER:
            self._header += text
        elif state is _State.ARGUMENTS and self._emits(self._num_calls - 1):
            return ToolCallArguments(self._num_calls - 1, text)
        return None

    def _start_call(self) -> ToolCallStart | None:
        index = self._num_calls
        self._num_calls += 1
        if not self._emits(index):
            return None
        header = self._header.strip()
        match = _CALL_HEADER.fullmatch(header)
        if match is not None:
            return ToolCallStart(index, header, match["name"])
        name = header.removeprefix("functions.")  # no :IDX: an id in Kimi's form, numbered by position
        return ToolCallStart(index, f"functions.{name}:{index}", name)

    def _emits(self, index: int) -> bool:
        limit = self._format.max_tool_calls
        return limit is None or index < limit
