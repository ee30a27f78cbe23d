"""The CPU backend's decoder stack (eaglet/backends/cpu/decoder_stack.py) and the drafting on it
(eaglet/spec/stack_drafter.py) against the layer-by-layer path and the per-step drafting they replace.

Both run the same kernels, so every comparison is bit for bit: logits, captured residual streams
and the latents written to the cache, for ragged decode, chain verify and tree verify batches of
the target, and for every draft forward of speculative rounds (the MLA draft's midlayer).
"""

import itertools

import pytest
import torch

from eaglet import LLM, SamplingParams, kernels
from eaglet.backends.cpu.mla_attention import CpuMLAAttention
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.spec.stack_drafter import StackDrafter
from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint
from eaglet.testing.echo_checkpoints import echo_draft, echo_text_target
from eaglet.testing.quantized_checkpoints import write_fp8_checkpoint


def _has_tile_kernels() -> bool:
    return kernels.tile_backend() is not None


pytestmark = pytest.mark.skipif(not _has_tile_kernels(), reason="the decoder stack needs the kernels' tile GEMM")

CONFIGS = {
    "q-lora": {},
    "tile-projections": {"kv_lora_rank": 64, "v_head_dim": 64, "qk_nope_head_dim": 16},
    "no-q-lora-with-bias": {"q_lora_rank": None, "attention_bias": True},
    "dense-only": {"first_k_dense_replace": 3},
    # Quantized matrices in the stack: int4 routed experts beside tile copies; every matrix int4
    # against int8 activations; FP8 blocks (the checkpoint's decoder matrices, edges padded).
    "int4-experts": {},
    "int4-all-a8": {"q_lora_rank": 32, "kv_lora_rank": 32},
    "fp8": {},
}
QUANTIZATION = {
    "int4-experts": {"quantization": "int4"},
    "int4-all-a8": {"quantization": "int4", "quantized_layers": "all", "activation_quantization": "int8"},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def llm(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"stack-{request.param}")
    path = write_deepseek_v3_checkpoint(root / "bf16", CONFIGS[request.param], seed=3, dtype=torch.bfloat16)
    if request.param == "fp8":
        path = write_fp8_checkpoint(path, root / "fp8")
    return LLM(str(path), dtype="bfloat16", show_progress=False, cpu_kernels=True, **QUANTIZATION.get(request.param, {}))


def _decoder(llm: LLM):
    return llm.engine.model.model


def _batch(llm: LLM, prefix_lens: list[int], new_lens: list[int], custom_mask: torch.Tensor | None = None,
           capture_layers: tuple[int, ...] = (), mode: ForwardMode | None = None) -> ForwardBatch:
    """Requests with random latents cached for their prefixes, and random new tokens."""
    cache = llm.engine.cache
    g = torch.Generator().manual_seed(sum(prefix_lens) + len(new_lens))
    rows, slots = [], []
    for prefix, new in zip(prefix_lens, new_lens):
        row = cache.alloc_row()
        row_slots = cache.grow(row, prefix + new)
        kv = cache.target.kv
        kv[:, row_slots[:prefix]] = torch.randn(kv.shape[0], prefix, kv.shape[2], generator=g).to(kv.dtype)
        rows.append(row)
        slots.append(row_slots[prefix:])
    vocab = llm.engine.model.config.vocab_size
    if mode is None:
        mode = ForwardMode.DECODE if all(n == 1 for n in new_lens) and custom_mask is None else ForwardMode.VERIFY
    return ForwardBatch.build(input_ids=torch.randint(0, vocab, (sum(new_lens),), generator=g), req_pool_indices=rows,
                              extend_prefix_lens=prefix_lens, extend_seq_lens=new_lens, out_cache_loc=torch.cat(slots),
                              mode=mode, capture_layers=capture_layers, custom_mask=custom_mask)


def _both_paths(llm: LLM, batch: ForwardBatch):
    """(stack output, layer-by-layer output, cache after each), from the same starting cache."""
    model, decoder, cache = llm.engine.model, _decoder(llm), llm.engine.cache
    backend = CpuMLAAttention(cache)
    assert decoder.decoder_stack is not None
    before = cache.target.kv.clone()
    stack = decoder.decoder_stack
    with torch.inference_mode():
        fused = model(batch, backend)
        fused_kv = cache.target.kv.clone()
        cache.target.kv.copy_(before)
        decoder.decoder_stack = None
        try:
            layered = model(batch, backend)
        finally:
            decoder.decoder_stack = stack
    return fused, layered, fused_kv, cache.target.kv.clone()


def _free(llm: LLM, batch: ForwardBatch) -> None:
    for row in batch.req_pool_indices.tolist():
        llm.engine.cache.free_row(row)


def _assert_same(fused, layered, fused_kv, layered_kv) -> None:
    assert torch.equal(fused.logits, layered.logits)
    assert torch.equal(fused_kv, layered_kv)
    if layered.aux_hidden_states is None:
        assert fused.aux_hidden_states is None
    else:
        assert torch.equal(fused.aux_hidden_states, layered.aux_hidden_states)


def test_ragged_decode_matches_the_layer_path(llm):
    batch = _batch(llm, [5, 40, 17, 2], [1, 1, 1, 1], capture_layers=(2, 0))
    try:
        _assert_same(*_both_paths(llm, batch))
    finally:
        _free(llm, batch)


def test_profiler_sees_each_step_of_every_layer(llm):
    """The stack calls its kernels directly; its profiler ranges are what torch.profiler shows of a forward."""
    batch = _batch(llm, [5, 40], [1, 1])
    model, backend = llm.engine.model, CpuMLAAttention(llm.engine.cache)
    config = model.config
    try:
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(batch, backend)
    finally:
        _free(llm, batch)
    counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("eaglet.stack.")}
    layers = config.num_hidden_layers
    dense = min(config.first_k_dense_replace, layers)
    expected = {name: layers for name in ("down_proj", "q_proj", "rope_and_cache_write", "attention", "o_proj")}
    expected |= {"mlp": dense} if dense else {}
    if layers > dense:
        expected |= {"router": layers - dense, "routed_experts": layers - dense, "shared_experts": layers - dense}
    assert counts == {f"eaglet.stack.{name}": n for name, n in expected.items()}


