"""EAGLE-3 speculative decoding end to end: lossless, batch-invariant, cache-exact, statistics."""

import pytest
import torch
from runtime_utils import greedy
from eaglet.testing.images import make_image
from eaglet.testing.echo_checkpoints import IMAGE_TOKEN, draft_for, echo_draft, echo_kimi_target

from eaglet import LLM, SamplingParams, kernels
from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.executor.request import Request
from eaglet.backends.pytorch.weights import should_pack


def spec_llm(target, draft, steps, topk, tokens, **kwargs) -> LLM:
    return LLM(
        str(target),
        dtype="float32",
        show_progress=False,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(draft),
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens,
        **{"speculative_adaptive": False, **kwargs},
    )


def mixed_requests():
    return [
        {"prompt_token_ids": [3, 4, IMAGE_TOKEN, 9, 10, 11], "images": [make_image(40, 28, 0)]},
        {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]},
        {
            "prompt_token_ids": [20, IMAGE_TOKEN, 21, 22, IMAGE_TOKEN, 23],
            "images": [make_image(24, 56, 1), make_image(33, 17, 2)],
        },
        {"prompt_token_ids": list(range(40, 71))},
        {"prompt_token_ids": [99, 98, IMAGE_TOKEN], "images": [make_image(16, 16, 4)]},
    ]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return echo_kimi_target(tmp_path_factory.mktemp("target"), alpha=1.0)


@pytest.fixture(scope="module")
def plain_outputs(target):
    llm = LLM(str(target), dtype="float32", show_progress=False)
    return [o.token_ids for o in llm.generate(mixed_requests(), greedy(24))]


DRAFTS = {
    # name: (echo draft?, draft kwargs, steps, topk, num_draft_tokens)
    "echo-mla-chain": (True, {"kind": "mla"}, 3, 1, 4),
    "echo-mla-tree-topk2": (True, {"kind": "mla"}, 3, 2, 6),
    "echo-llama-tree-topk4": (True, {"kind": "llama", "prefix": "layers.0"}, 4, 4, 10),
    "random-llama-chain-hotvocab": (False, {"kind": "llama", "draft_vocab_size": 64}, 3, 1, 4),
    "random-mla-tree-topk3-normout": (False, {"kind": "mla", "draft_vocab_size": 64, "norm_output": True}, 2, 3, 7),
}


def make_draft(name: str, target, path):
    echo, kwargs, *_ = DRAFTS[name]
    seed = list(DRAFTS).index(name)
    return echo_draft(target, path, seed=seed, **kwargs) if echo else draft_for(target, path, seed=seed, **kwargs)


@pytest.mark.parametrize("name", list(DRAFTS))
def test_greedy_speculation_is_lossless_on_ragged_multimodal_batch(name, target, plain_outputs, tmp_path):
    echo, _, steps, topk, tokens = DRAFTS[name]
    llm = spec_llm(target, make_draft(name, target, tmp_path / "draft"), steps, topk, tokens)
    outputs = llm.generate(mixed_requests(), greedy(24))
    assert [o.token_ids for o in outputs] == plain_outputs
    for out in outputs:
        assert len(out.spec_accept_lengths) == out.spec_verify_ct
        assert sum(out.spec_accept_lengths) - out.spec_verify_ct == out.spec_accepted_tokens
        assert all(1 <= a <= steps + 1 for a in out.spec_accept_lengths)
    metrics = llm.spec_metrics()
    assert metrics["num_verify_steps"] == sum(o.spec_verify_ct for o in outputs)
    assert metrics["num_accepted_tokens"] == sum(o.spec_accepted_tokens for o in outputs)
    if echo:
        # The echo pair accepts often but not always: acceptance, rejection and bonus all ran.
        assert 1.5 < metrics["accept_length"] < steps + 1, metrics
    cache = llm.engine.cache
    assert llm.engine.num_free_blocks() == cache.allocator.num_usable


def test_batched_speculation_equals_each_request_alone(target, tmp_path):
    llm = spec_llm(target, echo_draft(target, tmp_path / "draft", kind="mla", seed=5), 3, 2, 5)
    batched = llm.generate(mixed_requests(), greedy(16))
    for request, out in zip(mixed_requests(), batched):
        alone = llm.generate([request], greedy(16))[0]
        assert alone.token_ids == out.token_ids
        assert alone.spec_accept_lengths == out.spec_accept_lengths


def test_seeded_speculative_sampling_reproducible_and_batch_independent(target, tmp_path):
    llm = spec_llm(target, echo_draft(target, tmp_path / "draft", kind="mla", seed=6), 3, 2, 5)
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(5)]
    first = [o.token_ids for o in llm.generate(mixed_requests(), params)]
    second = [o.token_ids for o in llm.generate(mixed_requests(), params)]
    assert first == second
    alone = llm.generate([mixed_requests()[2]], params[2])[0].token_ids
    assert alone == first[2]


