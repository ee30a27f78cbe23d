"""The must-show property of issue 36: for random Kimi-K2 outputs (thinking or not, answer text or
not, 0-3 tool calls with random names and JSON arguments whose strings hold braces, quotes,
backslashes, marker-like text and any Unicode), every grouping of the output into engine steps
gives the same parsed message, and the streamed deltas joined up as a client joins them are that
message.

The server's own code is under test: ``ChoiceOutput`` (what the chat endpoint runs per choice)
and ``delta_messages`` (what it streams). Groupings come two ways: the text cut at random
characters (markers and multi-byte characters split anywhere), and the text's tokens appended to
the engine's ``IncrementalDetokenizer`` in random steps of 1-8 tokens (a speculative block), with
Kimi's markers as special tokens and, with the demo tokenizer, spelled by ordinary BPE tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from eaglet.demo_model import DEMO_TARGET_DIR, demo_model_available
from eaglet.engine.detokenizer import IncrementalDetokenizer
from eaglet.server import protocol as P
from eaglet.server.chat_output import ChoiceOutput, delta_messages
from eaglet.server.kimi_k2_output import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    REASONING_MARKERS,
    SECTION_BEGIN,
    SECTION_END,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_MARKERS,
    OutputFormat,
)
from eaglet.testing.tool_checkpoints import write_tool_tokenizer

EOS = "<|im_end|>"
RESERVED = (*REASONING_MARKERS, *TOOL_CALL_MARKERS, EOS)
# Characters that stress the parser: JSON's own, the markers' own, multi-byte ones.
TRICKY = '{}[]"\\:,<|>/_ \n\tthinkéßЖ中文🙂\u200b'
texts = st.text(alphabet=st.sampled_from(TRICKY) | st.characters(codec="utf-8"), max_size=24).filter(
    lambda t: not any(marker in t for marker in RESERVED)
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_-]{0,15}", fullmatch=True)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as the model writes it
    model_index: int  # the IDX of functions.NAME:IDX (a conversation-wide counter in Kimi's use)


@dataclass(frozen=True)
class Output:
    thinking: str  # "prompt": the prompt opened <think>; "tag": the output opens it; "off"
    reasoning: str
    content: str
    calls: tuple[Call, ...]
    eos: bool

    def text(self) -> str:
        parts = [THINK_OPEN if self.thinking == "tag" else ""]
        if self.thinking != "off":
            parts += [self.reasoning, THINK_CLOSE]
        parts.append(self.content)
        if self.calls:
            parts.append(SECTION_BEGIN)
            for call in self.calls:
                parts += [CALL_BEGIN, f"functions.{call.name}:{call.model_index}", ARGUMENT_BEGIN, call.arguments, CALL_END]
            parts.append(SECTION_END)
        return "".join(parts) + (EOS if self.eos else "")

    def output_format(self) -> OutputFormat:
        return OutputFormat(reasoning=True, starts_in_reasoning=self.thinking == "prompt", tool_calls=True,
                            dropped=frozenset({EOS}))

    def message(self) -> P.AssistantMessage:
        calls = [
            P.ToolCall(id=f"functions.{c.name}:{c.model_index}", function=P.FunctionCall(name=c.name, arguments=c.arguments))
            for c in self.calls
        ]
        reasoning = self.reasoning if self.thinking != "off" else ""
        return P.AssistantMessage(content=self.content or (None if calls else ""), reasoning_content=reasoning or None,
                                  tool_calls=calls or None)


@st.composite
def outputs(draw: st.DrawFn) -> Output:
    calls = tuple(
        Call(draw(names), json.dumps(draw(json_values), ensure_ascii=draw(st.booleans())), draw(st.integers(0, 99)))
        for _ in range(draw(st.integers(0, 3)))
    )
    return Output(draw(st.sampled_from(["prompt", "tag", "off"])), draw(texts), draw(texts), calls, draw(st.booleans()))


def streamed(output_format: OutputFormat, texts_so_far: list[str]) -> tuple[P.AssistantMessage, list[P.DeltaMessage]]:
    """What the chat endpoint makes of engine outputs whose text grows through ``texts_so_far``:
    the non-streaming message of the last one and the streamed deltas of all of them."""
    stream = ChoiceOutput(output_format)
    deltas = []
    for k, text in enumerate(texts_so_far):
        deltas += delta_messages(stream.read(text, finished=k == len(texts_so_far) - 1))
    whole = ChoiceOutput(output_format)
    whole.read(texts_so_far[-1], finished=True)
    assert stream.message() == whole.message()
    return whole.message(), deltas


def joined(deltas: list[P.DeltaMessage]) -> P.AssistantMessage:
    """The deltas joined up as OpenAI's clients join them, checking OpenAI's tool-call indexing:
    a call's first delta has its index (the next one), id, type and name; later ones add arguments."""
    content, reasoning, calls = "", "", []
    for delta in deltas:
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.type == "function" and piece.function.name is not None
                assert piece.function.arguments == ""
                calls.append(P.ToolCall(id=piece.id, function=P.FunctionCall(name=piece.function.name, arguments="")))
            else:
                assert piece.index == len(calls) - 1 and piece.function.name is None and piece.type is None
                calls[piece.index].function.arguments += piece.function.arguments
        assert not (delta.content and delta.reasoning_content), "one kind of text per delta"
    return P.AssistantMessage(content=content or (None if calls else ""), reasoning_content=reasoning or None,
                              tool_calls=calls or None)


