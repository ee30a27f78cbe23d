"""The engine under pressure: caches too small for the batch, preemption under speculation with
special tokens in the output, prompt logprobs behind a prefix-cache hit, seeds at the edge of
their range for n > 1, and statistics that count only emitted tokens."""

import pytest
from eaglet.testing.images import make_image
from eaglet.testing.echo_checkpoints import IMAGE_TOKEN, echo_draft, echo_kimi_target

from eaglet import LLM, SamplingParams
from eaglet.engine.engine import Engine
from eaglet.executor.request import RequestOutput


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = echo_kimi_target(tmp_path_factory.mktemp("target"), alpha=0.3)
    draft = echo_draft(target, tmp_path_factory.mktemp("draft"), kind="mla", seed=1)
    return target, draft


def make_llm(models, *, spec: dict | None = None, **kwargs) -> LLM:
    target, draft = models
    extra = {}
    if spec is not None:
        extra = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft), speculative_adaptive=False, **spec)
    return LLM(str(target), dtype="float32", show_progress=False, **extra, **kwargs)


CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)


def run_to_completion(engine: Engine, max_steps: int = 2000) -> dict[str, RequestOutput]:
    """Steps until every request finished; fails (instead of hanging) if that takes max_steps."""
    finished: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finished
        for out in engine.step(stream_text=False):
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps: no progress")


def alone(models, request: dict, params: SamplingParams, **kwargs) -> RequestOutput:
    return make_llm(models, **kwargs).generate([request], params)[0]


def test_chunked_prefills_that_together_overflow_the_cache_both_finish(models):
    """Two prompts that each fit the cache alone (13 of 20 blocks) but not together, prefilled in
    chunks: the older one preempts the newer one instead of both waiting for blocks forever."""
    prompts = [{"prompt_token_ids": [(7 * i) % 240 for i in range(200)]}, {"prompt_token_ids": [(11 * i + 3) % 240 for i in range(200)]}]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    for prefix_caching in (False, True):
        llm = make_llm(models, kv_cache_blocks=20, block_size=16, chunked_prefill_size=16, enable_prefix_caching=prefix_caching)
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in prompts]
        requests = [engine.requests[i] for i in ids]
        finished = run_to_completion(engine)
        assert sum(r.num_preemptions for r in requests) >= 1
        assert [finished[i].token_ids for i in ids] == [alone(models, p, params).token_ids for p in prompts]
        assert engine.num_free_blocks() == engine.cache.allocator.num_usable


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_tiny_caches_with_chunked_prefill_always_progress(models, block_size):
    """Six ragged requests on a cache that holds about two of them: every step runs work or
    preempts, and everything finishes with the tokens each request gets alone."""
    prompts = [{"prompt_token_ids": [(5 * i + j) % 240 for i in range(30 + 17 * j)]} for j in range(6)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    longest = max(len(p["prompt_token_ids"]) for p in prompts) + 12
    llm = make_llm(models, kv_cache_blocks=-(-longest // block_size) + 2, block_size=block_size, chunked_prefill_size=block_size + 3)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    finished = run_to_completion(engine)
    assert [finished[i].token_ids for i in ids] == [alone(models, p, params).token_ids for p in prompts]
    assert engine.num_free_blocks() == engine.cache.allocator.num_usable


def test_preempted_image_request_whose_output_holds_placeholders_re_prefills_under_speculation(models):
    """A generated token that happens to be the image placeholder id is an ordinary token when the
    request is preempted and re-prefilled: image features come only from the prompt's images."""
    text = {"prompt_token_ids": [20, 21, 22, 23]}
    image = {"prompt_token_ids": [20, IMAGE_TOKEN, 21], "images": [make_image(28, 28, 0)]}
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={IMAGE_TOKEN: 100.0}),
    ]
    expected = [alone(models, r, p).token_ids for r, p in zip((text, image), params)]
    assert IMAGE_TOKEN in expected[1]
    for spec in (None, CHAIN):
        llm = make_llm(models, spec=spec, kv_cache_blocks=10, block_size=8, enable_prefix_caching=False)
        engine = llm.engine
        ids = [engine.add_request(r, p) for r, p in zip((text, image), params)]
        requests = [engine.requests[i] for i in ids]
        finished = run_to_completion(engine)
        assert requests[1].num_preemptions >= 1 or requests[0].num_preemptions >= 1
        assert [finished[i].finish_reason for i in ids] == ["length", "length"]
        assert [finished[i].token_ids for i in ids] == expected


def test_prompt_logprobs_complete_and_aligned_after_a_prefix_cache_hit(models):
    prompt = {"prompt_token_ids": [(3 * i + 1) % 240 for i in range(38)]}
    params = SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=2)
    cold = alone(models, prompt, params, enable_prefix_caching=False).prompt_logprobs
    llm = make_llm(models, block_size=8)
    llm.generate([prompt], SamplingParams(max_new_tokens=2))  # fills the prefix cache
    warm = llm.generate([prompt], params)[0].prompt_logprobs
    assert len(cold) == len(warm) == 38
    assert warm[0] is None
    assert [e.token_id for e in warm[1:]] == prompt["prompt_token_ids"][1:]
    assert warm == cold
    assert llm.engine.prefix_cache.num_evictable_blocks > 0  # the prompt's blocks were published


