"""OpenAI-compatible HTTP server over the engine (``eaglet serve``)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from eaglet.engine.async_engine import AsyncEngine
from eaglet.engine.engine import Engine
from eaglet.server.app import ServerConfig, create_app
from eaglet.server.images import ImageLimits
from eaglet.server.stats_logger import StatsLogger
from eaglet.server.step_tally import StepTally

__all__ = ["ImageLimits", "ServerConfig", "StepTally", "create_app", "start_engine"]


def start_engine(
    engine: Engine, tally: StepTally, log_interval_steps: int = 50, log_min_interval_s: float = 5.0,
    on_fatal: Callable[[Exception], None] | None = None,
) -> AsyncEngine:
    """The engine's stepping thread, counting generated tokens into ``tally`` and logging a stats
    line every ``log_interval_steps`` steps (and at most every ``log_min_interval_s`` seconds);
    ``on_fatal`` when the engine cannot go on (a tensor-parallel rank died)."""
    stats = StatsLogger(tally, log_interval_steps, log_min_interval_s)
    return AsyncEngine(engine, on_step=stats.on_step, on_fatal=on_fatal)


def build_app(
    engine: Engine, config: ServerConfig, log_interval_steps: int = 50, on_fatal: Callable[[Exception], None] | None = None
) -> tuple[FastAPI, AsyncEngine]:
    tally = StepTally()
    async_engine = start_engine(engine, tally, log_interval_steps, on_fatal=on_fatal)
    return create_app(async_engine, config, tally), async_engine
