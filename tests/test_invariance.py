"""A request's tokens and log-probabilities do not depend on what else runs (contracts.md: batch
invariance, cache invariance): the same bits in a ragged batch as alone, however its prompt is cut
into chunks, whether its prefix came from the prefix cache, and whether a token's logits came from a
decode step or from a prefill. On the CPU kernels, on any CPU level they build for; a tiny
Kimi-K2.5 with images, in float32 and bfloat16."""

import pytest
import torch

from eaglet import LLM, SamplingParams, kernels
from eaglet.testing.checkpoints import write_kimi_k25_checkpoint
from eaglet.testing.images import make_image

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels not built: {kernels.unavailable_reason()}")

IMAGE = 250
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_kimi_k25_checkpoint(tmp_path_factory.mktemp("kimi"), {"max_position_embeddings": 512}, seed=5,
                                     image_token_id=IMAGE)


def _requests() -> list[dict]:
    """Ragged prompts: text, images of two sizes, and three that share a 21-token prefix."""
    shared = [(5 * i + 7) % 240 for i in range(21)]
    return [
        {"prompt_token_ids": [11, 12, 13]},
        {"prompt_token_ids": [20, IMAGE, 21, 22], "images": [make_image(28, 28, 1)]},
        {"prompt_token_ids": shared + [30, 31]},
        {"prompt_token_ids": [40, IMAGE, 41, IMAGE, 42] + list(range(60, 90)), "images": [make_image(56, 28, 2), make_image(28, 28, 3)]},
        {"prompt_token_ids": shared + [33]},
        {"prompt_token_ids": shared + list(range(100, 140))},
    ]


def _params(i: int) -> SamplingParams:
    """Even requests greedy, odd ones sampled with their own seed; each with its top-2 logprobs."""
    if i % 2 == 0:
        return SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2)
    return SamplingParams(max_new_tokens=9, temperature=0.9, top_k=50, seed=100 + i, ignore_eos=True, logprobs=2)


def _llm(target, dtype: torch.dtype, **kwargs) -> LLM:
    return LLM(str(target), dtype=str(dtype).removeprefix("torch."), show_progress=False, **kwargs)


def _result(out) -> tuple:
    return out.token_ids, [(e.token_id, e.logprob, e.top) for e in out.logprobs]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_request_in_a_ragged_batch_gets_what_it_gets_alone(target, dtype):
    requests = _requests()
    params = [_params(i) for i in range(len(requests))]
    together = _llm(target, dtype, enable_prefix_caching=False).generate(requests, params)
    for request, p, out in zip(requests, params, together):
        alone = _llm(target, dtype, enable_prefix_caching=False).generate([request], p)[0]
        assert _result(out) == _result(alone)


@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_chunked_prefill_gives_the_bits_of_one_pass(target, dtype, chunk):
    requests = [_requests()[i] for i in (1, 3, 5)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    whole = _llm(target, dtype, enable_prefix_caching=False).generate(requests, params)
    chunked = _llm(target, dtype, enable_prefix_caching=False, chunked_prefill_size=chunk).generate(requests, params)
    for a, b in zip(whole, chunked):
        assert _result(a) == _result(b)
        assert a.prompt_logprobs == b.prompt_logprobs


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_decoded_token_has_the_logits_of_a_prefill(target, dtype):
    """Decoding token t gives it the log-probabilities the same sequence gets when prefilled whole."""
    request = _requests()[3]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = _llm(target, dtype, enable_prefix_caching=False)
    decoded = llm.generate([request], params)[0]
    extended = {**request, "prompt_token_ids": request["prompt_token_ids"] + decoded.token_ids}
    prefilled = llm.generate([extended], SamplingParams(max_new_tokens=1, prompt_logprobs=2))[0]
    tail = prefilled.prompt_logprobs[len(decoded.prompt_token_ids):]  # past the prompt, its images expanded
    assert [(e.token_id, e.logprob, e.top) for e in tail] == _result(decoded)[1]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_prefix_cache_hit_gives_the_bits_of_a_cold_run(target, dtype):
    requests = _requests()
    params = [_params(i) for i in range(len(requests))]
    cold = [_llm(target, dtype, enable_prefix_caching=False).generate([r], p)[0] for r, p in zip(requests, params)]
    llm = _llm(target, dtype, block_size=4)
    llm.generate(requests, [SamplingParams(max_new_tokens=3, ignore_eos=True)] * len(requests))  # fills the cache
    warm = llm.generate(requests, params)
    assert llm.engine.prefix_cache.num_evictable_blocks > 0
    assert [_result(w) for w in warm] == [_result(c) for c in cold]
