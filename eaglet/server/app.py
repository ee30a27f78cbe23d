"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health,
/metrics, over one AsyncEngine.

Every refused request gets an OpenAI error object ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status; the engine and the other requests carry on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import PIL.Image
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from eaglet.engine.async_engine import AsyncEngine
from eaglet.executor.request import RequestOutput, TokenLogprob
from eaglet.errors import InvalidRequestError
from eaglet.multimodal.image_processor import load_image
from eaglet.sampling_params import SamplingParams
from eaglet.server import protocol as P
from eaglet.server.chat import render_chat_prompt, template_messages
from eaglet.server.images import ImageLimits, load_request_image
from eaglet.server.metrics import ServerMetrics, snapshot_engine
from eaglet.server.streams import SampleStreams, sample_params

logger = logging.getLogger("eaglet.server")

RequestModel = TypeVar("RequestModel", bound=BaseModel)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
}


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 32 * 2**20
    max_n: int = 16
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    default_completion_max_tokens: int = 16  # /v1/completions without max_tokens, as OpenAI


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorBody(message=message, type=_ERROR_TYPES.get(status, "Error"), param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The most specific problems first (the deepest location: for a union, the branch that got furthest)."""
    errors = sorted(exc.errors(), key=lambda e: -len(e["loc"]))
    locations = [".".join(str(part) for part in error["loc"]) for error in errors]
    described = [f"{loc or 'body'}: {error['msg']}" for loc, error in zip(locations[:2], errors)]
    return "; ".join(described), locations[0] or None


class _AbortingStreamingResponse(StreamingResponse):
    """Closes the body generator however the response ends (a client that disconnects included),
    so the engine requests behind it are aborted at once rather than when it is garbage collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already: the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(async_engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    engine = async_engine.engine
    tokenizer = engine.tokenizer
    metrics = ServerMetrics(config.model_name)
    app = FastAPI(title="eaglet", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    # Longest prompt + output one request may have: the context, and what the cache can hold at once.
    cache_tokens = engine.cache.allocator.num_usable * engine.cache.block_size - engine.spec_scratch
    max_total_tokens = min(engine.context_len, cache_tokens)
    token_text_cache: dict[int, str] = {}

    # ---- errors -------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    # ---- helpers ------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")

    async def read_body(request: Request, model: type[RequestModel]) -> RequestModel:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_request_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {config.max_request_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_request_bytes:
                raise APIError(413, f"request body exceeds the limit of {config.max_request_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise APIError(400, message, param) from None

    def check_model(name: str) -> None:
        if name not in (config.model_name, engine.config.model):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {config.model_name!r}", "model")

    def check_n(n: int) -> None:
        if n > config.max_n:
            raise APIError(400, f"n must be at most {config.max_n}, got {n}", "n")

    def max_new_tokens(requested: int | None, prompt_len: int, default: int | None, param: str) -> int:
        room = max_total_tokens - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this server's context holds at most {max_total_tokens} "
                f"tokens of prompt and output",
                param,
            )
        if requested is not None:
            return requested  # the engine refuses it, naming the sum, if it does not fit
        return room if default is None else min(default, room)

    def params_of(body: P.SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            stop=body.stop if body.stop is not None else [],
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=dict(body.logit_bias or {}),
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )

    async def encode(text: str) -> list[int]:
        # In the engine thread: the engine's detokenizers use the same tokenizer object.
        future = async_engine.call(lambda e: list(e.tokenizer.encode(text, add_special_tokens=False)))
        return await asyncio.wrap_future(future)

    def token_text(token_id: int) -> str:
        text = token_text_cache.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
            token_text_cache[token_id] = text
        return text

    def chat_logprobs(entries: list[TokenLogprob]) -> P.ChatLogprobs:
        content = []
        for entry in entries:
            top = [P.TopLogprob(token=token_text(t), logprob=lp, bytes=list(token_text(t).encode())) for t, lp in entry.top]
            text = token_text(entry.token_id)
            content.append(P.TokenLogprobEntry(token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=top))
        return P.ChatLogprobs(content=content)

    def completion_logprobs(entries: list[TokenLogprob], start_offset: int) -> P.CompletionLogprobs:
        tokens, offsets = [], []
        offset = start_offset
        for entry in entries:
            text = token_text(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return P.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{token_text(t): lp for t, lp in e.top} for e in entries],
            text_offset=offsets,
        )

    def spec_stats(out: RequestOutput) -> P.SpeculativeStats | None:
        if engine.spec_config is None:
            return None
        steps = out.spec_verify_ct
        return P.SpeculativeStats(
            accept_length=(out.spec_accepted_tokens + steps) / steps if steps else 0.0,
            verify_steps=steps,
            accepted_tokens=out.spec_accepted_tokens,
        )

    def usage_of(outputs: list[RequestOutput]) -> P.Usage:
        prompt_tokens = len(outputs[0].prompt_token_ids) if outputs else 0
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        total = prompt_tokens + completion_tokens
        return P.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=total)

    async def start_streams(prompt: Any, params: SamplingParams, n: int, request_id: str) -> SampleStreams:
        streams = SampleStreams(async_engine, prompt, sample_params(params, n), request_id, metrics)
        await streams.start()
        return streams

    async def decode_images(urls: list[str]) -> list[PIL.Image.Image]:
        limits = config.image_limits
        if len(urls) > limits.max_images:
            raise APIError(400, f"{len(urls)} images in one request; the limit is {limits.max_images}", "messages")
        if urls and engine.image_processor is None:
            raise APIError(400, "this model has no vision tower; image_url content parts are not accepted", "messages")
        return await asyncio.to_thread(lambda: [load_image(load_request_image(url, limits)) for url in urls])

    async def final_outputs_unless_disconnected(request: Request, streams: SampleStreams) -> list[RequestOutput]:
        """The finished outputs; a client that leaves first gets its requests aborted (and no answer)."""
        result = asyncio.ensure_future(streams.final_outputs())
        disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({result, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                result.cancel()
                raise ClientGone()
            return result.result()
        finally:
            disconnected.cancel()
            await streams.close()

    def sse(model: BaseModel) -> str:
        return f"data: {json.dumps(P.dump(model), ensure_ascii=False)}\n\n"

    def sse_error(exc: Exception) -> str:
        status = 400 if isinstance(exc, InvalidRequestError) else 500
        body = P.ErrorResponse(error=P.ErrorBody(message=str(exc), type=_ERROR_TYPES[status], code=status))
        return f"data: {json.dumps(body.model_dump())}\n\n"

    # ---- endpoints ----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        snapshot = await asyncio.wrap_future(async_engine.call(snapshot_engine))
        return Response(metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        check_auth(request)
        card = P.ModelCard(id=config.model_name, created=created, root=engine.config.model, max_model_len=engine.context_len)
        return JSONResponse(P.ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        body = await read_body(request, P.ChatCompletionRequest)
        check_model(body.model)
        check_n(body.n)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        messages, image_urls = template_messages(body.messages)
        images = await decode_images(image_urls)
        token_ids = await encode(render_chat_prompt(tokenizer, messages))
        prompt_len = len(token_ids) + sum(engine.image_processor.num_placeholder_tokens(i.height, i.width) - 1 for i in images)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "messages"
        max_tokens = max_new_tokens(requested, prompt_len, None, param)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = params_of(body, max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await start_streams({"prompt_token_ids": token_ids, "images": images}, params, body.n, request_id)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _AbortingStreamingResponse(
                chat_events(streams, request_id, body.model, body.logprobs, include_usage), media_type="text/event-stream"
            )
        outputs = await final_outputs_unless_disconnected(request, streams)
        choices = [
            P.ChatChoice(
                index=j,
                message=P.AssistantMessage(content=out.text or ""),
                logprobs=chat_logprobs(out.logprobs) if body.logprobs else None,
                finish_reason=out.finish_reason,
                speculative=spec_stats(out),
            )
            for j, out in enumerate(outputs)
        ]
        response = P.ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=body.model, choices=choices, usage=usage_of(outputs)
        )
        return JSONResponse(P.dump(response))

    async def chat_events(
        streams: SampleStreams, request_id: str, model: str, want_logprobs: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        created_at = int(time.time())
        n = len(streams.timers)

        def chunk(choices: list[P.ChatChunkChoice], usage: P.Usage | None = None) -> str:
            return sse(P.ChatCompletionChunk(id=request_id, created=created_at, model=model, choices=choices, usage=usage))

        sent_text = [""] * n
        sent_tokens = [0] * n
        last: dict[int, RequestOutput] = {}
        try:
            for j in range(n):
                yield chunk([P.ChatChunkChoice(index=j, delta=P.DeltaMessage(role="assistant", content=""))])
            async for j, out in streams.outputs():
                last[j] = out
                text = out.text or ""
                delta = text[len(sent_text[j]) :]
                new_logprobs = out.logprobs[sent_tokens[j] :] if want_logprobs and out.logprobs is not None else []
                if not delta and not new_logprobs and not out.finished:
                    continue
                sent_text[j] = text
                sent_tokens[j] = len(out.token_ids)
                yield chunk([
                    P.ChatChunkChoice(
                        index=j,
                        delta=P.DeltaMessage(content=delta),
                        logprobs=chat_logprobs(new_logprobs) if want_logprobs else None,
                        finish_reason=out.finish_reason,
                        speculative=spec_stats(out) if out.finished else None,
                    )
                ])
            if include_usage:
                yield chunk([], usage_of([last[j] for j in range(n)]))
        except Exception as exc:
            logger.exception("stream %s failed", request_id)
            yield sse_error(exc)
        finally:
            await streams.close()
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        body = await read_body(request, P.CompletionRequest)
        check_model(body.model)
        check_n(body.n)
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise APIError(400, "prompt is empty", "prompt")
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids", "prompt")
            token_ids = await encode(body.prompt)
        else:
            if not body.prompt:
                raise APIError(400, "prompt is an empty list of token ids", "prompt")
            token_ids = list(body.prompt)
        default = config.default_completion_max_tokens
        max_tokens = max_new_tokens(body.max_tokens, len(token_ids), default, "prompt")
        params = params_of(body, max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await start_streams({"prompt_token_ids": token_ids}, params, body.n, request_id)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _AbortingStreamingResponse(
                completion_events(streams, request_id, body.model, body.logprobs is not None, include_usage),
                media_type="text/event-stream",
            )
        outputs = await final_outputs_unless_disconnected(request, streams)
        choices = [
            P.CompletionChoice(
                index=j,
                text=out.text or "",
                logprobs=completion_logprobs(out.logprobs, 0) if out.logprobs is not None else None,
                finish_reason=out.finish_reason,
                speculative=spec_stats(out),
            )
            for j, out in enumerate(outputs)
        ]
        response = P.CompletionResponse(
            id=request_id, created=int(time.time()), model=body.model, choices=choices, usage=usage_of(outputs)
        )
        return JSONResponse(P.dump(response))

    async def completion_events(
        streams: SampleStreams, request_id: str, model: str, want_logprobs: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        created_at = int(time.time())
        n = len(streams.timers)
        sent_text = [""] * n
        sent_tokens = [0] * n
        last: dict[int, RequestOutput] = {}

        def chunk(choices: list[P.CompletionChoice], usage: P.Usage | None = None) -> str:
            return sse(P.CompletionResponse(id=request_id, created=created_at, model=model, choices=choices, usage=usage))

        try:
            async for j, out in streams.outputs():
                last[j] = out
                text = out.text or ""
                delta = text[len(sent_text[j]) :]
                new_logprobs = out.logprobs[sent_tokens[j] :] if want_logprobs and out.logprobs is not None else []
                if not delta and not new_logprobs and not out.finished:
                    continue
                logprobs = completion_logprobs(new_logprobs, len(sent_text[j])) if want_logprobs else None
                sent_text[j] = text
                sent_tokens[j] = len(out.token_ids)
                yield chunk([
                    P.CompletionChoice(
                        index=j, text=delta, logprobs=logprobs, finish_reason=out.finish_reason,
                        speculative=spec_stats(out) if out.finished else None,
                    )
                ])
            if include_usage:
                yield chunk([], usage_of([last[j] for j in range(n)]))
        except Exception as exc:
            logger.exception("stream %s failed", request_id)
            yield sse_error(exc)
        finally:
            await streams.close()
        yield "data: [DONE]\n\n"

    return app
