"""What a chat request's ``response_format`` and constraining ``tool_choice`` make of its output:
the ``StructuredOutput`` the engine enforces while decoding (issue 36 item 3).

- ``response_format`` ``{"type": "json_object"}``: any JSON object; ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}``: JSON matching the schema (enforced whatever
  ``strict`` says, as vLLM); ``"text"``: nothing.
- ``tool_choice`` ``"required"`` or a named function: the output is Kimi-K2's tool-call section,
  one call (or, with ``parallel_tool_calls``, up to ``MAX_CONSTRAINED_CALLS``) of the allowed
  functions, each call's arguments JSON matching the tool's ``parameters`` schema; then the end of
  the output. It takes precedence over ``response_format`` (the answer is the calls).
- A prompt that leaves a thinking section open keeps it free: the grammar starts with any text up
  to ``</think>``, the reasoning parser reads it as before.

Markers that are special tokens of the tokenizer are required as those tokens (text never matches
them), others as their characters.
"""

from __future__ import annotations

from typing import Any

from eaglet.grammar.lark import json_value, literal, text_up_to
from eaglet.sampling_params import StructuredOutput
from eaglet.server.errors import APIError
from eaglet.server.kimi_k2_output import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, THINK_CLOSE
from eaglet.server.protocol import ChatCompletionRequest, NamedToolChoice, ResponseFormat
from eaglet.server.tool_calls import ToolUse

MAX_CONSTRAINED_CALLS = 8


def structured_output(
    body: ChatCompletionRequest, tools: ToolUse, starts_in_reasoning: bool, special_ids: dict[str, int]
) -> StructuredOutput | None:
    """The request's output constraint, or None; ``special_ids``: the special tokens by text."""
    if tools.choice == "required" or isinstance(tools.choice, NamedToolChoice):
        body_expr, rules = _tool_calls(body, tools, special_ids)
        return StructuredOutput(lark=_grammar(body_expr, rules, starts_in_reasoning, special_ids))
    schema = _response_schema(body.response_format)
    if schema is None:
        return None
    if starts_in_reasoning:
        return StructuredOutput(lark=_grammar(json_value(schema), [], starts_in_reasoning, special_ids))
    if body.response_format.type == "json_object":
        return StructuredOutput(json_object=True)
    return StructuredOutput(json_schema=schema)


def schema_alone(body: ChatCompletionRequest) -> StructuredOutput | None:
    """The response_format's JSON schema by itself (None without one): checked before the grammar
    that embeds it after a thinking section, so a bad schema is reported as the schema's error."""
    if body.response_format is None or body.response_format.type != "json_schema":
        return None
    return StructuredOutput(json_schema=_response_schema(body.response_format))


def _response_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.json_schema is None:
        raise APIError(400, "response_format of type 'json_schema' needs a json_schema object", "response_format.json_schema")
    if response_format.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema needs a schema", "response_format.json_schema.schema")
    return response_format.json_schema.schema_


def _grammar(body_expr: str, rules: list[str], starts_in_reasoning: bool, special_ids: dict[str, int]) -> str:
    """A Lark grammar of ``body_expr`` (after free reasoning text up to ``</think>`` when the prompt
    left a thinking section open) with its ``rules``."""
    if not starts_in_reasoning:
        return "\n".join([f"start: {body_expr}", *rules])
    if THINK_CLOSE in special_ids:  # text cannot hold the special token: it ends where the token comes
        reasoning = f"reasoning: /(?s:.*)/ {literal(THINK_CLOSE, special_ids[THINK_CLOSE])}"
    else:
        reasoning = f"reasoning[lazy]: {text_up_to(THINK_CLOSE)}"
    return "\n".join([f"start: reasoning {body_expr}", reasoning, *rules])


def _tool_calls(body: ChatCompletionRequest, tools: ToolUse, special_ids: dict[str, int]) -> tuple[str, list[str]]:
    """The tool-call section's expression and rules: calls numbered from 0, each one of the allowed
    functions with arguments matching its parameters."""

    def marker(text: str) -> str:
        return literal(text, special_ids.get(text))

    allowed = [t.function for t in body.tools or []]
    if isinstance(tools.choice, NamedToolChoice):
        allowed = [f for f in allowed if f.name == tools.choice.function.name]
    max_calls = 1 if tools.max_calls == 1 or isinstance(tools.choice, NamedToolChoice) else MAX_CONSTRAINED_CALLS
    rules = []
    for i in range(max_calls):
        more = f" calls_{i + 1}?" if i + 1 < max_calls else ""
        rules.append(f"calls_{i}: call_{i}{more}")
        headers = " | ".join(
            f"{literal(f'functions.{f.name}:{i}')} {marker(ARGUMENT_BEGIN)} args_{k}" for k, f in enumerate(allowed)
        )
        rules.append(f"call_{i}: {marker(CALL_BEGIN)} ({headers}) {marker(CALL_END)}")
    for k, f in enumerate(allowed):
        rules.append(f"args_{k}: {json_value(f.parameters if f.parameters is not None else {'type': 'object'})}")
    return f"{marker(SECTION_BEGIN)} calls_0 {marker(SECTION_END)}", rules
