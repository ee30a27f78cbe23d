"""Chat messages to a prompt: the model's own chat template (from its tokenizer config), with each
image part rendered as the template renders images, which for Kimi-K2.5 puts one media
placeholder token per image where the engine expects it (see ``Engine._prepare_prompt``)."""

from __future__ import annotations

from typing import Any

from eaglet.errors import InvalidRequestError
from eaglet.server.protocol import ChatMessage, ImagePart, TextPart


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages as chat templates take them, and the image URLs in order of appearance.

    Text-only content becomes a plain string (templates written for string content then work);
    content with images stays a list of parts, each image part without its (possibly huge) URL.
    """
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
        rendered.append({"role": role, "content": content})
    return rendered, image_urls


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text the model's chat template makes of the messages, ready for the assistant turn."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, so it cannot chat; send token ids (/v1/completions)")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; send a plain prompt (/v1/completions, or eaglet generate --raw)"
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # a template may raise on what it does not support (jinja raise_exception)
        raise InvalidRequestError(f"the model's chat template rejected the messages: {exc}") from exc
