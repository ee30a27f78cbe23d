"""``eaglet serve``: the OpenAI-compatible HTTP server (chat and text completions, models,
health, Prometheus metrics)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path
from typing import Any

from eaglet.commands.model_args import (
    add_model_arguments,
    configure_logging,
    positive_float,
    positive_int,
    run_ranks_of_node,
)

API_KEY_ENV = "EAGLET_API_KEY"
# eaglet.server.output_parsing.PARSER_SETTINGS, spelled here so that --help does not import the server
OUTPUT_PARSERS = ("auto", "kimi_k2", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=30000)
    server.add_argument("--served-model-name", help="the model name clients send (default: the checkpoint folder name)")
    server.add_argument("--api-key", help=f"require 'Authorization: Bearer <key>' on /v1 endpoints; the environment "
                                          f"variable {API_KEY_ENV} sets it too, out of sight of the process list")
    server.add_argument("--metrics-require-api-key", action="store_true",
                        help="put /metrics behind the API key as well (open by default, for scrapers)")
    server.add_argument("--allow-special-tokens-in-messages", action="store_true",
                        help="let special-token text in chat messages (e.g. '<|im_end|>') become control tokens; by "
                             "default it is encoded as plain text, so a message cannot forge a turn")
    server.add_argument("--tool-call-parser", choices=OUTPUT_PARSERS, default="auto",
                        help="read tool calls out of the model's output in this format, for requests with tools "
                             "('auto': kimi_k2 for Kimi checkpoints; 'none': requests that need it are refused)")
    server.add_argument("--reasoning-parser", choices=OUTPUT_PARSERS, default="auto",
                        help="return the model's thinking (<think>...</think>) as reasoning_content "
                             "('auto': kimi_k2 for Kimi checkpoints)")
    server.add_argument("--health-stall-timeout", type=positive_float, default=20.0,
                        help="seconds one engine step may run before /health answers 503")
    server.add_argument("--max-request-bytes", type=positive_int, default=32 * 2**20, help="largest request body")
    server.add_argument("--max-n", type=positive_int, default=16, help="largest n (completions per request)")
    server.add_argument("--max-prompts", type=positive_int, default=64,
                        help="most prompts in one /v1/completions request")
    server.add_argument("--max-images-per-request", type=positive_int, default=8)
    server.add_argument("--max-image-pixels", type=positive_int, default=16_000_000, help="width * height of one image")
    server.add_argument("--allow-remote-image-urls", action="store_true", help="fetch http(s) image URLs (refused by default)")
    server.add_argument("--allow-local-image-files", action="store_true",
                        help="read images from file:// URLs and absolute paths on the server (refused by default)")
    server.add_argument("--log-interval-steps", type=positive_int, default=50,
                        help="log a stats line every this many engine steps (at most every 5 s)")


def server_config(args: argparse.Namespace, default_model_name: str) -> Any:  # -> eaglet.server.ServerConfig
    from eaglet.server import ImageLimits, ServerConfig

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.metrics_require_api_key and api_key is None:
        raise SystemExit(f"eaglet: --metrics-require-api-key needs an API key (--api-key or {API_KEY_ENV})")
    return ServerConfig(
        model_name=args.served_model_name or default_model_name,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        max_prompts=args.max_prompts,
        image_limits=ImageLimits(
            max_images=args.max_images_per_request,
            max_pixels=args.max_image_pixels,
            allow_remote_urls=args.allow_remote_image_urls,
            allow_local_files=args.allow_local_image_files,
        ),
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
        metrics_behind_api_key=args.metrics_require_api_key,
        health_stall_timeout_s=args.health_stall_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"eaglet: --port must be in [0, 65535], got {args.port}")
    from eaglet.commands.model_args import build_engine, engine_config_kwargs
    from eaglet.engine.heap import freeze_startup_heap

    if args.node_rank > 0:
        return run_ranks_of_node(args)
    config = server_config(args, Path(engine_config_kwargs(args)["model"]).name)  # flag errors before loading
    engine = build_engine(args)

    import uvicorn

    from eaglet.server import build_app

    log = logging.getLogger("eaglet.server")
    fatal: list[Exception] = []

    def stop_serving(exc: Exception) -> None:
        # The engine cannot go on (a tensor-parallel rank died or hung): the server ends, as SGLang's does.
        fatal.append(exc)
        log.error("the engine stopped: %s; shutting the server down", exc)
        os.kill(os.getpid(), signal.SIGTERM)

    app, async_engine = build_app(engine, config, args.log_interval_steps, on_fatal=stop_serving)
    freeze_startup_heap()
    log.info(
        "serving %s on http://%s:%d (speculation: %s, tp_size %d)", config.model_name, args.host, args.port,
        engine.config.speculative_algorithm or "off", engine.config.tp_size,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()
    if fatal:
        raise SystemExit(f"eaglet: the engine stopped: {fatal[0]}")
    return 0
