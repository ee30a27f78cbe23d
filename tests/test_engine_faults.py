"""A step that raises stops only the requests of the phase that raised; the engine keeps serving."""

import asyncio

import pytest
from runtime_utils import greedy
from eaglet.testing.echo_checkpoints import echo_draft, echo_kimi_target

from eaglet import LLM
from eaglet.engine.async_engine import AsyncEngine
from eaglet.errors import RequestFailedError

POISON = 77  # a prompt starting with this token makes the injected fault fire


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = echo_kimi_target(tmp_path_factory.mktemp("target"), alpha=1.0)
    draft = echo_draft(target, tmp_path_factory.mktemp("draft"), kind="mla", seed=2)
    return target, draft


def make_llm(models, spec: bool) -> LLM:
    target, draft = models
    extra = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft)) if spec else {}
    return LLM(str(target), dtype="float32", show_progress=False, **extra)


def inject_prefill_fault(llm: LLM) -> None:
    """The model runner raises on any prefill batch that holds a poisoned prompt."""
    runner = llm.engine.runner
    extend = runner.extend

    def faulty_extend(requests, num_new, **kwargs):
        if any(r.prompt_token_ids[0] == POISON and r.num_cached_tokens == 0 for r in requests):
            raise RuntimeError("injected fault")
        return extend(requests, num_new, **kwargs)

    runner.extend = faulty_extend


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_failed_prefill_stops_only_its_requests(models, spec):
    good_prompt = {"prompt_token_ids": list(range(20, 32))}
    expected = make_llm(models, spec).generate([good_prompt], greedy(20))[0].token_ids

    llm = make_llm(models, spec)
    inject_prefill_fault(llm)
    engine = llm.engine
    good = engine.add_request(good_prompt, greedy(20))
    engine.step()
    engine.step()  # the good request is decoding now
    bad = engine.add_request({"prompt_token_ids": [POISON, 5, 6]}, greedy(20))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[bad].finish_reason == "error" and "injected fault" in finished[bad].error
    assert finished[good].token_ids == expected and finished[good].finish_reason == "length"
    assert engine.num_free_blocks() == engine.cache.allocator.num_usable

    with pytest.raises(RequestFailedError, match="injected fault"):
        llm.generate([{"prompt_token_ids": [POISON, 1]}, good_prompt], greedy(8))
    assert llm.generate([good_prompt], greedy(20))[0].token_ids == expected
    assert engine.num_free_blocks() == engine.cache.allocator.num_usable


def test_stream_of_a_failed_request_raises_and_others_complete(models):
    llm = make_llm(models, spec=True)
    inject_prefill_fault(llm)
    good_prompt = {"prompt_token_ids": list(range(40, 50))}

    async_engine = AsyncEngine(llm.engine)

    async def main():
        first_token = asyncio.Event()

        async def good():
            last = None
            async for out in async_engine.generate_stream(good_prompt, greedy(12)):
                first_token.set()
                last = out
            return last

        async def bad():
            await first_token.wait()  # the good request is decoding when the bad one is prefilled
            async for _ in async_engine.generate_stream({"prompt_token_ids": [POISON, 3]}, greedy(12)):
                pass

        return await asyncio.gather(good(), bad(), return_exceptions=True)

    good, bad = asyncio.run(main())
    assert isinstance(bad, RequestFailedError)
    assert good.finish_reason == "length" and len(good.token_ids) == 12
    assert async_engine.call(lambda e: e.num_free_blocks()).result(timeout=30) == llm.engine.cache.allocator.num_usable
    async_engine.shutdown()
