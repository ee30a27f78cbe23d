"""Prometheus metrics, named like vLLM's (``vllm:`` -> ``eaglet:``), in a registry per app.

Engine state (running / waiting requests, cache blocks, prefix-cache and speculation counters)
is read by ``snapshot_engine`` in the engine thread (through ``AsyncEngine.call``) right before
each scrape, so nothing reads the engine while it steps. Generated tokens are counted in the
engine thread as they are made (``StepTally``); request timings and prompt tokens are recorded by
the server as outputs arrive.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from eaglet import kernels
from eaglet.engine.engine import Engine
from eaglet.server.step_tally import StepTally

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass(frozen=True)
class SpecSnapshot:
    num_drafts: int  # verify steps, one per request per speculative round
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    accept_length: float


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int  # free, or held only by the prefix cache
    prefix_hit_tokens: int
    prefix_lookup_tokens: int
    spec: SpecSnapshot | None
    backend: str  # what computes: "cpu" (eaglet's kernels) or "pytorch"
    tile_backend: str  # what the kernels' bfloat16 GEMMs run on ("amx", "avx512_bf16", "avx2"), or ""
    fallback_reason: str  # why the engine runs PyTorch ops instead of the kernels, or ""
    tp_size: int = 1
    ep_size: int = 1
    communicator: str = ""  # "shm" or "gloo" under tensor parallelism
    collective_seconds: float = 0.0  # rank 0's time inside collectives since start

    @property
    def cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)


def snapshot_engine(engine: Engine) -> EngineSnapshot:
    """Engine state for metrics and logs; call it in the engine thread (AsyncEngine.call)."""
    prefix_cache = engine.prefix_cache
    spec = None
    if engine.spec_metrics is not None:
        m = engine.spec_metrics
        spec = SpecSnapshot(m.num_verify_steps, m.num_draft_tokens, m.num_accepted_tokens,
                            tuple(m.accepted_per_position), m.accept_length)
    return EngineSnapshot(
        num_running=len(engine.running),
        num_waiting=len(engine.waiting),
        num_total_blocks=engine.cache.allocator.num_usable,
        num_free_blocks=engine.num_free_blocks(),
        prefix_hit_tokens=prefix_cache.hit_tokens if prefix_cache is not None else 0,
        prefix_lookup_tokens=prefix_cache.lookup_tokens if prefix_cache is not None else 0,
        spec=spec,
        backend=engine.backend.name,
        tile_backend=kernels.tile_backend() or "" if engine.backend.name == "cpu" else "",
        fallback_reason=engine.backend.fallback_reason or "",
        **tensor_parallel_fields(engine),
    )


def tensor_parallel_fields(engine: Engine) -> dict:
    group = engine.tp_group
    if group is None:
        return {}
    comm = "gloo" if type(group.tp.comm).__name__ == "GlooCommunicator" else "shm"
    return {"tp_size": group.tp.size, "ep_size": engine.config.ep_size, "communicator": comm,
            "collective_seconds": group.tp.collective_time().seconds}


class _EngineStateCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        info = GaugeMetricFamily("eaglet:backend_info", "What computes (1): the backend, the kernels' tile GEMM, and "
                                 "why the engine fell back to PyTorch ops if it did.",
                                 labels=labels + ["backend", "tile_backend", "fallback_reason"])
        info.add_metric(values + [s.backend, s.tile_backend, s.fallback_reason], 1)
        yield info
        parallel = GaugeMetricFamily("eaglet:tensor_parallel_info", "The parallel layout (1): ranks, expert "
                                     "parallelism, and how the ranks talk (shm, gloo, or none in one process).",
                                     labels=labels + ["tp_size", "ep_size", "communicator"])
        parallel.add_metric(values + [str(s.tp_size), str(s.ep_size), s.communicator or "none"], 1)
        yield parallel
        yield counter("eaglet:tensor_parallel_collective_seconds", "Rank 0's time inside all-reduces and gathers.",
                      s.collective_seconds)
        yield gauge("eaglet:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("eaglet:num_requests_waiting", "Requests waiting to be admitted.", s.num_waiting)
        yield gauge("eaglet:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0..1).", s.cache_usage)
        yield gauge("eaglet:kv_cache_free_blocks", "KV-cache blocks free or held only by the prefix cache.", s.num_free_blocks)
        yield gauge("eaglet:kv_cache_total_blocks", "Usable KV-cache blocks.", s.num_total_blocks)
        yield counter("eaglet:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_lookup_tokens)
        yield counter("eaglet:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens)
        yield gauge("eaglet:prefix_cache_hit_rate", "Prefix-cache hits / queries since start (tokens).",
                    s.prefix_hit_tokens / s.prefix_lookup_tokens if s.prefix_lookup_tokens else 0.0)
        if s.spec is None:
            return
        yield counter("eaglet:spec_decode_num_drafts", "Speculative verify steps (one per request per round).", s.spec.num_drafts)
        yield counter("eaglet:spec_decode_num_draft_tokens",
                      "Draft tokens proposed (in a round cut by its request's finish, those before the cut).",
                      s.spec.num_draft_tokens)
        yield counter("eaglet:spec_decode_num_accepted_tokens", "Draft tokens accepted and emitted (up to the request's finish).",
                      s.spec.num_accepted_tokens)
        per_position = CounterMetricFamily(
            "eaglet:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(s.spec.accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position
        yield gauge("eaglet:spec_decode_mean_accept_length",
                    "Mean tokens per verify step (accepted drafts + the bonus token) since start.", s.spec.accept_length)


class _GeneratedTokensCollector(Collector):
    def __init__(self, model_name: str, tally: StepTally) -> None:
        self.model_name = model_name
        self.tally = tally

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("eaglet:generation_tokens", "Generated tokens (a request's client may have left).",
                                     labels=["model_name"])
        family.add_metric([self.model_name], self.tally.generated_tokens)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, tally: StepTally) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._engine_state = _EngineStateCollector(model_name)
        self.registry.register(self._engine_state)
        self.registry.register(_GeneratedTokensCollector(model_name, tally))
        self.prompt_tokens = Counter("eaglet:prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=self.registry).labels(model_name)
        self._finished = Counter("eaglet:request_success", "Finished requests by finish reason.",
                                 labels + ["finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.time_to_first_token = Histogram("eaglet:time_to_first_token_seconds", "Time to the first token.",
                                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.inter_token_latency = Histogram("eaglet:inter_token_latency_seconds",
                                             "Time per output token after the first (a speculative block's time "
                                             "is shared by its tokens).", labels, buckets=_LATENCY_BUCKETS,
                                             registry=self.registry).labels(model_name)
        self.e2e_latency = Histogram("eaglet:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                                     labels, buckets=_REQUEST_BUCKETS, registry=self.registry).labels(model_name)

    def request_finished(self, reason: str) -> None:
        self._finished.labels(self._model_name, reason).inc()

    def render(self, snapshot: EngineSnapshot) -> bytes:
        self._engine_state.snapshot = snapshot
        return generate_latest(self.registry)


class RequestTimer:
    """Prompt tokens and latencies of one engine request, fed with each of its cumulative outputs."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last_time: float | None = None
        self.num_tokens = 0

    def observe(self, num_tokens: int, num_prompt_tokens: int) -> None:
        now = time.perf_counter()
        new = num_tokens - self.num_tokens
        if new <= 0:
            return
        if self.last_time is None:
            self.metrics.prompt_tokens.inc(num_prompt_tokens)
            self.metrics.time_to_first_token.observe(now - self.arrival)
        else:
            for _ in range(new):
                self.metrics.inter_token_latency.observe((now - self.last_time) / new)
        self.num_tokens = num_tokens
        self.last_time = now

    def finish(self, reason: str | None) -> None:
        self.metrics.e2e_latency.observe(time.perf_counter() - self.arrival)
        self.metrics.request_finished(reason or "abort")
