"""Training prompts: the JSONL format ``eaglet train-draft`` reads, rendered into engine requests.

One JSON object per line, one of:

* ``{"messages": [...], "images": ["a.png", ...]}``: chat messages (``role`` / ``content``) rendered
  with the target tokenizer's chat template and a generation prompt. An image appears in a
  message's content as a part ``{"type": "image"}`` (or ``"image_url"``); ``images`` lists the
  image files in the order their parts appear (the chat template emits one placeholder per part);
  relative paths are relative to the JSONL file's directory. Any assistant turn at the end is
  dropped: the target regenerates every response itself.
* ``{"prompt": "...", "images": [...]}``: one user turn, same as ``{"messages": [{"role": "user",
  "content": "..."}]}``; with ``images``, one image part per image precedes the text.
* ``{"prompt_token_ids": [...], "images": [...]}``: token ids used verbatim (one image
  placeholder id per image), for targets without a tokenizer.

Blank lines and lines starting with ``#`` are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPT_KEYS = ("messages", "prompt", "prompt_token_ids")


@dataclass
class PromptRecord:
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    images: list[Any] = field(default_factory=list)  # paths or PIL images

    @classmethod
    def from_json(cls, obj: Any, base_dir: Path | None = None, where: str = "prompt") -> PromptRecord:
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        keys = [k for k in PROMPT_KEYS if k in obj]
        if len(keys) != 1:
            raise ValueError(f"{where}: needs exactly one of {list(PROMPT_KEYS)}, got {sorted(obj)}")
        unknown = set(obj) - set(PROMPT_KEYS) - {"images"}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        images = obj.get("images") or []
        if not isinstance(images, list):
            raise ValueError(f"{where}: 'images' must be a list")
        images = [_resolve(img, base_dir) for img in images]
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of ints")
            return cls(prompt_token_ids=list(ids), images=images)
        if "prompt" in obj:
            text = obj["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"{where}: 'prompt' must be a string")
            content: str | list[dict] = text
            if images:
                content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
            return cls(messages=[{"role": "user", "content": content}], images=images)
        messages = obj["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise ValueError(f"{where}: no messages left before the response")
        return cls(messages=messages, images=images)

    def to_request(self, tokenizer: Any) -> dict[str, Any]:
        """The engine request (``{"prompt_token_ids": [...], "images": [...]}``) of this prompt."""
        if self.prompt_token_ids is not None:
            ids = self.prompt_token_ids
        else:
            if tokenizer is None:
                raise ValueError("chat prompts need the target's tokenizer (this target has none: use prompt_token_ids)")
            text = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        request: dict[str, Any] = {"prompt_token_ids": ids}
        if self.images:
            request["images"] = list(self.images)
        return request


def _resolve(image: Any, base_dir: Path | None) -> Any:
    if isinstance(image, str) and base_dir is not None and not Path(image).is_absolute():
        return str(base_dir / image)
    return image


def load_prompts(source: str | Path | list[dict[str, Any]]) -> list[PromptRecord]:
    """Prompt records from a JSONL file, or from a list of the same objects (Python callers)."""
    if isinstance(source, list):
        return [PromptRecord.from_json(obj, where=f"prompt {i}") for i, obj in enumerate(source)]
    path = Path(source)
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from exc
        records.append(PromptRecord.from_json(obj, path.parent, where))
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records