def cut(text: str, lengths: list[int]) -> list[str]:
    """The text's growing prefixes, cut after each of ``lengths`` characters (then the rest)."""
    prefixes, end = [], 0
    for length in lengths:
        end = min(len(text), end + length)
        prefixes.append(text[:end])
    return prefixes + [text]


@settings(max_examples=300, deadline=None)
@given(outputs(), st.lists(st.integers(0, 12), max_size=60))
def test_any_cut_of_the_text_gives_the_same_message_and_deltas(output: Output, lengths: list[int]) -> None:
    text = output.text()
    message, deltas = streamed(output.output_format(), cut(text, lengths))
    assert message == output.message()
    assert joined(deltas) == message
    one_step_message, one_step_deltas = streamed(output.output_format(), [text])
    assert one_step_message == message and joined(one_step_deltas) == message


@pytest.fixture(scope="module")
def marker_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """Kimi's markers as special tokens of a byte-level BPE that encodes every character."""
    path: Path = tmp_path_factory.mktemp("tokenizer")
    write_tool_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def demo_tokenizer():
    """The demo model's tokenizer, which has no marker tokens: the markers are spelled by BPE pieces."""
    if not demo_model_available():
        pytest.skip("the demo model is not built")
    return AutoTokenizer.from_pretrained(str(DEMO_TARGET_DIR))


def engine_texts(tokenizer, token_ids: list[int], steps: list[int]) -> list[str]:
    """The output text after each engine step, as the engine's detokenizer makes it when the step
    appends the next ``steps[k]`` tokens (a sampled token or an accepted speculative block)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    texts, start = [], 0
    for size in steps:
        if start >= len(token_ids):
            break
        detokenizer.append(token_ids[start : start + size])
        start += size
        texts.append(detokenizer.text)
    detokenizer.append(token_ids[start:])
    detokenizer.finish()
    return texts + [detokenizer.text]


@pytest.mark.parametrize("tokenizer_name", ["marker_tokenizer", "demo_tokenizer"])
def test_any_grouping_of_the_tokens_gives_the_same_message_and_deltas(tokenizer_name: str, request) -> None:
    tokenizer = request.getfixturevalue(tokenizer_name)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(outputs(), st.lists(st.integers(1, 8), max_size=80))
    def check(output: Output, steps: list[int]) -> None:
        text = output.text()
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(token_ids, skip_special_tokens=False) == text  # the tokenizer keeps every character
        message, deltas = streamed(output.output_format(), engine_texts(tokenizer, token_ids, steps))
        assert message == output.message()
        assert joined(deltas) == message

    check()