def test_chain_verify_matches_the_layer_path(llm):
    batch = _batch(llm, [9, 30, 21], [4, 4, 4], capture_layers=(1,))
    try:
        _assert_same(*_both_paths(llm, batch))
    finally:
        _free(llm, batch)


def test_tree_verify_matches_the_layer_path(llm):
    prefix_lens, parents = [12, 25], [-1, 0, 0, 1, 2]
    tree = len(parents)
    masks = []
    for prefix in prefix_lens:
        mask = torch.zeros(tree, max(prefix_lens) + tree, dtype=torch.bool)
        for node in range(tree):
            mask[node, :prefix] = True
            ancestor = node
            while ancestor >= 0:
                mask[node, prefix + ancestor] = True
                ancestor = parents[ancestor]
        masks.append(mask)
    batch = _batch(llm, prefix_lens, [tree, tree], custom_mask=torch.cat(masks))
    try:
        _assert_same(*_both_paths(llm, batch))
    finally:
        _free(llm, batch)


@pytest.mark.parametrize("new_lens", [[1, 1, 1], [4, 4, 4]], ids=["decode", "chain-verify"])
def test_greedy_ids_forward_gives_the_argmax_of_the_logits_forward(llm, new_lens):
    """A forward asked only for greedy ids (the fused lm_head + argmax) returns no logits and, per
    logits row, the argmax of the logits the same forward returns otherwise (same cache); a quantized
    lm_head returns the logits."""
    batch = _batch(llm, [9, 30, 2], new_lens, capture_layers=(1,))
    batch.logits_indices = torch.arange(batch.num_tokens)
    backend, cache = CpuMLAAttention(llm.engine.cache), llm.engine.cache
    before = cache.target.kv.clone()
    try:
        with torch.inference_mode():
            full = llm.engine.model(batch, backend)
            cache.target.kv.copy_(before)
            batch.greedy_ids_only = True
            ids_only = llm.engine.model(batch, backend)
        assert full.greedy_ids is None
        if llm.engine.model.lm_head.quantized_weight is not None:
            # No fused argmax on a quantized lm_head: the forward returns the logits instead.
            assert ids_only.greedy_ids is None and torch.equal(ids_only.logits, full.logits)
        else:
            assert ids_only.logits is None and torch.equal(ids_only.greedy_ids, full.logits.argmax(-1))
        assert torch.equal(ids_only.aux_hidden_states, full.aux_hidden_states)
    finally:
        _free(llm, batch)


