"""Tensor and expert parallelism (tp_size=2, ep_size=2) against one process and transformers.

Every TP engine starts a second process (rank 1) and pins this process to its share of the cores until
``engine.close()``. Two TP engines cannot be open at once in one process (one default process group;
the first engine's pinning leaves a 2-core machine one core to divide), so each engine lives in a
class-scoped fixture (closed when its class ends) or a ``with tp_llm(...)`` block, never beside another.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from runtime_utils import greedy, prompt_logits
from safetensors.torch import load_file, save_file
from test_deepseek_parity import YARN

from eaglet import LLM
from eaglet.errors import CheckpointError, ConfigError
from eaglet.sampling_params import SamplingParams
from eaglet.testing.checkpoints import (
    load_reference_deepseek_v3,
    load_reference_kimi_k25,
    read_checkpoint_tensors,
    write_deepseek_v3_checkpoint,
    write_kimi_k25_checkpoint,
)
from eaglet.testing.echo_checkpoints import IMAGE_TOKEN, echo_draft, echo_kimi_target
from eaglet.testing.images import make_image
from eaglet.testing.quantized_checkpoints import (
    write_fp8_checkpoint,
    write_int4_checkpoint,
)

DEEPSEEK = {
    # case: (text overrides, ep_size)
    "q_lora-dense1-tp2": ({}, 1),
    # an odd vocabulary: rank 0 multiplies 126 lm_head rows, rank 1 125
    "no_q_lora-yarn-dense0-vocab251-tp2-ep2": (
        {"q_lora_rank": None, "rope_scaling": YARN, "first_k_dense_replace": 0, "vocab_size": 251}, 2
    ),
}
PROMPTS = [[3, 17, 33, 2, 99, 100, 7, 45], list(range(10, 79)), [200, 5], [77] * 13]
KIMI_REQUESTS = [
    {"prompt_token_ids": [3, 4, IMAGE_TOKEN, 9, 10, 11], "images": [make_image(40, 28, 0)]},
    {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]},
    {"prompt_token_ids": [20, IMAGE_TOKEN, 21, 22, IMAGE_TOKEN, 23], "images": [make_image(24, 56, 1), make_image(33, 17, 2)]},
    {"prompt_token_ids": list(range(40, 71))},
    {"prompt_token_ids": [99, 98, IMAGE_TOKEN], "images": [make_image(16, 16, 4)]},
]


GREEDY_LOGPROBS = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


@contextlib.contextmanager
def tp_llm(path, **kwargs):
    """An engine (by default float32, tp_size=2) that is closed however the block ends."""
    llm = LLM(str(path), show_progress=False, **{"dtype": "float32", "tp_size": 2, **kwargs})
    try:
        yield llm
    finally:
        llm.engine.close()


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind():
    affinity = os.sched_getaffinity(0)
    yield
    assert multiprocessing.active_children() == []
    assert os.sched_getaffinity(0) == affinity
    assert not dist.is_initialized()


def results(outputs) -> list[tuple]:
    """Tokens and logprobs (chosen and top), to compare bit for bit."""
    return [(o.token_ids, [(e.token_id, e.logprob, e.top) for e in o.logprobs or []]) for o in outputs]


def text_requests(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def transformers_greedy(reference, inputs: dict, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


# ------------------------------------------------------------------------------------------------
# refusals: first, so every later engine also shows that a refused start leaves a clean process


def test_heads_that_do_not_split_are_refused_and_leave_no_process(tmp_path):
    path = write_deepseek_v3_checkpoint(tmp_path / "heads3", {"num_attention_heads": 3, "num_key_value_heads": 3}, seed=1)
    affinity = os.sched_getaffinity(0)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(3\) does not split into 2 equal parts"):
        LLM(str(path), dtype="float32", show_progress=False, tp_size=2)
    assert multiprocessing.active_children() == []
    assert os.sched_getaffinity(0) == affinity
    assert not dist.is_initialized()


def test_ep_size_other_than_1_or_tp_size_is_refused_before_any_process(tmp_path):
    path = write_deepseek_v3_checkpoint(tmp_path / "ds", seed=1)
    with pytest.raises(ConfigError, match="ep_size must be 1 or tp_size"):
        LLM(str(path), dtype="float32", show_progress=False, tp_size=2, ep_size=3)
    assert multiprocessing.active_children() == []


def test_int4_groups_split_by_a_rank_boundary_are_refused_and_leave_no_process(tmp_path):
    # moe_intermediate_size 32 (the default): each rank would hold 16 columns of a down_proj, half a group of 32
    write_kimi_k25_checkpoint(tmp_path / "bf16", seed=7, dtype=torch.bfloat16, image_token_id=IMAGE_TOKEN)
    path = write_int4_checkpoint(tmp_path / "bf16", tmp_path / "int4")
    with pytest.raises(CheckpointError, match=r"columns \[0, 16\) of 32, not whole int4 groups of 32"):
        LLM(str(path), dtype="float32", show_progress=False, tp_size=2)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_draft_sharing_the_target_lm_head_runs_on_a_whole_copy(kimi_target, tmp_path):
    """A draft without its own lm_head: rank 0 reads the target's whole, so speculation under TP
    emits what plain decoding does, and what TP=1 speculation does."""
    draft = echo_draft(kimi_target, tmp_path / "draft", kind="mla")  # no lm_head: it shares the target's
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft), speculative_adaptive=False)
    requests = text_requests([[5, 6, 7, 8, 9, 10, 11], list(range(30, 52))])
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    single = LLM(str(kimi_target), dtype="float32", show_progress=False, **spec)
    expected = [o.token_ids for o in single.generate(requests, params)]
    with tp_llm(kimi_target) as plain:
        assert [o.token_ids for o in plain.generate(requests, params)] == expected
    with tp_llm(kimi_target, **spec) as speculative:
        outputs = speculative.generate(requests, params)
        assert [o.token_ids for o in outputs] == expected
        assert sum(o.spec_accepted_tokens for o in outputs) > 0


# ------------------------------------------------------------------------------------------------
# DeepSeek-V3, float32: TP=2 (experts split by intermediate) and TP=2 x EP=2 (experts divided)


class TestDeepSeek:
    @pytest.fixture(scope="class", params=list(DEEPSEEK))
    def case(self, request, tmp_path_factory):
        overrides, ep_size = DEEPSEEK[request.param]
        path = write_deepseek_v3_checkpoint(tmp_path_factory.mktemp(request.param), overrides, seed=1, num_shards=2)
        tp1 = LLM(str(path), dtype="float32", show_progress=False, block_size=4)
        reference = load_reference_deepseek_v3(path)
        with tp_llm(path, ep_size=ep_size, block_size=4) as tp2:
            yield SimpleNamespace(path=path, ep_size=ep_size, vocab=overrides.get("vocab_size", 256), tp1=tp1, tp2=tp2,
                                  reference=reference)

    @staticmethod
    def fresh(llm: LLM) -> LLM:
        """The engine with an empty prefix cache (no earlier request's blocks to hit)."""
        llm.engine.prefix_cache.reset()
        return llm

    def test_prompt_logits_match_transformers_and_tp1(self, case):
        ours = prompt_logits(case.tp2, text_requests(PROMPTS))
        single = prompt_logits(case.tp1, text_requests(PROMPTS))
        for prompt, logits, one in zip(PROMPTS, ours, single):
            with torch.no_grad():
                expected = case.reference(torch.tensor([prompt])).logits[0].float()
            assert logits.shape == expected.shape == (len(prompt), case.vocab)
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
            torch.testing.assert_close(logits, one, atol=1e-4, rtol=0)

    def test_greedy_tokens_match_tp1_and_transformers(self, case):
        tp2 = [o.token_ids for o in case.tp2.generate(text_requests(PROMPTS), greedy(32))]
        assert tp2 == [o.token_ids for o in self.fresh(case.tp1).generate(text_requests(PROMPTS), greedy(32))]
        for prompt, tokens in zip(PROMPTS[:2], tp2):  # transformers' generate is the slow part
            assert tokens == transformers_greedy(case.reference, {"input_ids": torch.tensor([prompt])}, 32)

    def test_each_request_in_a_ragged_batch_equals_it_alone(self, case):
        prompts = [[5, 6, 7], list(range(30, 71)), [9] * 11, [(7 * i + 3) % 250 for i in range(23)], [42]]
        params = [
            SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2) if i % 2 == 0
            else SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, seed=100 + i, ignore_eos=True, logprobs=2)
            for i in range(len(prompts))
        ]
        llm = self.fresh(case.tp2)
        together = results(llm.generate(text_requests(prompts), params))
        backwards = results(self.fresh(llm).generate(text_requests(prompts[::-1]), params[::-1]))[::-1]
        alone = [results(self.fresh(llm).generate(text_requests([p]), q))[0] for p, q in zip(prompts, params)]
        assert together == alone
        assert backwards == alone
        # greedy without logprobs takes the ranks' (best, id) exchange instead of gathering the logits
        argmax = [o.token_ids for o in self.fresh(llm).generate(text_requests(prompts), greedy(10))]
        for i in range(0, len(prompts), 2):
            assert argmax[i] == alone[i][0]
        assert llm.engine.num_free_blocks() == llm.engine.cache.allocator.num_usable

    def test_prefix_cache_hit_equals_cold_run(self, case):
        shared = [(11 * i + 5) % 240 for i in range(37)]  # 9 full blocks of 4
        requests = text_requests([shared + [1, 2, 3], shared + list(range(100, 120)), shared[:30] + [7]])
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
        llm = case.tp2
        cold = [results(self.fresh(llm).generate([r], params))[0] for r in requests]
        cache = llm.engine.prefix_cache
        for request, expected in zip(requests, cold):
            self.fresh(llm).generate(text_requests([shared + [200, 201]]), greedy(2))  # shares the long prefix
            hits = cache.hit_tokens
            assert results(llm.generate([request], params))[0] == expected
            assert cache.hit_tokens - hits >= 28
        assert llm.engine.num_free_blocks() == llm.engine.cache.allocator.num_usable

    def test_chunked_prefill_equals_one_shot(self, case):
        requests = text_requests(PROMPTS)
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
        engine = case.tp2.engine
        one_shot = case.tp2.generate(requests, params)
        chunks: list[int] = []
        forward = engine.runner.forward

        def recording(batch):
            chunks.append(max(batch.extend_seq_lens_cpu))
            return forward(batch)

        engine.runner.forward = recording
        engine.scheduler.config.chunked_prefill_size = 5
        try:
            chunked = case.tp2.generate(requests, params)
        finally:
            engine.scheduler.config.chunked_prefill_size = None
            del engine.runner.forward
        assert max(chunks) == 5 and len(chunks) >= 14 + 5  # 14 chunks of the 69-token prompt, then 5 decodes
        assert results(chunked) == results(one_shot)
        assert [o.prompt_logprobs for o in chunked] == [o.prompt_logprobs for o in one_shot]
        # and the runner's own chunking (prompt_logits, 3 tokens per forward) gives prompt logits of the same bits
        for a, b in zip(prompt_logits(case.tp2, requests), prompt_logits(case.tp2, requests, chunk=3)):
            assert torch.equal(a, b)

    def test_rank0_holds_only_its_share(self, case):
        full, part = case.tp1.engine.model, case.tp2.engine.model
        layer = 0
        attn1, attn2 = full.model.layers[layer].self_attn, part.model.layers[layer].self_attn
        assert attn2.num_heads * 2 == attn1.num_heads == 4
        assert attn2.kv_b_proj.weight.shape[0] * 2 == attn1.kv_b_proj.weight.shape[0] == 4 * (8 + 8)
        assert attn2.o_proj.weight.shape[1] * 2 == attn1.o_proj.weight.shape[1]
        q = "q_proj" if attn1.q_lora_rank is None else "q_b_proj"
        assert getattr(attn2, q).weight.shape[0] * 2 == getattr(attn1, q).weight.shape[0]
        # rank 0 holds heads 0 and 1: its absorbed per-head matrices are the first half of the whole model's
        assert torch.equal(attn2.w_uk, attn1.w_uk[:2]) and torch.equal(attn2.w_uv_t, attn1.w_uv_t[:2])
        # the latent down-projections, norms and embedding are whole on every rank
        assert torch.equal(attn2.kv_a_proj_with_mqa.weight, attn1.kv_a_proj_with_mqa.weight)
        assert torch.equal(part.model.embed_tokens.weight, full.model.embed_tokens.weight)
        rows = -(-case.vocab // 2)
        assert part.lm_head.weight.shape == (rows, 64) and full.lm_head.weight.shape == (case.vocab, 64)
        assert torch.equal(part.lm_head.weight, full.lm_head.weight[:rows])
        moe = next(i for i, l in enumerate(full.model.layers) if hasattr(l.mlp, "experts"))
        e1, e2 = full.model.layers[moe].mlp.experts, part.model.layers[moe].mlp.experts
        assert e1.w13.shape == (8, 2 * 32, 64) and e1.w2.shape == (8, 64, 32)
        if case.ep_size == 2:  # whole experts 0..3 here, 4..7 on rank 1
            assert e2.w13.shape == (4, 2 * 32, 64) and e2.w2.shape == (4, 64, 32)
            assert torch.equal(e2.w13, e1.w13[:4]) and torch.equal(e2.w2, e1.w2[:4])
        else:  # every expert, its first 16 of 32 intermediate rows
            assert e2.w13.shape == (8, 2 * 16, 64) and e2.w2.shape == (8, 64, 16)
            assert torch.equal(e2.w13, torch.cat([e1.w13[:, :16], e1.w13[:, 32:48]], dim=1))
            assert torch.equal(e2.w2, e1.w2[:, :, :16])
        shared1, shared2 = full.model.layers[moe].mlp.shared_experts, part.model.layers[moe].mlp.shared_experts
        assert shared2.gate_proj.weight.shape[0] * 2 == shared1.gate_proj.weight.shape[0]
        # Bytes: what the checkpoint holds, the split tensors halved (lm_head: ceil(vocab / 2) rows), the rest whole.
        stored = read_checkpoint_tensors(case.path)
        split = re.compile(r"(q_proj|q_b_proj|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
        total = sum(t.numel() * t.element_size() for t in stored.values())
        halved = sum(t.numel() * t.element_size() for n, t in stored.items() if split.search(n))
        head = stored["lm_head.weight"]
        assert param_bytes(full) == total
        assert param_bytes(part) == total - halved // 2 - head.numel() * 4 + rows * 64 * 4
        # In float32 elements. q_lora case: replicated = embed 16384 + 3 layers x (norms 128, q_a 1536, q_a norm 24,
        # kv_a 1280, kv_a norm 16) + 2 routers x 520 + final norm 64 = 26440; split = attention 3 x (q_b 1152 +
        # kv_b 1024 + o 2048) + dense MLP 18432 + 2 MoE x (experts 49152 + shared 6144) + lm_head 16384 = 158080:
        # rank 0 holds 26440 + 158080 / 2 = 105480 of 184520 (0.5716).
        # no_q_lora case: replicated = embed 251 x 64 = 16064 + 3 x (128 + 1280 + 16) + 3 x 520 + 64 = 21960;
        # split = 3 x (q 3072 + 1024 + 2048) + 3 x 55296 = 184320 (experts divided instead of split: the same
        # halving) + lm_head 16064 of which rank 0 holds 126 x 64 = 8064: 21960 + 92160 + 8064 = 122184 of
        # 222344 (0.5495).
        expected = {1: (105480, 184520), 2: (122184, 222344)}[case.ep_size]
        assert (param_bytes(part), param_bytes(full)) == (4 * expected[0], 4 * expected[1])
        ratio = param_bytes(part) / param_bytes(full)
        print(f"\n{case.path.name}: rank 0 holds {param_bytes(part)} of {total} parameter bytes ({ratio:.4f})")


# ------------------------------------------------------------------------------------------------
# Kimi-K2.5 with images (the echo target the speculative tests use): one TP=2 engine, its results shared


@pytest.fixture(scope="module")
def kimi_target(tmp_path_factory):
    return echo_kimi_target(tmp_path_factory.mktemp("kimi-echo"), alpha=1.0)


@pytest.fixture(scope="module")
def kimi_tp2(kimi_target):
    """What a TP=2 engine gives KIMI_REQUESTS (the engine is closed before this returns): prompt logits in
    one pass and in chunks of 3 tokens (cutting through images), greedy tokens (the ranks' argmax exchange)
    in a batch and alone, and greedy tokens with logprobs (the gathered logits)."""
    with tp_llm(kimi_target) as llm:
        return SimpleNamespace(
            logits=prompt_logits(llm, KIMI_REQUESTS),
            chunked_logits=prompt_logits(llm, KIMI_REQUESTS, chunk=3),
            tokens=[o.token_ids for o in llm.generate(KIMI_REQUESTS, greedy(24))],
            alone=[llm.generate([r], greedy(24))[0].token_ids for r in KIMI_REQUESTS[:3]],
            logprobs=results(llm.generate(KIMI_REQUESTS, GREEDY_LOGPROBS)),
        )


@pytest.fixture(scope="module")
def kimi_tp1(kimi_target):
    return LLM(str(kimi_target), dtype="float32", show_progress=False)


def kimi_reference_inputs(llm: LLM, request: dict) -> dict:
    token_ids, mm = llm.engine._prepare_prompt(request)
    inputs = {"input_ids": torch.tensor([token_ids])}
    if mm is not None:
        inputs["pixel_values"], inputs["image_grid_thw"] = mm.pixel_values, mm.grid_thws
    return inputs


def test_kimi_with_images_tp2_matches_tp1_and_transformers(kimi_target, kimi_tp2, kimi_tp1):
    reference = load_reference_kimi_k25(kimi_target)
    tp1_logits = prompt_logits(kimi_tp1, KIMI_REQUESTS)
    for request, logits, one in zip(KIMI_REQUESTS, kimi_tp2.logits, tp1_logits):
        with torch.no_grad():
            expected = reference(**kimi_reference_inputs(kimi_tp1, request)).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(logits, one, atol=1e-4, rtol=0)
    for logits, chunked in zip(kimi_tp2.logits, kimi_tp2.chunked_logits):
        assert torch.equal(logits, chunked)
    assert kimi_tp2.tokens == [o.token_ids for o in kimi_tp1.generate(KIMI_REQUESTS, greedy(24))]
    assert kimi_tp2.alone == kimi_tp2.tokens[:3]
    assert [r[0] for r in kimi_tp2.logprobs] == [t[:12] for t in kimi_tp2.tokens]
    for request, tokens in zip(KIMI_REQUESTS[:3], kimi_tp2.tokens):
        assert tokens == transformers_greedy(reference, kimi_reference_inputs(kimi_tp1, request), 24)


# ------------------------------------------------------------------------------------------------
# EAGLE-3 speculation under TP=2: the draft runs on rank 0 with an lm_head of its own


SPEC_SHAPES = {
    # name: (draft kind, draft kwargs, steps, topk, num_draft_tokens)
    "mla-chain": ("mla", {}, 3, 1, 4),
    "llama-tree-topk2": ("llama", {"prefix": "layers.0"}, 3, 2, 6),
}


def echo_draft_with_own_lm_head(target, path, kind: str, **kwargs):
    """The echo draft, with a copy of the target's lm_head as its own (under TP it cannot share it)."""
    echo_draft(target, path, kind=kind, with_lm_head=True, **kwargs)
    head = read_checkpoint_tensors(target)["language_model.lm_head.weight"]
    tensors = load_file(path / "model.safetensors")
    assert tensors["lm_head.weight"].shape == head.shape
    tensors["lm_head.weight"] = head.clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


class TestSpeculative:
    @pytest.fixture(scope="class", params=list(SPEC_SHAPES))
    def spec(self, request, kimi_target, kimi_tp2, tmp_path_factory):
        kind, kwargs, steps, topk, tokens = SPEC_SHAPES[request.param]
        draft = echo_draft_with_own_lm_head(kimi_target, tmp_path_factory.mktemp(f"draft-{request.param}"), kind, **kwargs)
        engine_kwargs = {
            "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(draft), "speculative_num_steps": steps,
            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens, "speculative_adaptive": False,
        }
        tp1 = LLM(str(kimi_target), dtype="float32", show_progress=False, **engine_kwargs)
        with tp_llm(kimi_target, **engine_kwargs) as tp2:
            yield SimpleNamespace(tp1=tp1, tp2=tp2, steps=steps)

    def test_speculative_tp2_equals_plain_tp2_and_speculative_tp1(self, spec, kimi_tp2):
        outputs = spec.tp2.generate(KIMI_REQUESTS, greedy(24))
        assert [o.token_ids for o in outputs] == kimi_tp2.tokens
        assert [o.token_ids for o in outputs] == [o.token_ids for o in spec.tp1.generate(KIMI_REQUESTS, greedy(24))]
        assert sum(o.spec_accepted_tokens for o in outputs) > 0  # drafts were accepted, not only bonus tokens
        for out in outputs:
            assert all(1 <= a <= spec.steps + 1 for a in out.spec_accept_lengths)
        assert spec.tp2.engine.num_free_blocks() == spec.tp2.engine.cache.allocator.num_usable

    def test_speculative_tp2_logprobs_equal_plain_tp2_bit_for_bit(self, spec, kimi_tp2):
        """A verify pass gives each token the logits plain decoding gives it, on the ranks' gathered logits."""
        assert results(spec.tp2.generate(KIMI_REQUESTS, GREEDY_LOGPROBS)) == kimi_tp2.logprobs

    def test_speculative_tp2_request_alone_equals_in_batch(self, spec, kimi_tp2):
        for i in (0, 3):
            assert spec.tp2.generate([KIMI_REQUESTS[i]], greedy(24))[0].token_ids == kimi_tp2.tokens[i]


# ------------------------------------------------------------------------------------------------
# bfloat16: TP=2 against TP=1 (not bit for bit: the ranks' partial sums are rounded and added in another order)


def test_bfloat16_tp2_close_to_tp1(tmp_path):
    """Every token goes to all 8 experts: with top-2 routing, bfloat16's rounding flips a near-tied expert
    choice at a few positions (either way, TP or not), a jump of several logits that says nothing of TP."""
    path = write_deepseek_v3_checkpoint(tmp_path / "ds", {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 8}, seed=1)
    requests = text_requests(PROMPTS)
    tp1 = LLM(str(path), dtype="bfloat16", show_progress=False)
    expected_logits = prompt_logits(tp1, requests)
    expected_tokens = [o.token_ids for o in tp1.generate(requests, greedy(24))]
    with tp_llm(path, dtype="bfloat16") as tp2:
        assert next(tp2.engine.model.parameters()).dtype == torch.bfloat16
        logits = prompt_logits(tp2, requests)
        tokens = [o.token_ids for o in tp2.generate(requests, greedy(24))]
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(logits, expected_logits))
    scale = max(b.float().abs().max().item() for b in expected_logits)
    same = [a == b for a, b in zip(tokens, expected_tokens)]
    print(f"\nbfloat16 TP=2 vs TP=1: max |prompt logit difference| {diff:.5f} (logits up to {scale:.2f}); "
          f"greedy tokens identical per prompt: {same}")
    assert diff < 0.25
    assert all(same)


def test_bfloat16_decoder_stack_all_reduces_as_the_layers_do(tmp_path):
    """bfloat16 with the kernels: each rank runs its layers in one C++ call that all-reduces through
    the same shared memory. With rank 0's stack off (its layers one by one in Python, all-reducing
    there) against rank 1's still on, the two sides meet in the same collectives and every logit
    keeps its bits."""
    from eaglet import kernels

    if not kernels.available() or kernels.tile_backend() is None:
        pytest.skip("the decoder stack needs the tile-layout kernels")
    path = write_deepseek_v3_checkpoint(tmp_path / "ds", {}, seed=2)
    requests = text_requests(PROMPTS)
    with tp_llm(path, dtype="bfloat16") as tp2:
        model = tp2.engine.model.model
        assert model.decoder_stack is not None
        with_stack = prompt_logits(tp2, requests)
        time = tp2.engine.collective_time()
        assert time.calls > 0
        model.decoder_stack = None
        without = prompt_logits(tp2, requests)
    for a, b in zip(with_stack, without):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# quantized checkpoints: int4 routed experts (groups of 32) and FP8 128 x 128 blocks, split on their edges


def test_int4_kimi_tp2_equals_tp1(tmp_path):
    # moe_intermediate_size 64: each rank's half of a down_proj's columns is one whole group of 32
    write_kimi_k25_checkpoint(tmp_path / "bf16", {"moe_intermediate_size": 64}, seed=7, dtype=torch.bfloat16,
                              image_token_id=IMAGE_TOKEN)
    path = write_int4_checkpoint(tmp_path / "bf16", tmp_path / "int4")
    tp1 = LLM(str(path), dtype="float32", show_progress=False)
    expected_tokens = [o.token_ids for o in tp1.generate(KIMI_REQUESTS, greedy(16))]
    expected_logits = prompt_logits(tp1, KIMI_REQUESTS)
    e1 = tp1.engine.model.language_model.model.layers[1].mlp.experts
    with tp_llm(path) as tp2:
        e2 = tp2.engine.model.language_model.model.layers[1].mlp.experts
        for expert in (0, 5):
            gate_up1, down1 = e1.method.per_expert[expert].gate_up.weight, e1.method.per_expert[expert].down.weight
            gate_up2, down2 = e2.method.per_expert[expert].gate_up.weight, e2.method.per_expert[expert].down.weight
            assert gate_up2.format == down2.format == "int4" and gate_up2.codes.dtype == torch.int32
            assert gate_up2.shape == (64, 64) and down2.shape == (64, 32) and down1.shape == (64, 64)
            whole = gate_up1.dequantize()
            assert torch.equal(gate_up2.dequantize(), torch.cat([whole[:32], whole[64:96]]))
            assert torch.equal(down2.dequantize(), down1.dequantize()[:, :32])
        tokens = [o.token_ids for o in tp2.generate(KIMI_REQUESTS, greedy(16))]
        logits = prompt_logits(tp2, KIMI_REQUESTS)
    assert tokens == expected_tokens
    for a, b in zip(logits, expected_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_fp8_deepseek_tp2_equals_tp1(tmp_path):
    # o_proj (4 heads x 64), the MLPs' and experts' down_proj: 256 columns, one 128-column block per rank;
    # kv_b_proj's 4 x (8 + 64) = 288 rows split at 144, inside a 128-row block
    overrides = {"hidden_size": 160, "v_head_dim": 64, "intermediate_size": 256, "moe_intermediate_size": 256}
    write_deepseek_v3_checkpoint(tmp_path / "bf16", overrides, seed=1, dtype=torch.bfloat16)
    path = write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    requests = text_requests(PROMPTS)
    tp1 = LLM(str(path), dtype="float32", show_progress=False)
    expected_tokens = [o.token_ids for o in tp1.generate(requests, greedy(16))]
    expected_logits = prompt_logits(tp1, requests)
    attn1 = tp1.engine.model.model.layers[0].self_attn
    with tp_llm(path) as tp2:
        attn2 = tp2.engine.model.model.layers[0].self_attn
        assert attn2.w_uk.shape == (2, 8, 16) and torch.equal(attn2.w_uk, attn1.w_uk[:2])
        assert torch.equal(attn2.w_uv_t, attn1.w_uv_t[:2])
        tokens = [o.token_ids for o in tp2.generate(requests, greedy(16))]
        logits = prompt_logits(tp2, requests)
    assert tokens == expected_tokens
    for a, b in zip(logits, expected_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