@pytest.mark.parametrize("seed", [2**64 - 1, -1, 2**63 - 1, 0])
def test_n_samples_with_seeds_at_the_edge_of_their_range(models, seed):
    llm = make_llm(models)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed, n=3)
    samples = llm.generate([prompt], params)[0].samples
    assert len(samples) == 3
    for j, sample in enumerate(samples):
        single = SamplingParams(max_new_tokens=6, temperature=1.0, seed=(seed + j) % 2**64)
        assert sample.token_ids == llm.generate([prompt], single)[0].token_ids
    assert samples[0].token_ids == llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed))[0].token_ids


def test_accept_lengths_count_only_emitted_tokens(models):
    """max_new_tokens=3 under a 7-step chain that accepts far more: each request books the tokens it
    emitted, and the engine's totals agree with the requests'."""
    llm = make_llm(models, spec=dict(speculative_num_steps=7, speculative_eagle_topk=1, speculative_num_draft_tokens=8))
    prompts = [{"prompt_token_ids": [9 + j] * (4 + j)} for j in range(6)]
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    long_run = llm.generate(prompts[:1], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert max(long_run.spec_accept_lengths) > 3  # the draft would accept more than the budget allows
    for out in outputs + [long_run]:
        assert sum(out.spec_accept_lengths) == len(out.token_ids) - 1  # the first token comes from prefill
        assert out.spec_accepted_tokens == sum(a - 1 for a in out.spec_accept_lengths)
    for out in outputs:
        assert out.spec_accept_lengths == [2]
    metrics = llm.spec_metrics()
    assert metrics["num_verify_steps"] == sum(o.spec_verify_ct for o in outputs + [long_run])
    assert metrics["num_accepted_tokens"] == sum(o.spec_accepted_tokens for o in outputs + [long_run])
    assert metrics["num_accepted_tokens"] <= metrics["num_draft_tokens"]


def test_a_recomputed_prefix_never_pins_cached_blocks(models):
    """Found by the engine fuzzer: a request that computes a cached prefix itself (prompt logprobs
    skip the match) must not publish its next block below the cached copy, which would leave that
    copy neither free nor evictable while the request needs one more block."""
    images = lambda: [make_image(16, 16, 0), make_image(16, 16, 1)]  # noqa: E731
    llm = make_llm(models, kv_cache_blocks=3, block_size=4, max_num_batched_tokens=8, max_running_requests=2)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": [IMAGE_TOKEN, IMAGE_TOKEN, 2], "images": images()}, params)
           for params in (SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=1, prompt_logprobs=0))]
    finished = run_to_completion(engine, max_steps=50)
    assert sorted(finished) == sorted(ids)
    assert engine.num_free_blocks() == engine.cache.allocator.num_usable