def test_ragged_prefill_matches_the_layer_path(llm):
    """Prefill chunks run on the stack too: a new prompt, and a prompt's second chunk after 5 cached tokens."""
    batch = _batch(llm, [0, 5], [6, 3], mode=ForwardMode.EXTEND, capture_layers=(1,))
    try:
        _assert_same(*_both_paths(llm, batch))
    finally:
        _free(llm, batch)


def test_autograd_takes_the_layer_path(llm):
    decoder, cache = _decoder(llm), llm.engine.cache
    backend = CpuMLAAttention(cache)
    decode = _batch(llm, [7], [1])
    try:
        hidden = torch.zeros(1, decoder.config.hidden_size, dtype=torch.bfloat16)
        cos, sin = decoder.rotary.cos_sin_as(decode.positions, hidden.dtype)
        with torch.enable_grad():
            assert decoder.decoder_stack.forward(hidden, cos, sin, decode, backend, []) is None
    finally:
        _free(llm, decode)


def test_greedy_generation_is_the_same_with_and_without_the_stack(llm):
    prompts = [{"prompt_token_ids": [3 + i, 9, 27, 4 + 2 * i][: 2 + i % 3]} for i in range(5)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    fused = [out.token_ids for out in llm.generate(prompts, params)]
    decoder = _decoder(llm)
    stack, decoder.decoder_stack = decoder.decoder_stack, None
    try:
        layered = [out.token_ids for out in llm.generate(prompts, params)]
    finally:
        decoder.decoder_stack = stack
    assert fused == layered


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle3-chain"])
def test_greedy_decoding_is_the_same_with_and_without_the_fused_greedy_ids(tmp_path, monkeypatch, speculative):
    """Greedy plain decode steps and verify rounds take the fused lm_head + argmax (no logits); the
    tokens are those of the logits path, and a request wanting logprobs in the batch still gets logits."""
    target = echo_text_target(tmp_path / "target", alpha=0.6, dtype=torch.bfloat16)
    spec = {}
    if speculative:
        spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(echo_draft(target, tmp_path / "draft", kind="mla")),
                    speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, speculative_adaptive=False)
    llm = LLM(str(target), dtype="bfloat16", show_progress=False, cpu_kernels=True, **spec)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 2 * i))} for i in range(3)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    with_logprobs = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    fused_rows = []
    lm_head = llm.engine.model.lm_head
    fused = lm_head.argmax

    def counted(x):
        ids = fused(x)
        fused_rows.append(0 if ids is None else ids.numel())
        return ids

    monkeypatch.setattr(lm_head, "argmax", counted)
    got = [out.token_ids for out in llm.generate(prompts, greedy)]
    assert len(fused_rows) >= (2 if speculative else 9) and all(fused_rows)  # every decode step or verify round
    fused_rows.clear()
    mixed = [out.token_ids for out in llm.generate(prompts, [greedy, with_logprobs, greedy])]
    assert not fused_rows  # logprobs need the logits: no step of that batch asks for ids only
    monkeypatch.setattr(lm_head, "argmax", lambda x: None)
    assert [out.token_ids for out in llm.generate(prompts, greedy)] == got == mixed


def test_no_stack_for_float32_or_without_kernels(tmp_path):
    path = write_deepseek_v3_checkpoint(tmp_path / "ckpt", seed=4, dtype=torch.bfloat16)
    assert _decoder(LLM(str(path), dtype="float32", show_progress=False)).decoder_stack is None
    assert _decoder(LLM(str(path), dtype="bfloat16", show_progress=False, cpu_kernels=False)).decoder_stack is None


