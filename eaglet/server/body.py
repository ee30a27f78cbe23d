"""A POST body as the endpoints take it, or an APIError that says what is wrong with it.

JSON only (415 otherwise): a browser may send a form or text/plain body to any origin without
asking first, so a page on any site could otherwise make a local server generate. Parsed by
pydantic's own parser (jiter), which refuses what Python's ``json`` lets through to fail later:
escapes of lone UTF-16 surrogates (strings that cannot be encoded again), nesting deep enough to
exhaust the stack, NaN and Infinity.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import pydantic_core
from fastapi import Request
from pydantic import BaseModel, ValidationError

from eaglet.server.errors import APIError

RequestModel = TypeVar("RequestModel", bound=BaseModel)

JSON_MEDIA_TYPE = "application/json"
# Bodies above this many bytes are parsed and validated on a worker thread: a 30 MB body takes the
# parser ~85 ms, which on the event loop would stall every stream's next chunk for as long.
PARSE_INLINE_MAX_BYTES = 1 << 20


def check_json_content_type(request: Request) -> None:
    declared = request.headers.get("content-type")
    media_type = (declared or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        shown = f"{declared!r}" if declared is not None else "none"
        raise APIError(415, f"request bodies must be JSON (Content-Type: {JSON_MEDIA_TYPE}); got Content-Type {shown}")


async def read_raw_body(request: Request, max_bytes: int) -> bytearray:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    # Grown chunk by chunk: joining tens of MB at the end would hold the GIL (every stream) at once.
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
        body += chunk
    return body


def parse_json_object(raw: bytes | bytearray) -> dict:
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}{_hint(str(exc))}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {_json_type(data)}")
    return data


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The most specific problems first (the deepest location: for a union, the branch that got furthest)."""
    errors = sorted(exc.errors(), key=lambda e: -len(e["loc"]))
    locations = [".".join(str(part) for part in error["loc"]) for error in errors]
    described = [f"{loc or 'body'}: {error['msg']}" for loc, error in zip(locations[:2], errors)]
    return "; ".join(described), locations[0] or None


async def read_json_body(request: Request, model: type[RequestModel], max_bytes: int) -> RequestModel:
    check_json_content_type(request)
    raw = await read_raw_body(request, max_bytes)
    if len(raw) > PARSE_INLINE_MAX_BYTES:
        return await asyncio.to_thread(_parse_and_validate, raw, model)
    return _parse_and_validate(raw, model)


def _parse_and_validate(raw: bytes | bytearray, model: type[RequestModel]) -> RequestModel:
    data = parse_json_object(raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(400, message, param) from None


def _hint(parser_message: str) -> str:
    if "surrogate" in parser_message or "hex escape" in parser_message:
        return " (a \\ud800-\\udfff escape must be one half of a UTF-16 surrogate pair)"
    if "recursion limit" in parser_message:
        return " (arrays and objects are nested too deeply)"
    return ""


def _json_type(value: object) -> str:
    names = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
