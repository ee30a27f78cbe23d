"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health,
/metrics, over one AsyncEngine.

Every refused request gets an OpenAI error object ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status; the engine and the other requests carry on. Prompts are tokenized
off the engine's thread (``PromptEncoder``), so no request's input can stall the others' steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import PIL.Image
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from eaglet.engine.async_engine import AsyncEngine
from eaglet.errors import InvalidRequestError
from eaglet.executor.request import RequestOutput
from eaglet.multimodal.image_processor import load_image
from eaglet.sampling_params import SamplingParams
from eaglet.server import protocol as P
from eaglet.server.body import RequestModel, read_json_body
from eaglet.server.chat import check_template_kwargs, template_messages
from eaglet.server.chat_output import ChoiceOutput, delta_messages
from eaglet.server.completion_prompts import completion_prompts
from eaglet.server.errors import ERROR_TYPES, APIError, error_response
from eaglet.server.images import ImageLimits, load_request_image
from eaglet.server.kimi_k2_output import OutputFormat
from eaglet.server.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    output_entries,
    prompt_entries,
)
from eaglet.server.metrics import ServerMetrics, snapshot_engine
from eaglet.server.output_parsing import OutputParsing
from eaglet.server.prompts import PromptEncoder
from eaglet.server.step_tally import StepTally
from eaglet.server.streams import SampleStreams
from eaglet.server.structured_output import schema_alone, structured_output
from eaglet.server.tool_calls import tool_use, unmet_tool_choice

logger = logging.getLogger("eaglet.server")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 32 * 2**20
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions request
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    default_completion_max_tokens: int = 16  # /v1/completions without max_tokens, as OpenAI
    allow_special_tokens_in_messages: bool = False  # chat message text may then hold control tokens
    metrics_behind_api_key: bool = False
    health_stall_timeout_s: float = 20.0  # /health fails while one engine step or command runs longer
    # Output parsers, as vLLM / SGLang name them: "kimi_k2", "none", or "auto" (kimi_k2 for Kimi checkpoints).
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"


_MIN_TEMPERATURE = 1e-2


def _usable_temperature(temperature: float) -> float:
    # As vLLM: a positive temperature below 0.01 is raised to it, since logits divided by a tiny
    # one overflow to inf (and sampling to NaN); 0 stays greedy.
    return temperature if temperature == 0 else max(temperature, _MIN_TEMPERATURE)


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