def test_stack_rejects_a_hidden_state_of_the_wrong_width(llm):
    stack = _decoder(llm).decoder_stack.stack
    hidden_size = _decoder(llm).config.hidden_size
    bad = torch.zeros(1, hidden_size + 1, dtype=torch.bfloat16)
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="DecoderStack: bfloat16 hidden"):
        stack.forward(hidden=bad, cos=bad, sin=bad, kv=llm.engine.cache.target.kv, out_cache_loc=empty, slots=empty,
                      kv_lens=empty, token_starts=empty, custom_mask=None, capture_layers=[])


@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_draft_midlayer_matches_the_layer_path_in_every_round(tmp_path, monkeypatch, shape):
    """Each draft forward of real rounds (step batches, the extend after each verify, with the
    draft cache they really see) runs both ways from the same cache: the same logits, fed-back
    hidden and draft latents. (Top-1 extends in one call are the next test's; here they take
    Eagle3Draft.forward.)"""
    monkeypatch.setattr(StackDrafter, "extend", lambda self, *args, **kwargs: self.fallback.extend(*args, **kwargs))
    target = echo_text_target(tmp_path / "target", alpha=1.0, dtype=torch.bfloat16)
    draft_path = echo_draft(target, tmp_path / "draft", kind="mla")
    steps, topk, tokens = shape
    llm = LLM(str(target), dtype="bfloat16", show_progress=False, cpu_kernels=True, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=str(draft_path), speculative_num_steps=steps, speculative_eagle_topk=topk,
              speculative_num_draft_tokens=tokens, speculative_adaptive=False)
    worker = llm.engine.spec_worker
    draft = worker.draft
    assert draft.stack is not None
    layer_path = draft.forward
    fused_calls = []

    def both_paths(batch, backend, hidden, *, hidden_is_target_features):
        before = worker.pool.kv.clone()
        fused = layer_path(batch, backend, hidden, hidden_is_target_features=hidden_is_target_features)
        fused_kv = worker.pool.kv.clone()
        worker.pool.kv.copy_(before)
        stack, draft.stack = draft.stack, None
        try:
            layered = layer_path(batch, backend, hidden, hidden_is_target_features=hidden_is_target_features)
        finally:
            draft.stack = stack
        assert torch.equal(fused.logits, layered.logits)
        assert torch.equal(fused.hidden_out, layered.hidden_out)
        assert torch.equal(fused_kv, worker.pool.kv)
        fused_calls.append(max(batch.extend_prefix_lens_cpu) > 0)
        return fused

    draft.forward = both_paths
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 2 * i))} for i in range(3)]
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    assert all(len(out.token_ids) == 10 for out in outputs)
    assert any(fused_calls) and not all(fused_calls)  # extends after a verify, and prefill extends


