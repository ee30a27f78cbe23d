"""One chat choice's output as OpenAI shapes it: the whole message (non-streaming) and the deltas of
each step (streaming), both from the same parser events, so the deltas joined up are the message.

Deltas, in the order the output had them: a run of reasoning text is one ``reasoning_content``
delta, a run of answer text one ``content`` delta; a tool call's first delta carries its
``index``, ``id``, ``type`` and ``function.name`` (with ``arguments: ""``), later ones pieces of
``function.arguments``.
"""

from __future__ import annotations

from eaglet.server import protocol as P
from eaglet.server.kimi_k2_output import (
    ContentText,
    KimiK2OutputParser,
    OutputEvent,
    OutputFormat,
    ReasoningText,
    ToolCallStart,
)


class ChoiceOutput:
    """Reads one choice's growing text (each engine output holds all of it so far)."""

    def __init__(self, output_format: OutputFormat) -> None:
        self._parser = KimiK2OutputParser(output_format)
        self._read_chars = 0
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[P.ToolCall] = []

    def read(self, text: str, finished: bool) -> list[OutputEvent]:
        """The events of the text added since the last call (all that is left, once finished)."""
        events = self._parser.feed(text[self._read_chars :])
        self._read_chars = len(text)
        if finished:
            events += self._parser.finish()
        for event in events:
            if isinstance(event, ReasoningText):
                self._reasoning.append(event.text)
            elif isinstance(event, ContentText):
                self._content.append(event.text)
            elif isinstance(event, ToolCallStart):
                self._calls.append(P.ToolCall(id=event.id, function=P.FunctionCall(name=event.name, arguments="")))
            else:
                self._calls[event.index].function.arguments += event.text
        return events

    @property
    def tool_calls(self) -> list[P.ToolCall]:
        return self._calls

    def message(self) -> P.AssistantMessage:
        content = "".join(self._content)
        return P.AssistantMessage(
            content=None if not content and self._calls else content,
            reasoning_content="".join(self._reasoning) or None,
            tool_calls=[call.model_copy(deep=True) for call in self._calls] or None,
        )

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an answer that ended (EOS or a stop) with calls in it."""
        return "tool_calls" if engine_reason == "stop" and self._calls else engine_reason


def delta_messages(events: list[OutputEvent]) -> list[P.DeltaMessage]:
    deltas: list[P.DeltaMessage] = []
    for event in events:
        last = deltas[-1] if deltas else None
        if isinstance(event, ReasoningText):
            if last is not None and last.reasoning_content is not None:
                last.reasoning_content += event.text
            else:
                deltas.append(P.DeltaMessage(reasoning_content=event.text))
        elif isinstance(event, ContentText):
            if last is not None and last.content is not None:
                last.content += event.text
            else:
                deltas.append(P.DeltaMessage(content=event.text))
        elif isinstance(event, ToolCallStart):
            start = P.DeltaToolCall(index=event.index, id=event.id, type="function",
                                    function=P.DeltaFunctionCall(name=event.name, arguments=""))
            deltas.append(P.DeltaMessage(tool_calls=[start]))
        elif last is not None and _continues_arguments(last, event.index):
            last.tool_calls[0].function.arguments += event.text  # type: ignore[index, operator]
        else:
            piece = P.DeltaToolCall(index=event.index, function=P.DeltaFunctionCall(arguments=event.text))
            deltas.append(P.DeltaMessage(tool_calls=[piece]))
    return deltas


def _continues_arguments(delta: P.DeltaMessage, index: int) -> bool:
    """Whether ``delta`` holds argument text of call ``index`` (its first delta stays as OpenAI sends it)."""
    return bool(delta.tool_calls) and delta.tool_calls[0].id is None and delta.tool_calls[0].index == index  # type: ignore[index]
