"""Streamed text split into plain text and markers (fixed strings such as ``<think>``), with the
same pieces however the text is cut into deltas.

Each decision depends only on the characters it is about: at the leftmost position where a marker
could start, the longest marker that matches there is taken once no longer marker can still match;
while the text seen so far ends in a proper prefix of a marker (``<|tool_ca``), that tail is held
back until later text (or ``finish``) decides it. A marker split across engine steps, or spelled by
several ordinary tokens, therefore never leaks out as plain text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Marker:
    marker: str


Piece = Text | Marker


class MarkerScanner:
    def __init__(self, markers: Iterable[str]) -> None:
        self._markers = sorted({m for m in markers if m}, key=len, reverse=True)  # longest first: it wins a tie
        self._pattern = re.compile("|".join(re.escape(m) for m in self._markers)) if self._markers else None
        self._longest = len(self._markers[0]) if self._markers else 0
        self._proper_prefixes = {m[:i] for m in self._markers for i in range(1, len(m))}
        self._buffer = ""

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` decides (a possible marker at the end stays held back)."""
        self._buffer += text
        return self._scan(final=False)

    def finish(self) -> list[Piece]:
        """The held-back tail, decided now that no more text comes."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        buffer = self._buffer
        start = 0
        while start < len(buffer):
            match = self._pattern.search(buffer, start) if self._pattern else None
            undecided = None if final else self._first_undecided(buffer, start)
            if undecided is not None and (match is None or undecided <= match.start()):
                _add_text(pieces, buffer[start:undecided])
                start = undecided
                break
            if match is None:
                _add_text(pieces, buffer[start:])
                start = len(buffer)
                break
            _add_text(pieces, buffer[start : match.start()])
            pieces.append(Marker(match.group()))
            start = match.end()
        self._buffer = buffer[start:]
        return pieces

    def _first_undecided(self, buffer: str, start: int) -> int | None:
        """The first position whose rest of the buffer is a proper prefix of a marker: it may yet be
        one (or a longer one than matches there now). Only the last ``longest - 1`` characters can be."""
        for position in range(max(start, len(buffer) - self._longest + 1), len(buffer)):
            if buffer[position:] in self._proper_prefixes:
                return position
        return None


def _add_text(pieces: list[Piece], text: str) -> None:
    if text:
        pieces.append(Text(text))
