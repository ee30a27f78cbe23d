"""Offline API: ``LLM(model=...).generate(requests, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from typing import Any

from eaglet.engine.engine import Engine, EngineConfig
from eaglet.errors import RequestFailedError
from eaglet.executor.request import RequestOutput
from eaglet.sampling_params import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    def __init__(self, model: str, dtype: str = "bfloat16", **engine_kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=str(model), dtype=dtype, **engine_kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do in one process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spec_metrics(self) -> dict | None:
        """Aggregate speculation statistics since start (None without speculation): accept length
        (bonus token included), acceptance rate, per-position acceptance rate, counts, and what the
        adaptive policy chose (decode steps per draft depth, best depth per batch-size bucket)."""
        metrics = self.engine.spec_metrics
        if metrics is None:
            return None
        return {**metrics.as_dict(), "policy": self.engine.spec_policy.as_dict()}

    def generate(
        self, requests: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Runs every request to completion; outputs come back in input order.

        Requests that fit the cache together are prefilled in one ragged batch and decoded together.
        A request that is invalid raises before any request runs.
        """
        if not isinstance(requests, list):
            requests = [requests]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(requests)
        if len(sampling_params) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(sampling_params)} sampling params")
        groups: list[list[str]] = []  # engine request ids of each prompt's n samples
        try:
            for request, params in zip(requests, sampling_params):
                groups.append([self.engine.add_request(request, p) for p in params.per_sample()])
        except Exception:
            for request_id in (i for group in groups for i in group):
                self.engine.abort(request_id)
            raise
        outputs: dict[str, RequestOutput] = {}
        total = sum(len(g) for g in groups)
        while len(outputs) < total:
            for out in self.engine.step(stream_text=False):  # finished outputs only
                if out.finished:
                    outputs[out.request_id] = out
        failed = [out for out in outputs.values() if out.finish_reason == "error"]
        if failed:
            raise RequestFailedError(f"{len(failed)} request(s) failed; the first: {failed[0].error}")
        results = []
        for group in groups:
            first = outputs[group[0]]
            if len(group) > 1:
                first = dataclasses.replace(first, samples=[outputs[i] for i in group])
            results.append(first)
        return results