@pytest.mark.parametrize("topk", [1, 2])
def test_draft_extend_in_one_call_matches_the_draft_forward(tmp_path, topk):
    """Every draft extend of real rounds (after each verify, and the catch-up over plain steps
    between rounds) runs both ways from the same cache: DecoderStack.extend_proposals, and
    Eagle3Draft.forward with the argmax (top-1) or the top-k log-probabilities of its logits. The
    same proposals, scores, fed-back hidden and draft latents in the requests' state rows (and no
    other row touched); prefill extends included. Output = plain decoding."""
    target = echo_text_target(tmp_path / "target", alpha=0.5, dtype=torch.bfloat16)
    draft_path = echo_draft(target, tmp_path / "draft", kind="mla")
    llm = LLM(str(target), dtype="bfloat16", show_progress=False, cpu_kernels=True, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=str(draft_path), speculative_num_steps=3, speculative_eagle_topk=topk,
              speculative_num_draft_tokens=4)
    worker = llm.engine.spec_worker
    draft, stack, states = worker.draft, worker.draft.stack, worker.states
    assert stack is not None and isinstance(worker.drafter, StackDrafter)
    one_call = stack.extend_proposals
    extends, gathered = [], []

    def both_ways(batch, backend, **named):
        assert named["state_tokens"] is states.topk_tokens and named["k"] == topk
        features, feature_rows, rows = named["features"], named["feature_rows"], named["state_rows"]
        kv_before = worker.pool.kv.clone()
        states_before = [t.clone() for t in (states.topk_tokens, states.topk_logprobs, states.hidden)]
        fused = one_call(batch, backend, **named)
        extends.append((fused, max(batch.extend_seq_lens_cpu)))
        gathered.append(feature_rows is not None)
        if not fused:
            return False
        fused_kv = worker.pool.kv.clone()
        worker.pool.kv.copy_(kv_before)
        if feature_rows is not None:  # a round's commit: the accepted nodes' rows of the verify features
            features = features[feature_rows]
        out = draft.forward(batch, backend, features, hidden_is_target_features=True)
        assert torch.equal(fused_kv, worker.pool.kv)
        expected = [t.clone() for t in states_before]
        if topk == 1:
            expected[0][rows, 0] = draft.greedy_target_ids(out.logits)
        else:
            logprobs, ids = draft.top_k_target_ids(out.logits, topk)
            expected[0][rows], expected[1][rows] = ids, logprobs.float()
        expected[2][rows] = out.hidden_out
        for got, want in zip((states.topk_tokens, states.topk_logprobs, states.hidden), expected):
            assert torch.equal(got, want)
        return True

    stack.extend_proposals = both_ways
    # Rounds of the configured shape, each after two plain steps: catch-ups of 2 tokens.
    levels = itertools.cycle([llm.engine.spec_policy.max_level, 0, 0])
    llm.engine.spec_policy.choose = lambda *args, **kwargs: next(levels)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 5 * i))} for i in range(3)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    got = [out.token_ids for out in llm.generate(prompts, params)]
    fused_lens = {n for fused, n in extends if fused}
    assert {2} <= fused_lens and max(fused_lens) > 2 and all(fused for fused, _ in extends)  # catch-ups, rounds, prefill
    assert any(gathered) and not all(gathered)  # rounds' commits gather their features in the call
    plain = LLM(str(target), dtype="bfloat16", show_progress=False, cpu_kernels=True)
    assert got == [out.token_ids for out in plain.generate(prompts, params)]


def test_draft_extend_in_one_call_rejects_bad_inputs(tmp_path):
    target = echo_text_target(tmp_path / "target", alpha=0.5, dtype=torch.bfloat16)
    draft_path = echo_draft(target, tmp_path / "draft", kind="mla")
    llm = LLM(str(target), dtype="bfloat16", show_progress=False, cpu_kernels=True, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=str(draft_path), speculative_num_steps=3, speculative_eagle_topk=2,
              speculative_num_draft_tokens=4)
    worker = llm.engine.spec_worker
    stack, states = worker.draft.stack.stack, worker.states
    ids, rows, table = torch.zeros(2, dtype=torch.long), torch.zeros(2, 4), torch.zeros(2, 2, 2)
    inputs = {"ids": ids, "features": rows, "feature_rows": None, "positions": ids, "rope_table": table, "logits_rows": ids,
              "k": 2, "state_rows": ids, "state_tokens": states.topk_tokens, "state_logprobs": states.topk_logprobs,
              "state_hidden": states.hidden, "kv": rows, "out_cache_loc": ids, "slots": rows, "kv_lens": ids,
              "token_starts": ids, "custom_mask": None}
    with torch.inference_mode():
        stack.set_draft_head(fc=rows, fc_out=4, embed=rows, norm_weight=rows[0], norm_eps=1e-6, lm_head=rows, vocab=4,
                             lm_head_bias=None, d2t=ids, norm_output=False)
        with pytest.raises(RuntimeError, match="extend_proposals: int64 ids"):
            stack.extend_proposals(**(inputs | {"ids": ids.float()}))
        with pytest.raises(RuntimeError, match="extend_proposals: contiguous state tables"):
            stack.extend_proposals(**(inputs | {"k": 3}))
        with pytest.raises(IndexError, match="out of range"):  # feature rows past the features
            stack.extend_proposals(**(inputs | {"feature_rows": torch.tensor([0, 5])}))


