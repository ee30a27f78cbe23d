"""The SGLang #27647 regression: every request of a multimodal batch gets its own draft inputs.

Draft slot p must hold (token p+1, target features at p, position p), with the multimodal
embeddings rotated like the ids and each request's tail slot holding the plain embedding of its
tail token. The check compares each request's draft inputs in a batch of 4+ multimodal requests
with (a) the same request alone and (b) values built independently here, and it is shown to catch
the two shipped bugs: a tail patched only at the flat buffer's last row, and unrotated embeddings.
"""

import pytest
import torch
from eaglet.testing.images import make_image
from eaglet.testing.checkpoints import write_kimi_k25_checkpoint
from eaglet.testing.echo_checkpoints import IMAGE_TOKEN, draft_for

import eaglet.spec.eagle_worker as eagle_worker
from eaglet import LLM
from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.executor.request import Request
from eaglet.sampling_params import SamplingParams
from eaglet.spec.draft_inputs import rotate_segments


def requests():
    return [
        {"prompt_token_ids": [3, IMAGE_TOKEN, 9, 10], "images": [make_image(40, 28, 0)]},
        {"prompt_token_ids": [IMAGE_TOKEN, 21, 22, IMAGE_TOKEN, 23], "images": [make_image(24, 56, 1), make_image(33, 17, 2)]},
        {"prompt_token_ids": [5, 6, 7, 8, 9]},
        {"prompt_token_ids": [99, 98, IMAGE_TOKEN], "images": [make_image(16, 16, 4)]},
        {"prompt_token_ids": [IMAGE_TOKEN, 30, 31], "images": [make_image(64, 40, 3)]},
    ]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    target = write_kimi_k25_checkpoint(tmp_path_factory.mktemp("target"), seed=13, image_token_id=IMAGE_TOKEN)
    draft = draft_for(target, tmp_path_factory.mktemp("draft"), kind="mla", draft_vocab_size=None, seed=3)
    return LLM(
        str(target), dtype="float32", show_progress=False, speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(draft), speculative_num_steps=3, speculative_eagle_topk=2,
        speculative_num_draft_tokens=5, speculative_adaptive=False,
    )


def run_prefill(llm: LLM, prompts: list[dict], tails: list[int]) -> list[dict]:
    """Spec prefill of the prompts in one batch with fixed tails; returns per-request draft inputs
    and the draft state the extend left."""
    engine = llm.engine
    worker = engine.spec_worker
    recorded = {}
    original = worker._draft_extend

    def record(target_batch, ids, embeds, features):
        # A text-only batch lets the draft embed the ids itself: record what it will look up.
        seen = worker.draft.embed(ids) if embeds is None else embeds
        recorded.update(batch=target_batch, ids=ids.clone(), embeds=seen.clone())
        return original(target_batch, ids, embeds, features)

    reqs = []
    for i, prompt in enumerate(prompts):
        ids, mm = engine._prepare_prompt(prompt)
        req = Request(f"r{i}", ids, SamplingParams(max_new_tokens=1), mm)
        req.req_pool_idx = engine.cache.alloc_row()
        reqs.append(req)
    worker._draft_extend = record
    try:
        worker.prefill(reqs, [r.num_tokens for r in reqs], lambda logits: torch.tensor(tails))
        states = [worker.draft_state(req) for req in reqs]  # before the rows are freed and reused
    finally:
        worker._draft_extend = original
        for req in reqs:
            engine.cache.free_row(req.req_pool_idx)
    batch: ForwardBatch = recorded["batch"]
    segments = []
    for i in range(len(prompts)):
        start, n = int(batch.extend_start_loc[i]), batch.extend_seq_lens_cpu[i]
        segments.append(
            {
                "ids": recorded["ids"][start : start + n],
                "embeds": recorded["embeds"][start : start + n],
                "positions": batch.positions[start : start + n],
                "draft_state": states[i],
            }
        )
    return segments