def create_app(async_engine: AsyncEngine, config: ServerConfig, tally: StepTally) -> FastAPI:
    """The app over a running engine; ``tally`` is the one ``start_engine`` counts generated tokens into."""
    engine = async_engine.engine
    metrics = ServerMetrics(config.model_name, tally)
    created = int(time.time())
    # Longest prompt + output one request may have: the context, and what the cache can hold at once.
    cache_tokens = engine.cache.allocator.num_usable * engine.cache.block_size - engine.spec_scratch
    max_total_tokens = min(engine.context_len, cache_tokens)
    encoder = PromptEncoder(engine.tokenizer, max_total_tokens - 1, config.allow_special_tokens_in_messages)
    token_text = TokenTexts(engine.tokenizer)
    parsing = OutputParsing.for_server(
        engine.tokenizer, config.tool_call_parser, config.reasoning_parser, engine.model_config.architecture
    )
    special_ids = {text: engine.tokenizer.convert_tokens_to_ids(text) for text in parsing.special_texts}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        encoder.close()

    app = FastAPI(title="eaglet", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

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
        return await read_json_body(request, model, config.max_request_bytes)

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

    def params_of(
        body: P.SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=_usable_temperature(body.temperature),
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
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
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

    def usage_of(outputs: list[RequestOutput], n: int) -> P.Usage:
        """Each prompt's tokens once (its n choices share it), every choice's completion tokens."""
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs[::n])
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        total = prompt_tokens + completion_tokens
        return P.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=total)

    async def start_streams(requests: list[tuple[Any, SamplingParams]], request_id: str) -> SampleStreams:
        streams = SampleStreams(async_engine, requests, request_id, metrics)
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
        body = P.ErrorResponse(error=P.ErrorBody(message=str(exc), type=ERROR_TYPES[status], code=status))
        return f"data: {json.dumps(body.model_dump())}\n\n"

    # ---- endpoints ----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            reason = f": {async_engine.fatal}" if async_engine.fatal is not None else ""
            return error_response(503, f"the engine thread has stopped{reason}")
        busy = async_engine.busy_seconds()
        if busy > config.health_stall_timeout_s:
            return error_response(
                503, f"the engine has been on one step for {busy:.1f} s (the limit is {config.health_stall_timeout_s} s)"
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        if config.metrics_behind_api_key:
            check_auth(request)
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
        tools = tool_use(body, parsing.tool_calls)
        template_kwargs = body.chat_template_kwargs or {}
        check_template_kwargs(engine.tokenizer, template_kwargs)
        messages, image_urls = template_messages(body.messages)
        images = await decode_images(image_urls)
        token_ids = await encoder.encode_chat(messages, tools.template_tools, template_kwargs)
        prompt_len = len(token_ids) + sum(engine.image_processor.num_placeholder_tokens(i.height, i.width) - 1 for i in images)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "messages"
        max_tokens = max_new_tokens(requested, prompt_len, None, param)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        # The prompt's last characters say whether it leaves a thinking section open.
        prompt_tail = await encoder.decode(token_ids[-16:]) if parsing.reasoning else ""
        output_format = parsing.output_format(
            parse_tool_calls=tools.parse_calls, max_tool_calls=tools.max_calls, prompt_tail=prompt_tail,
            skip_special_tokens=body.skip_special_tokens,
        )
        constraint = structured_output(body, tools, output_format.starts_in_reasoning, special_ids)
        if constraint is not None:  # a schema or grammar that does not compile is a 400, found off the engine's thread
            schema = schema_alone(body)
            if schema is not None and constraint.lark is not None:
                await asyncio.to_thread(engine.grammars.check, schema)
            await asyncio.to_thread(engine.grammars.check, constraint)
        params = dataclasses.replace(params_of(body, max_tokens, logprobs), structured_output=constraint)
        if parsing.engine_keeps_special_tokens(output_format):
            params = dataclasses.replace(params, skip_special_tokens=False)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = {"prompt_token_ids": token_ids, "images": images}
        streams = await start_streams([(prompt, p) for p in dataclasses.replace(params, n=body.n).per_sample()], request_id)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _AbortingStreamingResponse(
                chat_events(streams, request_id, body.model, body.logprobs, include_usage, output_format, tools.choice),
                media_type="text/event-stream",
            )
        outputs = await final_outputs_unless_disconnected(request, streams)
        choices = []
        for j, out in enumerate(outputs):
            output = ChoiceOutput(output_format)
            output.read(out.text or "", finished=True)
            choices.append(P.ChatChoice(
                index=j,
                message=output.message(),
                logprobs=chat_logprobs(out.logprobs, token_text) if body.logprobs else None,
                finish_reason=output.finish_reason(out.finish_reason),
                speculative=spec_stats(out),
                tool_choice_unmet=unmet_tool_choice(tools.choice, output.tool_calls),
            ))
        response = P.ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=body.model, choices=choices, usage=usage_of(outputs, body.n)
        )
        return JSONResponse(P.dump(response))

    async def chat_events(
        streams: SampleStreams,
        request_id: str,
        model: str,
        want_logprobs: bool,
        include_usage: bool,
        output_format: OutputFormat,
        tool_choice: P.ToolChoiceMode | P.NamedToolChoice,
    ) -> AsyncIterator[str]:
        created_at = int(time.time())
        n = len(streams.timers)

        def chunk(choices: list[P.ChatChunkChoice], usage: P.Usage | None = None) -> str:
            return sse(P.ChatCompletionChunk(id=request_id, created=created_at, model=model, choices=choices, usage=usage))

        outputs = [ChoiceOutput(output_format) for _ in range(n)]
        sent_tokens = [0] * n
        last: dict[int, RequestOutput] = {}
        try:
            for j in range(n):
                yield chunk([P.ChatChunkChoice(index=j, delta=P.DeltaMessage(role="assistant", content=""))])
            async for j, out in streams.outputs():
                last[j] = out
                deltas = delta_messages(outputs[j].read(out.text or "", out.finished))
                new_logprobs = out.logprobs[sent_tokens[j] :] if want_logprobs and out.logprobs is not None else []
                if not deltas and not new_logprobs and not out.finished:
                    continue
                sent_tokens[j] = len(out.token_ids)
                deltas = deltas or [P.DeltaMessage(content="")]
                for k, delta in enumerate(deltas):
                    ends = out.finished and k == len(deltas) - 1
                    yield chunk([
                        P.ChatChunkChoice(
                            index=j,
                            delta=delta,
                            logprobs=chat_logprobs(new_logprobs, token_text) if want_logprobs and k == 0 else None,
                            finish_reason=outputs[j].finish_reason(out.finish_reason) if ends else None,
                            speculative=spec_stats(out) if ends else None,
                            tool_choice_unmet=unmet_tool_choice(tool_choice, outputs[j].tool_calls) if ends else None,
                        )
                    ])
            if include_usage:
                yield chunk([], usage_of([last[j] for j in range(n)], n))
        except Exception as exc:
            logger.exception("stream %s failed", request_id)
            yield sse_error(exc)
        finally:
            await streams.close()
        yield "data: [DONE]\n\n"

    async def completion_token_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids", "prompt")
            return await encoder.encode_text(prompt, "prompt")
        if not prompt:
            raise APIError(400, "prompt is an empty list of token ids", "prompt")
        return list(prompt)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        body = await read_body(request, P.CompletionRequest)
        check_model(body.model)
        check_n(body.n)
        prompts = completion_prompts(body.prompt, config.max_prompts, max_total_tokens - 1)
        requests: list[tuple[Any, SamplingParams]] = []
        for prompt in prompts:
            token_ids = await completion_token_ids(prompt)
            max_tokens = max_new_tokens(body.max_tokens, len(token_ids), config.default_completion_max_tokens, "prompt")
            params = params_of(body, max_tokens, body.logprobs, body.logprobs if body.echo else None)
            requests += [({"prompt_token_ids": token_ids}, p) for p in dataclasses.replace(params, n=body.n).per_sample()]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await start_streams(requests, request_id)
        echoed = [""] * len(prompts)
        if body.echo:
            try:
                echoed = [p if isinstance(p, str) else await encoder.decode(p) for p in prompts]
            except BaseException:
                await streams.close()
                raise
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _AbortingStreamingResponse(
                completion_events(streams, request_id, body, echoed, include_usage), media_type="text/event-stream"
            )
        outputs = await final_outputs_unless_disconnected(request, streams)
        choices = []
        for k, out in enumerate(outputs):
            prefix = echoed[k // body.n]
            choices.append(P.CompletionChoice(
                index=k,
                text=prefix + (out.text or ""),
                logprobs=choice_logprobs(out, body.echo, 0, len(prefix)) if body.logprobs is not None else None,
                finish_reason=out.finish_reason,
                speculative=spec_stats(out),
            ))
        response = P.CompletionResponse(
            id=request_id, created=int(time.time()), model=body.model, choices=choices, usage=usage_of(outputs, body.n)
        )
        return JSONResponse(P.dump(response))

    def choice_logprobs(out: RequestOutput, with_prompt: bool, first_token: int, output_offset: int) -> P.CompletionLogprobs:
        """The output's logprobs from its ``first_token``, after the prompt's (echo) when ``with_prompt``."""
        prompt = prompt_entries(out) if with_prompt else []
        return completion_logprobs(prompt, output_entries((out.logprobs or [])[first_token:]), output_offset, token_text)

    async def completion_events(
        streams: SampleStreams, request_id: str, body: P.CompletionRequest, echoed: list[str], include_usage: bool
    ) -> AsyncIterator[str]:
        created_at = int(time.time())
        n = len(streams.timers)
        want_logprobs = body.logprobs is not None
        sent_text = [""] * n  # the choice's text so far, an echoed prompt included
        sent_tokens = [0] * n
        started = [False] * n
        last: dict[int, RequestOutput] = {}

        def chunk(choices: list[P.CompletionChoice], usage: P.Usage | None = None) -> str:
            return sse(P.CompletionResponse(id=request_id, created=created_at, model=body.model, choices=choices, usage=usage))

        try:
            async for k, out in streams.outputs():
                last[k] = out
                prefix = echoed[k // body.n]
                text = prefix + (out.text or "")
                delta = text[len(sent_text[k]) :]
                new_tokens = len(out.token_ids) - sent_tokens[k]
                if not delta and not (want_logprobs and new_tokens) and not out.finished:
                    continue
                logprobs = None
                if want_logprobs:
                    first = not started[k]
                    offset = len(prefix) if first else len(sent_text[k])
                    logprobs = choice_logprobs(out, body.echo and first, sent_tokens[k], offset)
                started[k] = True
                sent_text[k] = text
                sent_tokens[k] = len(out.token_ids)
                yield chunk([
                    P.CompletionChoice(
                        index=k, text=delta, logprobs=logprobs, finish_reason=out.finish_reason,
                        speculative=spec_stats(out) if out.finished else None,
                    )
                ])
            if include_usage:
                yield chunk([], usage_of([last[k] for k in range(n)], body.n))
        except Exception as exc:
            logger.exception("stream %s failed", request_id)
            yield sse_error(exc)
        finally:
            await streams.close()
        yield "data: [DONE]\n\n"

    return app
