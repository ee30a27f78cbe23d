"""Kimi-K2.5's thinking read out of an output: where the reasoning starts (the prompt's open
``<think>`` or the output's own), where it ends (``</think>``, or a tool-call section), and the
cases the property test does not draw; and what the server takes from the request for it."""

from __future__ import annotations

import pytest

from eaglet.server import protocol as P
from eaglet.server.chat import check_template_kwargs
from eaglet.server.chat_output import ChoiceOutput
from eaglet.server.errors import APIError
from eaglet.server.kimi_k2_output import OutputFormat
from eaglet.server.output_parsing import OutputParsing, parser_enabled, prompt_opens_reasoning
from eaglet.testing.tool_checkpoints import write_tool_tokenizer

OPENED = OutputFormat(reasoning=True, starts_in_reasoning=True, tool_calls=True)
CLOSED = OutputFormat(reasoning=True, tool_calls=True)
CALL = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"


def parsed(text: str, output_format: OutputFormat) -> P.AssistantMessage:
    output = ChoiceOutput(output_format)
    output.read(text, finished=True)
    return output.message()


def test_reasoning_the_prompt_opened_ends_at_the_closing_tag() -> None:
    assert parsed("Hmm.</think>Yes.", OPENED) == P.AssistantMessage(content="Yes.", reasoning_content="Hmm.")
    assert parsed("</think>Yes.", OPENED) == P.AssistantMessage(content="Yes.")  # empty thinking: no field
    assert parsed("<think>Hmm.</think>Yes.", OPENED) == P.AssistantMessage(content="Yes.", reasoning_content="Hmm.")


def test_a_tool_call_section_ends_the_reasoning_too() -> None:
    message = parsed("I need f." + CALL, OPENED)
    assert message.reasoning_content == "I need f." and message.content is None and message.tool_calls[0].function.name == "f"


def test_reasoning_cut_off_is_all_reasoning() -> None:
    assert parsed("Still thinking <", OPENED) == P.AssistantMessage(content="", reasoning_content="Still thinking <")


def test_only_an_output_that_starts_with_the_tag_opens_reasoning_itself() -> None:
    assert parsed("<think>Hmm.</think>Yes.", CLOSED) == P.AssistantMessage(content="Yes.", reasoning_content="Hmm.")
    assert parsed("Tags: <think>x</think>", CLOSED) == P.AssistantMessage(content="Tags: <think>x</think>")
    off = OutputFormat(tool_calls=True)  # no reasoning parser: the tags are text
    assert parsed("<think>Hmm.</think>Yes.", off) == P.AssistantMessage(content="<think>Hmm.</think>Yes.")


@pytest.mark.parametrize(
    ("tail", "opens"),
    [("<|im_middle|><think>", True), ("<|im_middle|><think>\n", True), ("<|im_middle|><think></think>", False),
     ("<|im_middle|>", False)],
)
def test_whether_the_prompt_leaves_thinking_open(tail: str, opens: bool) -> None:
    assert prompt_opens_reasoning(tail) is opens


def test_parsers_by_setting_and_checkpoint() -> None:
    assert parser_enabled("auto", "kimi_k25") and parser_enabled("auto", "kimi_k2")
    assert not parser_enabled("auto", "deepseek_v3") and parser_enabled("kimi_k2", "deepseek_v3")
    assert not parser_enabled("none", "kimi_k25")
    with pytest.raises(ValueError, match="unknown output parser"):
        parser_enabled("hermes", "kimi_k25")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    write_tool_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def test_special_tokens_stay_in_the_engine_text_only_when_a_marker_is_one(tokenizer) -> None:
    parsing = OutputParsing.for_server(tokenizer, "auto", "auto", "kimi_k25")
    read = parsing.output_format(parse_tool_calls=True, max_tool_calls=None, prompt_tail="<think>", skip_special_tokens=True)
    assert read.starts_in_reasoning and read.tool_calls
    assert parsing.engine_keeps_special_tokens(read) and "<|im_end|>" in read.dropped  # the parser skips them instead
    kept = parsing.output_format(parse_tool_calls=False, max_tool_calls=None, prompt_tail="", skip_special_tokens=False)
    assert not kept.dropped  # the client asked for special tokens
    no_markers = OutputParsing(tool_calls=True, reasoning=True, special_texts=frozenset({"<|im_end|>"}))
    plain = no_markers.output_format(parse_tool_calls=True, max_tool_calls=None, prompt_tail="", skip_special_tokens=True)
    assert not no_markers.engine_keeps_special_tokens(plain) and not plain.dropped  # the engine skips as asked


def test_template_kwargs_may_not_replace_what_the_server_passes(tokenizer) -> None:
    check_template_kwargs(tokenizer, {"thinking": False, "reasoning_effort": "high"})
    for name in ("add_generation_prompt", "tools", "messages", "chat_template", "eos_token"):
        with pytest.raises(APIError, match=f"'{name}' is set by the server") as refused:
            check_template_kwargs(tokenizer, {name: "x"})
        assert refused.value.param == "chat_template_kwargs"
