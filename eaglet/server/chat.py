"""Chat messages to a prompt: the model's own chat template (from its tokenizer config), with each
image part rendered as the template renders images, which for Kimi-K2.5 puts one media
placeholder token per image where the engine expects it (see ``Engine._prepare_prompt``).

Tools, earlier tool calls, tool results and per-request template variables reach the template the
way transformers' ``apply_chat_template`` passes them (``tools=``, ``message.tool_calls``,
``role: "tool"`` with ``tool_call_id``, extra keyword arguments such as ``thinking``), which is what
vLLM and SGLang do; a template that has no use for them renders as before.
"""

from __future__ import annotations

import inspect
from typing import Any

from eaglet.errors import InvalidRequestError
from eaglet.server.errors import APIError
from eaglet.server.protocol import ChatMessage, ImagePart, TextPart, ToolDefinition


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages as chat templates take them, and the image URLs in order of appearance.

    Text-only content becomes a plain string (templates written for string content then work);
    content with images stays a list of parts, each image part without its (possibly huge) URL.
    """
    check_tool_messages(messages)
    rendered: list[dict[str, Any]] = []
    image_urls: list[str] = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        content = message.content
        if content is None:
            content = ""
        if isinstance(content, list):
            if all(isinstance(part, TextPart) for part in content):
                content = "".join(part.text for part in content)
            else:
                parts: list[dict[str, Any]] = []
                for part in content:
                    if isinstance(part, ImagePart):
                        image_urls.append(part.image_url.url)
                        parts.append({"type": "image_url", "image_url": {"url": f"<image {len(image_urls)}>"}})
                    else:
                        parts.append({"type": "text", "text": part.text})
                content = parts
        entry: dict[str, Any] = {"role": role, "content": content}
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        rendered.append(entry)
    return rendered, image_urls


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Tool calls only on assistant messages; each tool message answers a call made before it."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise APIError(400, f"messages.{i}: only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        if message.role == "assistant":
            called.update(call.id for call in message.tool_calls or [])
        if message.role != "tool":
            continue
        param = f"messages.{i}.tool_call_id"
        if not message.tool_call_id:
            raise APIError(400, f"{param}: a tool message needs the id of the tool call it answers", param)
        if message.tool_call_id not in called:
            raise APIError(
                400, f"{param}: {message.tool_call_id!r} is not the id of a tool call in an earlier assistant message", param
            )


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """Tools as templates take them (OpenAI's form, unset fields left out); None for no tools."""
    if not tools:
        return None
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"tools.{i}.function.name: {name!r} names two tools", f"tools.{i}.function.name")
    return [tool.model_dump(exclude_none=True) for tool in tools]


def check_template_kwargs(tokenizer: Any, kwargs: dict[str, Any]) -> None:
    """Refuses template variables that would replace what the server itself passes (the messages,
    the tools, the special tokens, apply_chat_template's own options)."""
    if tokenizer is None:
        return
    reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
    reserved |= set(getattr(tokenizer, "special_tokens_map", {}))
    for name in kwargs:
        if name in reserved:
            raise APIError(400, f"chat_template_kwargs: {name!r} is set by the server, not the request",
                           "chat_template_kwargs")


def render_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text the model's chat template makes of the messages, ready for the assistant turn."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, so it cannot chat; send token ids (/v1/completions)")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; send a plain prompt (/v1/completions, or eaglet generate --raw)"
        )
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    except Exception as exc:  # a template may raise on what it does not support (jinja raise_exception)
        raise InvalidRequestError(f"the model's chat template rejected the messages: {exc}") from exc
