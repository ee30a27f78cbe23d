"""OpenAI-compatible HTTP server over the engine (``eaglet serve``)."""

from __future__ import annotations

from fastapi import FastAPI

from eaglet.engine.async_engine import AsyncEngine
from eaglet.engine.engine import Engine
from eaglet.server.app import ServerConfig, create_app
from eaglet.server.images import ImageLimits
from eaglet.server.stats_logger import StatsLogger
from eaglet.server.step_tally import StepTally

__all__ = ["ImageLimits", "ServerConfig", "StepTally", "create_app", "start_engine"]


def start_engine(
    engine: Engine, tally: StepTally, log_interval_steps: int = 50, log_min_interval_s: float = 5.0
) -> AsyncEngine:
    """The engine's stepping thread, counting generated tokens into ``tally`` and logging a stats
    line every ``log_interval_steps`` steps (and at most every ``log_min_interval_s`` seconds)."""
    stats = StatsLogger(tally, log_interval_steps, log_min_interval_s)
    return AsyncEngine(engine, on_step=stats.on_step)


def build_app(engine: Engine, config: ServerConfig, log_interval_steps: int = 50) -> tuple[FastAPI, AsyncEngine]:
    tally = StepTally()
    async_engine = start_engine(engine, tally, log_interval_steps)
    return create_app(async_engine, config, tally), async_engine
