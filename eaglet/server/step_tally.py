"""Tokens generated, counted in the engine thread from each step's outputs.

Counted where they are made, not where a client reads them: the tokens of a request whose client
left (generated before the abort reached the engine) count as well.
"""

from __future__ import annotations

from eaglet.engine.engine import Engine
from eaglet.executor.request import RequestOutput


class StepTally:
    def __init__(self) -> None:
        self.generated_tokens = 0  # since start; read by other threads (an int read is atomic)
        self._seen: dict[str, int] = {}  # request id -> tokens it had at its last output

    def count(self, engine: Engine, outputs: list[RequestOutput]) -> int:
        """Tokens this step generated (each output holds all of its request's tokens so far)."""
        new = 0
        for out in outputs:
            new += len(out.token_ids) - self._seen.get(out.request_id, 0)
            if out.finished:
                self._seen.pop(out.request_id, None)
            else:
                self._seen[out.request_id] = len(out.token_ids)
        if len(self._seen) > len(engine.requests):  # aborted requests never finish through a step
            self._seen = {i: n for i, n in self._seen.items() if i in engine.requests}
        self.generated_tokens += new
        return new
