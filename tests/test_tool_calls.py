"""Kimi-K2's tool-call format read out of an output (the cases the property test does not draw:
odd headers, cut-off calls, markers out of place, skipped special tokens), and what a request's
tools and tool_choice ask of the server."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from eaglet.commands import serve
from eaglet.demo_model import DEMO_TARGET_DIR, demo_model_available
from eaglet.server import protocol as P
from eaglet.server.chat_output import ChoiceOutput
from eaglet.server.errors import APIError
from eaglet.server.kimi_k2_output import OutputFormat
from eaglet.server.marker_scanner import Marker, MarkerScanner, Text
from eaglet.server.prompts import PromptEncoder
from eaglet.server.tool_calls import tool_use, unmet_tool_choice

TOOLS = OutputFormat(tool_calls=True)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def parsed(text: str, output_format: OutputFormat = TOOLS) -> P.AssistantMessage:
    output = ChoiceOutput(output_format)
    output.read(text, finished=True)
    return output.message()


def call(index_id: str, name: str, arguments: str) -> P.ToolCall:
    return P.ToolCall(id=index_id, function=P.FunctionCall(name=name, arguments=arguments))


def section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def kimi_call(header: str, arguments: str) -> str:
    return f"<|tool_call_begin|>{header}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


def test_calls_after_text_with_kimi_ids_and_any_name() -> None:
    text = "I'll look." + section(kimi_call("functions.get_weather:0", '{"city": "Paris"}'),
                                  kimi_call(" functions.mcp.search:7\n", "{}"))
    assert parsed(text) == P.AssistantMessage(
        content="I'll look.",
        tool_calls=[call("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                    call("functions.mcp.search:7", "mcp.search", "{}")],
    )


def test_headers_without_the_prefix_or_the_index() -> None:
    text = section(kimi_call("get_weather:3", "{}"), kimi_call("functions.get_time", "{}"))
    assert parsed(text).tool_calls == [call("get_weather:3", "get_weather", "{}"), call("functions.get_time:1", "get_time", "{}")]


def test_a_cut_off_call_keeps_its_arguments_and_a_cut_off_header_is_no_call() -> None:
    arguments_cut = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": [1,"
    assert parsed(arguments_cut).tool_calls == [call("functions.f:0", "f", '{"a": [1,')]
    header_cut = "Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.get_wea"
    assert parsed(header_cut) == P.AssistantMessage(content="Hi")
    assert parsed("Hi<|tool_calls_sec") == P.AssistantMessage(content="Hi<|tool_calls_sec")  # no marker after all


def test_text_after_the_section_is_content_and_text_between_calls_is_ignored() -> None:
    text = "a" + section(kimi_call("functions.f:0", "{}") + " \n junk ") + "b"
    assert parsed(text) == P.AssistantMessage(content="ab", tool_calls=[call("functions.f:0", "f", "{}")])


def test_without_parallel_tool_calls_only_the_first_call_is_returned() -> None:
    text = section(kimi_call("functions.f:0", "{}"), kimi_call("functions.g:1", "{}"))
    assert parsed(text, OutputFormat(tool_calls=True, max_tool_calls=1)).tool_calls == [call("functions.f:0", "f", "{}")]


def test_markers_out_of_place_are_text_and_unparsed_markers_are_content() -> None:
    assert parsed("x<|tool_call_end|>y") == P.AssistantMessage(content="x<|tool_call_end|>y")
    text = section(kimi_call("functions.f:0", "{}"))
    assert parsed(text, OutputFormat()) == P.AssistantMessage(content=text)


def test_skipped_special_tokens_are_removed_everywhere_but_the_markers_stay() -> None:
    dropped = frozenset({"<|im_end|>", "[EOS]", "<|tool_call_begin|>"})
    text = "a<|im_end|>b" + section(kimi_call("functions.f:0", '{"x": "[EOS]"}')) + "<|im_end|>"
    assert parsed(text, OutputFormat(tool_calls=True, dropped=dropped)) == P.AssistantMessage(
        content="ab", tool_calls=[call("functions.f:0", "f", '{"x": ""}')]
    )


def test_the_scanner_holds_back_a_possible_marker_and_prefers_the_longest() -> None:
    scanner = MarkerScanner(["<a>", "<a>b", "<c>"])
    assert scanner.feed("x<") == [Text("x")]
    assert scanner.feed("a>") == []  # "<a>" now, but "<a>b" may follow
    assert scanner.feed("bz<c") == [Marker("<a>b"), Text("z")]
    assert scanner.finish() == [Text("<c")]
    assert MarkerScanner(["<a>", "<a>b"]).feed("<a>c") == [Marker("<a>"), Text("c")]


def request(**fields) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_choice_defaults_and_what_each_renders_and_parses() -> None:
    assert tool_use(request(), parser_available=True).choice == "none"
    auto = tool_use(request(tools=[WEATHER]), parser_available=True)
    assert auto.choice == "auto" and auto.parse_calls and auto.template_tools == [WEATHER] and auto.max_calls is None
    none = tool_use(request(tools=[WEATHER], tool_choice="none"), parser_available=False)
    assert none.template_tools is None and not none.parse_calls  # not rendered, not parsed, no parser needed
    single = tool_use(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), parser_available=True)
    assert single.parse_calls and single.max_calls == 1


@pytest.mark.parametrize(
    ("fields", "parser", "param", "message"),
    [
        ({"tool_choice": "required"}, True, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, True,
         "tool_choice.function.name", "not among the tools"),
        ({"tools": [WEATHER, WEATHER]}, True, "tools.1.function.name", "names two tools"),
        ({"tools": [WEATHER]}, False, "tools", "--tool-call-parser kimi_k2"),
    ],
)
def test_tool_requests_the_server_refuses(fields: dict, parser: bool, param: str, message: str) -> None:
    with pytest.raises(APIError, match=message) as refused:
        tool_use(request(**fields), parser_available=parser)
    assert refused.value.status == 400 and refused.value.param == param


def test_required_and_named_tool_choice_are_checked_after_the_fact() -> None:
    weather = [call("functions.get_weather:0", "get_weather", "{}")]
    named = P.NamedToolChoice(type="function", function=P.NamedFunction(name="get_time"))
    assert unmet_tool_choice("auto", []) is None
    assert unmet_tool_choice("required", weather) is None
    assert "made none" in unmet_tool_choice("required", [])
    assert "called 'get_weather'" in unmet_tool_choice(named, weather)
    assert "no tool call" in unmet_tool_choice(named, [])
    assert unmet_tool_choice(named, [call("functions.get_time:0", "get_time", "{}")]) is None


def test_serve_flags_choose_the_parsers() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.server_config(parser.parse_args(["--tool-call-parser", "none"]), "m")
    assert config.tool_call_parser == "none" and config.reasoning_parser == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "deepseek_r1"])


@pytest.mark.skipif(not demo_model_available(), reason="the demo model is not built")
def test_a_template_that_ignores_tools_renders_as_without_them(tmp_path) -> None:
    from transformers import AutoTokenizer

    from eaglet.testing.checkpoints import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, 256, chat_style="kimi")  # Kimi's template without tools or thinking
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(tmp_path)), 1000)
    try:
        messages = [{"role": "user", "content": "Hi"}]
        history = [*messages, {"role": "assistant", "content": "", "tool_calls": [call("functions.f:0", "f", "{}").model_dump()]},
                   {"role": "tool", "content": "42", "tool_call_id": "functions.f:0"}]
        plain = asyncio.run(encoder.encode_chat(messages))
        assert asyncio.run(encoder.encode_chat(messages, [WEATHER], {"thinking": False})) == plain
        assert len(asyncio.run(encoder.encode_chat(history, [WEATHER]))) > len(plain)
    finally:
        encoder.close()