def expected_inputs(llm: LLM, prompt: dict, tail: int) -> dict:
    """Built independently: rotate the request's own merged embeddings; plain embedding at the tail."""
    engine = llm.engine
    ids, mm = engine._prepare_prompt(prompt)
    model = engine.model
    with torch.inference_mode():
        embeds = model.embed_tokens(torch.tensor([0 if t == IMAGE_TOKEN else t for t in ids]))
        if mm is not None:
            embeds[mm.placeholder_positions] = model.encode_images(mm.pixel_values, mm.grid_thws)
        tail_embed = model.embed_tokens(torch.tensor([tail]))
    return {
        "ids": torch.tensor(ids[1:] + [tail]),
        "embeds": torch.cat([embeds[1:], tail_embed]),
        "positions": torch.arange(len(ids)),
    }


def check_draft_inputs(llm: LLM) -> None:
    prompts = requests()
    tails = [40 + i for i in range(len(prompts))]
    batched = run_prefill(llm, prompts, tails)
    for i, prompt in enumerate(prompts):
        alone = run_prefill(llm, [prompt], [tails[i]])
        expected = expected_inputs(llm, prompt, tails[i])
        for key in ("ids", "positions", "embeds"):
            torch.testing.assert_close(batched[i][key], alone[0][key], atol=1e-6, rtol=0, msg=f"request {i} {key}")
            torch.testing.assert_close(batched[i][key], expected[key], atol=1e-6, rtol=0, msg=f"request {i} {key}")
        # The first draft proposals (step 0 top-k after the extend) match too.
        batched_state, alone_state = batched[i]["draft_state"], alone[0]["draft_state"]
        assert batched_state.topk_tokens.tolist() == alone_state.topk_tokens.tolist()
        torch.testing.assert_close(batched_state.topk_logprobs, alone_state.topk_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(batched_state.hidden, alone_state.hidden, atol=1e-5, rtol=0)


def test_each_request_gets_its_own_draft_inputs(llm):
    check_draft_inputs(llm)


def test_check_catches_a_tail_patched_only_at_the_last_row(llm, monkeypatch):
    def last_row_only(batch, tail_ids, tail_embeds):
        ids = torch.cat([batch.input_ids[1:], tail_ids[-1:]])
        embeds = torch.cat([batch.input_embeds[1:], tail_embeds[-1:]])
        return ids, embeds

    monkeypatch.setattr(eagle_worker, "draft_extend_inputs", last_row_only)
    with pytest.raises(AssertionError):
        check_draft_inputs(llm)


def test_check_catches_unrotated_multimodal_embeddings(llm, monkeypatch):
    def unrotated_embeddings(batch, tail_ids, tail_embeds):
        ids = rotate_segments(batch, batch.input_ids, tail_ids)
        embeds = batch.input_embeds.clone()
        embeds[batch.extend_start_loc + batch.extend_seq_lens - 1] = tail_embeds
        return ids, embeds

    monkeypatch.setattr(eagle_worker, "draft_extend_inputs", unrotated_embeddings)
    with pytest.raises(AssertionError):
        check_draft_inputs(llm)


def test_non_final_chunk_tail_is_the_next_prompt_token(llm):
    """Prefill in chunks: the draft cache ends up as after a one-shot prefill (tails = next prompt token)."""
    engine = llm.engine
    prompt = requests()[1]
    ids, mm = engine._prepare_prompt(prompt)
    results = []
    for chunk in (None, 3):
        req = Request("c", ids, SamplingParams(max_new_tokens=1), mm)
        req.req_pool_idx = engine.cache.alloc_row()
        try:
            while req.num_cached_tokens < req.num_tokens:
                n = min(chunk or req.num_tokens, req.num_tokens - req.num_cached_tokens)
                engine.spec_worker.prefill([req], [n], lambda logits: torch.tensor([42]))
            slots = engine.cache.req_to_token[req.req_pool_idx, : req.num_tokens]
            results.append((engine.spec_worker.pool.kv[:, slots].clone(), engine.spec_worker.draft_state(req).topk_tokens.tolist()))
        finally:
            engine.cache.free_row(req.req_pool_idx)
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=0)
    assert results[0][1] == results[1][1]
