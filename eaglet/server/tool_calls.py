"""What a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask of the server,
and whether the calls the model made satisfy them.

- ``tool_choice`` defaults to ``"auto"`` with tools and ``"none"`` without (as OpenAI).
- ``"none"``: the tools are not rendered into the prompt and the output is not read for calls;
  markers the model still writes stay in ``content`` as text. (vLLM renders the tools anyway
  unless started with ``--exclude-tools-when-tool-choice-none``; not telling the model of tools it
  may not call makes such stray calls rarer.)
- ``"auto"``, ``"required"``, a named function: the tools are rendered and the output is read for
  calls. ``"required"`` and a named function constrain decoding to the tool-call section with
  arguments matching the tools' parameter schemas (``structured_output.py``); they are checked
  again once the answer is complete (an output cut by max_tokens can still miss them), and a
  choice whose calls miss them says why in ``tool_choice_unmet``.
- ``parallel_tool_calls: false``: only the model's first call is returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglet.server.chat import template_tools
from eaglet.server.errors import APIError
from eaglet.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolCall, ToolChoiceMode


@dataclass(frozen=True)
class ToolUse:
    choice: ToolChoiceMode | NamedToolChoice
    template_tools: list[dict[str, Any]] | None  # what the chat template gets as tools=
    parse_calls: bool
    max_calls: int | None


def tool_use(body: ChatCompletionRequest, parser_available: bool) -> ToolUse:
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        shown = choice if isinstance(choice, str) else "a named function"
        raise APIError(400, f"tool_choice {shown!r} needs tools; the request has none", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {tool.function.name for tool in tools}:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                       "tool_choice.function.name")
    if choice == "none":
        return ToolUse(choice, None, parse_calls=False, max_calls=None)
    if not parser_available:
        raise APIError(400, "this server reads no tool calls from the model's output; start it with "
                            "--tool-call-parser kimi_k2 (or send tool_choice 'none')", "tools")
    return ToolUse(choice, template_tools(tools), parse_calls=True, max_calls=None if body.parallel_tool_calls else 1)


def unmet_tool_choice(choice: ToolChoiceMode | NamedToolChoice, calls: list[ToolCall]) -> str | None:
    """Why the calls do not satisfy ``tool_choice``, or None when they do."""
    if choice == "required" and not calls:
        return "tool_choice 'required' asked for a tool call and the model made none (the output ended before one)"
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if not calls:
            return f"tool_choice named {wanted!r} and the model made no tool call (the output ended before one)"
        others = sorted({call.function.name for call in calls} - {wanted})
        if others:
            return f"tool_choice named {wanted!r} and the model called {', '.join(map(repr, others))}"
    return None
