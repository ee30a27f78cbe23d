"""Helpers that drive eaglet's runtime directly (below the LLM API) for parity tests."""

from __future__ import annotations

import torch

from eaglet import LLM
from eaglet.engine.engine import Engine
from eaglet.executor.request import Request
from eaglet.sampling_params import SamplingParams


def prompt_logits(llm: LLM, prompts: list[dict], chunk: int | None = None) -> list[torch.Tensor]:
    """Logits at every prompt position of each request, all requests in ONE ragged batch.

    With ``chunk``, prefill runs in chunks of at most that many tokens per request (several forwards).
    Frees every cache row afterwards.
    """
    engine: Engine = llm.engine
    reqs = []
    for i, prompt in enumerate(prompts):
        token_ids, mm = engine._prepare_prompt(prompt)
        req = Request(f"logits-{i}", token_ids, SamplingParams(max_new_tokens=1), mm)
        req.req_pool_idx = engine.cache.alloc_row()
        reqs.append(req)
    pieces: list[list[torch.Tensor]] = [[] for _ in reqs]
    try:
        while True:
            todo = [r for r in reqs if r.num_cached_tokens < r.num_tokens]
            if not todo:
                break
            lens = [min(r.num_tokens - r.num_cached_tokens, chunk or r.num_tokens) for r in todo]
            batch, out = engine.runner.extend(todo, lens, all_logits=True)
            for req, start, n in zip(todo, batch.extend_start_loc.tolist(), lens):
                pieces[reqs.index(req)].append(out.logits[start : start + n])
    finally:
        for req in reqs:
            engine.cache.free_row(req.req_pool_idx)
    return [torch.cat(p) for p in pieces]


def greedy(max_new_tokens: int = 32) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)



def wait_until_healthy(process, base_url: str, timeout_s: float) -> None:
    """Waits for a server subprocess's /health to answer 200; fails with its output if it exits first."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