def test_finishing_inside_an_accepted_block(target, plain_outputs, tmp_path):
    llm = spec_llm(target, echo_draft(target, tmp_path / "draft", kind="mla", seed=7), 4, 1, 5)
    for max_new in (1, 2, 3, 5, 7):
        outs = llm.generate(mixed_requests(), greedy(max_new))
        assert [o.token_ids for o in outs] == [p[:max_new] for p in plain_outputs]
    # A stop token that appears mid-output cuts exactly where plain decoding cuts.
    stop = plain_outputs[1][5]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[stop])
    spec = llm.generate(mixed_requests(), params)
    plain = LLM(str(target), dtype="float32", show_progress=False).generate(mixed_requests(), params)
    assert [(o.token_ids, o.finish_reason) for o in spec] == [(o.token_ids, o.finish_reason) for o in plain]
    assert spec[1].token_ids[-1] == stop and spec[1].finish_reason == "stop"


def test_caches_hold_exactly_the_accepted_path(target, tmp_path):
    """After every round, each request's target AND draft cache rows equal a fresh prefill of its tokens,
    and every block comes back once the requests finish."""
    draft = echo_draft(target, tmp_path / "draft", kind="mla", seed=8)
    llm = spec_llm(target, draft, 3, 2, 6)
    engine = llm.engine
    reference = spec_llm(target, draft, 3, 2, 6)
    initial_free = engine.num_free_blocks()
    for request in mixed_requests()[:3]:
        engine.add_request(request, greedy(30))
    rounds = 0
    while engine.has_unfinished():
        engine.step()
        rounds += 1
        for req in engine.running:
            n = req.num_cached_tokens
            row = req.req_pool_idx
            assert engine.cache.row_len[row] == n == req.num_tokens - 1
            # The row keeps the blocks of the next round's scratch, no more.
            blocks_needed = engine.cache.blocks_needed
            assert blocks_needed(n) <= len(engine.cache.row_blocks[row]) <= blocks_needed(n + engine.spec_worker.spec.scratch_len)
            slots = engine.cache.req_to_token[row, :n]
            fresh_target, fresh_draft = fresh_cache_rows(reference, req)
            torch.testing.assert_close(engine.cache.target.kv[:, slots], fresh_target, atol=1e-5, rtol=0)
            torch.testing.assert_close(engine.spec_worker.pool.kv[:, slots], fresh_draft, atol=1e-5, rtol=0)
    assert rounds > 3
    assert engine.num_free_blocks() == initial_free


def fresh_cache_rows(llm: LLM, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft cache entries of a spec prefill over req's cached tokens, with its root as tail."""
    engine = llm.engine
    fresh = Request("fresh", req.prompt_token_ids + req.output_token_ids[:-1], req.sampling_params, req.mm_inputs)
    fresh.req_pool_idx = engine.cache.alloc_row()
    try:
        root = req.output_token_ids[-1]
        engine.spec_worker.prefill([fresh], [fresh.num_tokens], lambda logits: torch.tensor([root]))
        slots = engine.cache.req_to_token[fresh.req_pool_idx, : fresh.num_tokens]
        return engine.cache.target.kv[:, slots].clone(), engine.spec_worker.pool.kv[:, slots].clone()
    finally:
        engine.cache.free_row(fresh.req_pool_idx)


@pytest.mark.parametrize("shape", [(3, 1, 4), (2, 2, 5)])
@pytest.mark.parametrize("cpu_kernels", [
    # bfloat16 rows whose bits do not depend on their batch: the kernels' tile GEMM, or oneDNN's native bfloat16
    pytest.param(True, id="kernels", marks=pytest.mark.skipif(kernels.tile_backend() is None, reason="the kernels' build has no tile GEMM here")),
    pytest.param(False, id="pytorch-ops", marks=pytest.mark.skipif(not should_pack(torch.bfloat16), reason="CPU without native bfloat16 GEMMs")),
])
def test_bf16_greedy_speculation_matches_plain_decoding_bit_for_bit(target, tmp_path, shape, cpu_kernels):
    """A verify pass gives each token the logits plain decoding gives it: the same tokens, and
    logprobs equal to the last bit, alone and in a ragged batch (the row-count checks of the
    float32 products themselves are in test_cache.py and test_layer_fast_paths.py)."""
    draft = echo_draft(target, tmp_path / "draft", kind="mla")
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = LLM(str(target), dtype="bfloat16", show_progress=False, cpu_kernels=cpu_kernels)
    steps, topk, tokens = shape
    spec = LLM(str(target), dtype="bfloat16", show_progress=False, cpu_kernels=cpu_kernels, speculative_algorithm="EAGLE3",
               speculative_draft_model_path=str(draft), speculative_num_steps=steps,
               speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens, speculative_adaptive=False)
    for requests in (mixed_requests()[1:2], mixed_requests()):
        expected = plain.generate(requests, params)
        got = spec.generate(requests, params)
        for a, b in zip(expected, got):
            assert a.token_ids == b.token_ids
            assert [(p.token_id, p.logprob, p.top) for p in a.logprobs] == [(p.token_id, p.logprob, p.top) for p in b.logprobs]
