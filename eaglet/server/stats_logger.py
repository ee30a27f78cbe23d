"""The periodic engine log line (like SGLang's "Decode batch" line): generation throughput,
running / waiting requests, cache usage and mean accept length since the previous line.

``StatsLogger.on_step`` runs in the engine thread after every step (``AsyncEngine(on_step=...)``),
and feeds the server's tally of generated tokens.
"""

from __future__ import annotations

import logging
import time

from eaglet.engine.engine import Engine
from eaglet.executor.request import RequestOutput
from eaglet.server.metrics import snapshot_engine
from eaglet.server.step_tally import StepTally

logger = logging.getLogger("eaglet.stats")


class StatsLogger:
    def __init__(self, tally: StepTally, interval_steps: int = 50, min_interval_s: float = 5.0) -> None:
        if interval_steps < 1:
            raise ValueError(f"interval_steps must be >= 1, got {interval_steps}")
        self.interval_steps = interval_steps
        self.min_interval_s = min_interval_s
        self.tally = tally
        self._steps = 0
        self._tokens = 0
        self._last_time = time.perf_counter()
        self._last_spec: tuple[int, int] = (0, 0)  # verify steps, accepted tokens at the last line

    def on_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        self._tokens += self.tally.count(engine, outputs)
        self._steps += 1
        now = time.perf_counter()
        if self._steps < self.interval_steps or now - self._last_time < self.min_interval_s:
            return
        if logger.isEnabledFor(logging.INFO):
            logger.info(self.line(engine, now - self._last_time))
        self._steps = 0
        self._tokens = 0
        self._last_time = now

    def line(self, engine: Engine, seconds: float) -> str:
        s = snapshot_engine(engine)
        parts = [
            f"Decode batch. #running-req: {s.num_running}",
            f"#waiting-req: {s.num_waiting}",
            f"cache usage: {s.cache_usage:.2f}",
            f"gen throughput (token/s): {self._tokens / max(seconds, 1e-9):.2f}",
        ]
        if s.spec is not None:
            verify_steps = s.spec.num_drafts - self._last_spec[0]
            accepted = s.spec.num_accepted_tokens - self._last_spec[1]
            accept_length = (accepted + verify_steps) / verify_steps if verify_steps else 0.0
            parts.append(f"accept len: {accept_length:.2f}")
            self._last_spec = (s.spec.num_drafts, s.spec.num_accepted_tokens)
        return ", ".join(parts)
