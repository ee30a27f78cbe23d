"""The engine streams of one API request (n samples of each of its prompts), read as one sequence
of (choice index, output).

Each sample runs as its own engine request (with the seeds of ``SamplingParams.per_sample``, as
``LLM.generate``; with several prompts, choice i * n + j is sample j of prompt i). Closing a
``SampleStreams`` (client gone, response finished, error) cancels every pump, which closes its
engine stream and so aborts the engine request and frees its cache in the engine thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from eaglet.engine.async_engine import AsyncEngine
from eaglet.executor.request import RequestOutput
from eaglet.sampling_params import SamplingParams
from eaglet.server.metrics import RequestTimer, ServerMetrics

_END = object()


class SampleStreams:
    def __init__(
        self, async_engine: AsyncEngine, requests: list[tuple[Any, SamplingParams]], request_id: str, metrics: ServerMetrics
    ) -> None:
        """``requests``: (prompt, params) of each choice, in choice order."""
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: deque[tuple[int, RequestOutput]] = deque()
        self.timers = [RequestTimer(metrics) for _ in requests]
        self.finished = [False] * len(requests)
        self._tasks = [
            asyncio.create_task(self._pump(j, async_engine.generate_stream(prompt, p, f"{request_id}-{j}")))
            for j, (prompt, p) in enumerate(requests)
        ]
        self._num_open = len(requests)

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            await stream.aclose()
            self._queue.put_nowait((index, _END))

    async def start(self) -> None:
        """Waits until every sample was admitted and produced its first output.

        Raises what the engine raised for a sample (InvalidRequestError for a bad request), after
        closing every stream, so that errors come back before a streaming response starts.
        """
        waiting = set(range(len(self._tasks)))
        while waiting:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = [True] * len(self.finished)  # refused: not a finished request for metrics
                await self.close()
                raise item
            if item is _END:
                self._num_open -= 1
            else:
                self._buffer.append((index, item))
            waiting.discard(index)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every sample, in arrival order (each output holds all tokens so far)."""
        while self._buffer or self._num_open:
            if self._buffer:
                index, item = self._buffer.popleft()
            else:
                index, item = await self._queue.get()
            if item is _END:
                self._num_open -= 1
                continue
            if isinstance(item, BaseException):
                self.finished[index] = True
                self.timers[index].finish("error")
                raise item
            self.timers[index].observe(len(item.token_ids), len(item.prompt_token_ids))
            if item.finished and not self.finished[index]:
                self.finished[index] = True
                self.timers[index].finish(item.finish_reason)
            yield index, item

    async def final_outputs(self) -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for index, out in self.outputs():
            last[index] = out
        return [last[j] for j in range(len(self._tasks))]

    async def close(self) -> None:
        # Everything but the final wait is synchronous: a caller inside a cancelled scope (the
        # response task of a client that went away) may not get past its next await.
        for index, done in enumerate(self.finished):
            if not done:
                self.finished[index] = True
                self.timers[index].finish("abort")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