@pytest.mark.parametrize("steps,topk,draft_tokens", [(5, 1, 6), (4, 2, 8), (3, 4, 10), (1, 3, 3)])
def test_drafting_in_one_call_matches_the_per_step_forwards(tmp_path, steps, topk, draft_tokens):
    """A round's drafting in one DecoderStack call (draft_chain for top-1, draft_tree for EAGLE-2
    trees) against the same round drafted step by step through Eagle3Draft.forward (fused midlayer,
    then the layer path; tree candidates recorded and selected in Python), from the same cache, in
    every round of a ragged batch: the same tree (tokens, parents, depths) and the same draft
    latents written."""
    target = echo_text_target(tmp_path / "target", alpha=1.0 if topk == 1 else 0.3, dtype=torch.bfloat16)
    draft_path = echo_draft(target, tmp_path / "draft", kind="mla")
    llm = LLM(str(target), dtype="bfloat16", show_progress=False, cpu_kernels=True, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=str(draft_path), speculative_num_steps=steps, speculative_eagle_topk=topk,
              speculative_num_draft_tokens=draft_tokens, speculative_adaptive=False)
    worker = llm.engine.spec_worker
    draft, stack_drafter = worker.draft, worker.drafter
    assert isinstance(stack_drafter, StackDrafter)
    stack = draft.stack
    call = "draft_chain" if topk == 1 else "draft_tree"
    one_call = getattr(stack, call)
    calls = []

    def recorded(attention, **named):
        calls.append((attention, named))
        return one_call(attention, **named)

    setattr(stack, call, recorded)
    draft_round = worker._draft_tree

    def three_ways(requests, round_rows, *shape):
        before = worker.pool.kv.clone()
        results = []
        for mode in ("one call", "per step", "layer path"):
            worker.pool.kv.copy_(before)
            worker.drafter = stack_drafter if mode == "one call" else stack_drafter.fallback
            draft.stack = None if mode == "layer path" else stack
            try:
                results.append((draft_round(requests, round_rows, *shape), worker.pool.kv.clone()))
            finally:
                worker.drafter, draft.stack = stack_drafter, stack
        (tree, kv), *others = results
        assert tree.tokens.shape == (len(requests), draft_tokens if topk > 1 else steps + 1)
        for other_tree, other_kv in others:
            for name in ("tokens", "parents", "depths"):
                assert torch.equal(getattr(tree, name), getattr(other_tree, name)), name
            assert torch.equal(kv, other_kv)
        return tree

    worker._draft_tree = three_ways
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 5 * i))} for i in range(3)]
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True))
    assert all(len(out.token_ids) == 14 for out in outputs)
    assert calls  # every round's one-call drafting ran on the stack
    attention, named = calls[-1]
    before = worker.pool.kv.clone()
    if topk == 1:  # a token past the embeddings: a precise error before anything is written
        bad = {"state_tokens": torch.full_like(named["state_tokens"], 100_000)}
        with torch.inference_mode(), pytest.raises(RuntimeError, match="draft_chain: token id 100000 out of range"):
            one_call(attention, **(named | bad))
        with torch.inference_mode(), pytest.raises(RuntimeError, match=r"draft_chain: int64 final_ids \[B, S\]"):
            one_call(attention, **(named | {"final_ids": torch.zeros(len(named["state_rows"]) + 1, 2, dtype=torch.long)}))
        with torch.inference_mode(), pytest.raises(RuntimeError, match="draft_chain: req_to_token or rope_table too short"):
            one_call(attention, **(named | {"prefix": named["prefix"] + 10**6}))
        with torch.inference_mode(), pytest.raises(RuntimeError, match="draft_chain: a negative prefix"):
            one_call(attention, **(named | {"prefix": named["prefix"] - 10**6}))
        with torch.inference_mode(), pytest.raises(IndexError, match="out of range"):  # a state row past the tables
            one_call(attention, **(named | {"state_rows": named["state_rows"] + named["state_hidden"].shape[0]}))
    else:  # a top-k wider than the state tables, a prefix past the table: precise errors, nothing written
        with torch.inference_mode(), pytest.raises(RuntimeError, match=r"draft_tree: int64 state_tokens and float32 state_logprobs"):
            one_call(attention, **(named | {"k": named["state_tokens"].shape[1] + 1}))
        with torch.inference_mode(), pytest.raises(RuntimeError, match="draft_tree: req_to_token or rope_table too short"):
            one_call(attention, **(named | {"prefix": named["prefix"] + 10**6}))
        with torch.inference_mode(), pytest.raises(RuntimeError, match="draft_tree: a negative prefix"):
            one_call(attention, **(named | {"prefix": named["prefix"] - 10**6}))
    assert torch.equal(before, worker.pool.kv)
