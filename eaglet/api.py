"""Offline API: ``LLM(model=...).generate(requests, SamplingParams(...))``."""

from __future__ import annotations

from typing import Any

from eaglet.engine.engine import Engine, EngineConfig
from eaglet.engine.request import RequestOutput
from eaglet.sampling_params import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    def __init__(self, model: str, dtype: str = "bfloat16", **engine_kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=str(model), dtype=dtype, **engine_kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def spec_metrics(self) -> dict | None:
        """Aggregate speculation statistics since start (None without speculation): accept length
        (bonus token included), acceptance rate, per-position acceptance rate, counts."""
        metrics = self.engine.spec_metrics
        return metrics.as_dict() if metrics is not None else None

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
        ids: list[str] = []
        try:
            for request, params in zip(requests, sampling_params):
                ids.append(self.engine.add_request(request, params))
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        outputs: dict[str, RequestOutput] = {}
        while len(outputs) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    outputs[out.request_id] = out
        return [outputs[i] for i in ids]
