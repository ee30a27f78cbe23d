"""Asynchronous front of the engine: many concurrent streams, one stepping thread.

``Engine`` is single-threaded. ``AsyncEngine`` owns it from one background thread that steps
while there is work; callers on an asyncio loop add requests and receive each request's outputs
through its own queue. Leaving a stream early (client gone, task cancelled) aborts the request in
the engine thread, which frees its cache at once. ``busy_seconds`` tells how long the thread has
been on its current command or step, so a health check can see a stuck engine.

A failure no request can outlive (a tensor-parallel rank that died or hung, ``DistributedError``)
fails every stream, stops the thread (``alive`` turns false, ``fatal`` says why) and calls
``on_fatal``; while idle the thread looks at the ranks' health every ``HEALTH_POLL_S``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from eaglet.engine.engine import Engine
from eaglet.errors import DistributedError, RequestFailedError
from eaglet.executor.request import RequestOutput
from eaglet.sampling_params import SamplingParams

HEALTH_POLL_S = 0.5


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        on_step: Callable[[Engine, list[RequestOutput]], None] | None = None,
        on_fatal: Callable[[Exception], None] | None = None,
    ) -> None:
        """``on_step(engine, outputs)`` runs in the engine thread after every step (stats logging);
        ``on_fatal(exc)`` once, in the engine thread, when the engine cannot go on."""
        self.engine = engine
        self._on_step = on_step
        self._on_fatal = on_fatal
        self.fatal: Exception | None = None
        self._fatal_lock = threading.Lock()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self._busy_since: float | None = None  # start of the current command or step; None while waiting for work
        self._thread = threading.Thread(target=self._loop, name="eaglet-engine", daemon=True)
        self._thread.start()

    async def generate_stream(
        self, prompt: str | dict[str, Any], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it grows; the last one has ``finished`` set.

        Invalid requests raise here (InvalidRequestError), before anything is queued; a request
        whose engine step failed raises RequestFailedError (the engine goes on serving others).
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        added: asyncio.Future = loop.create_future()
        with self._fatal_lock:  # _die drains the queue under it: nothing queued after goes unanswered
            if self.fatal is not None:
                raise RequestFailedError(f"the engine has stopped: {self.fatal}")
            self._commands.put(("add", (prompt, params, request_id, loop, outputs, added)))
        request_id = await added
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                if out.finish_reason == "error":
                    raise RequestFailedError(out.error)
                yield out
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def call(self, fn, *args):  # -> a concurrent.futures.Future of fn(engine, *args), run in the engine thread
        from concurrent.futures import Future

        future: Future = Future()
        self._commands.put(("call", (fn, args, future)))
        return future

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def busy_seconds(self) -> float:
        """How long the engine thread has been on its current command or step (0 while it waits for work)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # else the step in flight still uses the ranks; they end with the process
            self.engine.close()

    # ---- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped.is_set():
            block = not self.engine.has_unfinished()
            try:
                self.engine.check_health()
                while True:
                    if block:
                        self._busy_since = None
                    command = self._commands.get(block=block, timeout=HEALTH_POLL_S if block else None)
                    self._busy_since = time.monotonic()
                    self._handle(*command)
                    block = False
            except queue.Empty:
                pass
            except DistributedError as exc:
                self._die(exc)
                break
            if self._stopped.is_set():
                break
            if self.engine.has_unfinished():
                self._busy_since = time.monotonic()
                try:
                    outputs = self.engine.step()
                except DistributedError as exc:
                    self._die(exc)
                    break
                except Exception as exc:  # a failed step must not take every stream down silently
                    self._fail_all(exc)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                if self._on_step is not None:
                    self._on_step(self.engine, outputs)

    def _handle(self, command: str, payload: Any) -> None:
        if command == "add":
            prompt, params, request_id, loop, outputs, added = payload
            try:
                request_id = self.engine.add_request(prompt, params, request_id)
            except Exception as exc:
                loop.call_soon_threadsafe(_set_exception, added, exc)
                return
            self._streams[request_id] = (loop, outputs)
            loop.call_soon_threadsafe(_set_result, added, request_id)
        elif command == "abort":
            self.engine.abort(payload)
            self._streams.pop(payload, None)
        elif command == "call":
            fn, args, future = payload
            try:
                future.set_result(fn(self.engine, *args))
            except Exception as exc:
                future.set_exception(exc)

    def _die(self, exc: DistributedError) -> None:
        stopped = RequestFailedError(f"the engine has stopped: {exc}")
        with self._fatal_lock:
            self.fatal = exc
            self._stopped.set()
            self._fail_all(stopped)
            while True:  # requests queued meanwhile: refused, not left waiting
                try:
                    command, payload = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command == "add":
                    _prompt, _params, _request_id, loop, _outputs, added = payload
                    loop.call_soon_threadsafe(_set_exception, added, stopped)
                elif command == "call":
                    _fn, _args, future = payload
                    future.set_exception(stopped)
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, exc)
            self.engine.abort(request_id)
        self._streams.clear()


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
