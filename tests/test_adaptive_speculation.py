"""Adaptive speculation: the policy's choices from measured costs, and exactness of the engine
when it switches between plain steps, shallower drafts and the configured shape."""

import itertools

import pytest
import torch
from runtime_utils import greedy
from eaglet.testing.images import make_image
from eaglet.testing.echo_checkpoints import IMAGE_TOKEN, echo_draft, echo_kimi_target

from eaglet import LLM, SamplingParams
from eaglet.engine.engine import Engine
from eaglet.spec.config import SpeculativeConfig
from eaglet.spec.policy import SpeculationPolicy

# ---- the policy ------------------------------------------------------------------------------


def chain_policy(**kwargs) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculativeConfig("draft", num_steps=3, eagle_topk=1, num_draft_tokens=4), **kwargs)


def run_policy(policy: SpeculationPolicy, batch_size: int, cost, accepted, steps: int = 200) -> list[int]:
    """Drives the policy with a cost model cost(level) in seconds and accepted(level) drafts per request."""
    chosen = []
    for _ in range(steps):
        level = policy.choose(batch_size)
        chosen.append(level)
        num_accepted = None if level == 0 else [accepted(level)] * batch_size
        policy.record(batch_size, level, cost(level), num_accepted)
    return chosen


def test_policy_keeps_speculating_when_it_pays():
    policy = chain_policy()
    chosen = run_policy(policy, 1, cost=lambda level: 0.010 + 0.002 * level, accepted=lambda level: level)
    # Plain decoding and the configured depth are measured twice; depths 1 and 2, estimated
    # between them, look worse and are not run until a probe (4 steps later).
    assert chosen[:8] == [3, 3, 0, 0] + [3] * 4
    tail = chosen[50:]
    assert tail.count(3) > 0.9 * len(tail)
    assert policy.as_dict()["best_level_per_batch_bucket"] == {1: "3"}


def test_a_deep_configuration_finds_its_best_depth_without_trying_every_depth():
    policy = SpeculationPolicy(SpeculativeConfig("draft", num_steps=15, eagle_topk=1, num_draft_tokens=16))
    # The draft is right for 7 tokens; each draft step costs 3 ms, a round 2 ms more than plain.
    chosen = run_policy(
        policy, 1, cost=lambda level: 0.010 if level == 0 else 0.012 + 0.003 * level,
        accepted=lambda level: min(level, 7), steps=64,
    )
    assert chosen[:10] == [15, 15, 0, 0] + [7] * 6  # the anchors, then the best depth at once
    # Afterwards only the probes leave it, one step each (none makes its level look best), 4, 8
    # then 16 steps apart: the deeper neighbour of 7, another depth, the shallower neighbour.
    assert [(i, level) for i, level in enumerate(chosen) if i >= 4 and level != 7] == [(10, 8), (18, 1), (34, 6)]
    assert policy.as_dict()["best_level_per_batch_bucket"] == {1: "7"}


def test_a_chain_that_stopped_early_books_its_acceptance_but_not_its_time():
    """A round whose every request drafted its end before the level's depth (the chain stopped
    there) says nothing of that depth's cost, nor of the positions it never drafted."""
    policy = chain_policy()
    policy.record(1, 3, 0.010, [3], num_drafted=3)
    assert len(policy.buckets[1].seconds[3]) == 1
    assert policy.depth_rounds[0][:3] == [1, 1, 1] and policy.depth_accepts[0][:3] == [1, 1, 1]
    policy.record(1, 3, 0.004, [1], num_drafted=1)  # drafted 1 token (its end), accepted it
    assert len(policy.buckets[1].seconds[3]) == 1
    assert policy.depth_rounds[0][:3] == [2, 1, 1] and policy.depth_accepts[0][:3] == [2, 1, 1]
    assert policy.steps_per_level[3] == 2


def test_policy_turns_speculation_off_when_a_round_costs_more_than_it_accepts():
    policy = chain_policy()
    # A verify round costs 4x a plain step but accepts only one draft token in three.
    chosen = run_policy(policy, 16, cost=lambda level: 0.010 * (1 if level == 0 else 4), accepted=lambda level: 0)
    tail = chosen[50:]
    assert tail.count(0) > 0.9 * len(tail)
    # Every round rejected the first draft: depth 1's rate is its prior of one accepted round in
    # (rounds + 1), so the expected tokens approach 1 as rounds are counted.
    assert policy.expected_tokens(3) == pytest.approx(1.0, abs=0.05)


def test_policy_lowers_the_draft_depth_when_deep_drafts_are_rejected():
    policy = chain_policy()
    # Only the first draft position is ever accepted; each draft step costs time.
    chosen = run_policy(policy, 4, cost=lambda level: 0.010 + 0.004 * level, accepted=lambda level: min(level, 1))
    tail = chosen[50:]
    assert max(set(tail), key=tail.count) == 1
    assert policy.expected_tokens(1) == pytest.approx(2.0, abs=0.05)
    assert policy.expected_tokens(3) == pytest.approx(2.0, abs=0.1)  # depth 2 is rejected; its prior fades


def test_policy_recovers_from_a_bad_first_measurement_and_keeps_buckets_apart():
    policy = chain_policy(probe_interval=8)
    slow_start = iter([0.5, 0.5])  # the configured depth's first two rounds were slow (warm-up)

    def cost(level):
        return next(slow_start, 0.016) if level == 3 else 0.010 + 0.002 * level

    chosen = run_policy(policy, 2, cost=cost, accepted=lambda level: level, steps=200)
    assert chosen[4:36] == [0] * 32  # the configured depth looked worst: plain, probed after 4 x 8 steps
    assert (chosen[36], chosen[46]) == (1, 2)  # probes of the best level's neighbour climb back up
    tail = chosen[150:]
    assert tail.count(3) > 0.8 * len(tail)  # probing found the configured depth pays after all
    run_policy(policy, 64, cost=lambda level: 0.010 * (1 if level == 0 else 6), accepted=lambda level: 0)
    assert policy.as_dict()["best_level_per_batch_bucket"] == {2: "3", 64: "off"}


def test_plain_decoding_is_re_measured_soon_after_two_slow_first_steps():
    """Plain decoding is among the neighbours a bucket probes: two slow first plain steps (a busy
    machine) made the configured depth look best, and the third probe, 28 steps in, finds plain
    decoding faster; it is measured a second time and kept."""
    policy = chain_policy(probe_interval=4)
    slow_plain = iter([0.030, 0.030])

    def cost(level):  # every draft accepted, but a round costs 5 plain steps: plain decoding is best
        return next(slow_plain, 0.010) if level == 0 else 0.050 + 0.001 * level

    chosen = run_policy(policy, 8, cost=cost, accepted=lambda level: level, steps=60)
    assert chosen[:4] == [3, 3, 0, 0] and chosen[4] == 3
    first_plain = chosen.index(0, 4)
    assert first_plain <= 32 and chosen[first_plain:first_plain + 2] == [0, 0]
    assert chosen[40:].count(0) >= 18


def test_a_new_bucket_starts_from_its_learned_neighbour():
    policy = chain_policy()
    run_policy(policy, 1, cost=lambda level: 0.010 + 0.002 * level, accepted=lambda level: level, steps=20)
    # Batch 2: twice the per-step cost, same ordering. It measures only the neighbour's best depth
    # and plain decoding, then runs the best depth (depths 1 and 2 only when probed).
    chosen = run_policy(policy, 2, cost=lambda level: 0.020 + 0.004 * level, accepted=lambda level: level, steps=15)
    assert chosen[:4] == [3, 3, 0, 0]
    assert chosen[4:15] == [3, 3, 3, 3, 2, 3, 3, 3, 3, 3, 3]  # one probe, of depth 2, one step
    # A bucket where speculation does not pay: the same two measurements switch it off at once.
    chosen = run_policy(policy, 64, cost=lambda level: 0.010 * (1 if level == 0 else 6), accepted=lambda level: 0, steps=15)
    assert chosen[:4] == [3, 3, 0, 0]
    assert chosen[4:15] == [0] * 11


def test_estimates_borrowed_from_a_neighbour_are_corrected_by_probes():
    policy = chain_policy(probe_interval=4)
    run_policy(policy, 1, cost=lambda level: 0.010 + 0.002 * level, accepted=lambda level: 1, steps=20)
    assert policy.as_dict()["best_level_per_batch_bucket"] == {1: "1"}
    # At batch 8 depth 2 is cheap (the neighbour says otherwise): probing measures it and keeps it.
    costs = {0: 0.010, 1: 0.016, 2: 0.011, 3: 0.030}
    chosen = run_policy(policy, 8, cost=costs.__getitem__, accepted=lambda level: min(level, 1) + (level >= 2), steps=120)
    tail = chosen[80:]
    assert max(set(tail), key=tail.count) == 2


def test_the_depth_is_capped_by_the_tokens_a_request_may_still_make():
    policy = chain_policy()
    run_policy(policy, 4, cost=lambda level: 0.010 + 0.002 * level, accepted=lambda level: level, steps=10)
    assert policy.choose(4) == 3
    assert policy.choose(4, useful_level=2) == 2  # depth 2 is the best of the depths that can pay
    assert policy.choose(4, useful_level=0) == 0  # every request has one token left: the bonus
    assert chain_policy(adaptive=False).choose(4, useful_level=0) == 3  # a fixed shape stays fixed


def test_pinned_or_fixed_policy_keeps_the_configured_shape():
    policy = chain_policy()
    assert all(policy.choose(8, pinned=True) == 3 for _ in range(10))
    fixed = chain_policy(adaptive=False)
    assert all(fixed.choose(8) == 3 for _ in range(10))


def test_draft_tokens_per_level_scale_the_tree_with_the_depth():
    tree = SpeculationPolicy(SpeculativeConfig("draft", num_steps=5, eagle_topk=4, num_draft_tokens=16))
    assert [tree.draft_tokens(level) for level in range(1, 6)] == [5, 9, 13, 16, 16]
    assert [chain_policy().draft_tokens(level) for level in range(1, 4)] == [2, 3, 4]
    # A tree configuration's levels past num_steps are top-1 chains of depth 1 .. num_steps.
    assert tree.num_levels == 11 and chain_policy().num_levels == 4
    assert [tree.shape(level) for level in (5, 6, 10)] == [(5, 4, 16), (1, 1, 2), (5, 1, 6)]
    assert [tree.level_name(level) for level in (0, 2, 7)] == ["off", "tree 2", "chain 2"]
    # Chains never verify more tokens than the configured tree.
    short = SpeculationPolicy(SpeculativeConfig("draft", num_steps=4, eagle_topk=2, num_draft_tokens=3))
    assert [short.shape(level) for level in range(5, short.num_levels)] == [(1, 1, 2), (2, 1, 3)]


def tree_policy(**kwargs) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculativeConfig("draft", num_steps=4, eagle_topk=2, num_draft_tokens=8), **kwargs)


def test_a_tree_configuration_drafts_chains_where_the_tree_costs_more_than_it_gains():
    policy = tree_policy()
    # Both families accept every draft; a tree step costs three times a chain step (large batch).
    def cost(level):
        per_step = 0.006 if policy.topk(level) > 1 else 0.002
        return 0.010 + per_step * policy.depth(level)

    chosen = run_policy(policy, 64, cost=cost, accepted=policy.depth)
    assert chosen[:6] == [4, 4, 0, 0, 8, 8]  # the anchors: the configured tree, plain, the chain as deep
    tail = chosen[50:]
    assert tail.count(8) > 0.8 * len(tail)
    assert policy.as_dict()["best_level_per_batch_bucket"] == {64: "chain 4"}
    assert policy.as_dict()["decode_steps_per_level"]["chain 4"] == chosen.count(8)


def test_a_tree_configuration_keeps_the_tree_where_its_acceptance_pays():
    policy = tree_policy()
    # Equal costs, but the chain's first draft is always rejected while the tree accepts them all.
    chosen = run_policy(
        policy, 4, cost=lambda level: 0.010 + 0.002 * policy.depth(level),
        accepted=lambda level: policy.depth(level) if policy.topk(level) > 1 else 0,
    )
    tail = chosen[50:]
    assert tail.count(4) > 0.8 * len(tail)
    assert policy.expected_tokens(5) == pytest.approx(1.0, abs=0.1)  # the chain family keeps its own acceptance
    assert policy.expected_tokens(4) == pytest.approx(5.0, abs=0.01)


# ---- the engine switching levels ---------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = echo_kimi_target(tmp_path_factory.mktemp("target"), alpha=1.0)
    draft = echo_draft(target, tmp_path_factory.mktemp("draft"), kind="mla", seed=3)
    return target, draft


def spec_llm(models, **kwargs) -> LLM:
    target, draft = models
    return LLM(
        str(target), dtype="float32", show_progress=False, speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(draft), speculative_num_steps=3, speculative_eagle_topk=2,
        speculative_num_draft_tokens=5, block_size=4, **kwargs,
    )


def prompts():
    return [
        {"prompt_token_ids": [3, 4, IMAGE_TOKEN, 9, 10, 11], "images": [make_image(40, 28, 0)]},
        {"prompt_token_ids": list(range(20, 45))},
        {"prompt_token_ids": [7, 8, 9]},
    ]


def force_levels(engine: Engine, levels) -> None:
    """Replaces the policy's decisions by a fixed sequence (its bookkeeping still runs)."""
    sequence = itertools.cycle(levels)
    engine.spec_policy.choose = lambda batch_size, pinned=False, useful_level=None: next(sequence)


def run_until(engine: Engine, arrivals: dict[int, list[dict]], num_output: int) -> dict[str, list[torch.Tensor]]:
    """Steps the engine, adding arrivals[step] at that step, until every request has num_output
    tokens; returns per request the draft cache entries of its positions whose draft entry is written."""
    ids = []
    for step in itertools.count():
        for prompt in arrivals.get(step, []):
            ids.append(engine.add_request(prompt, greedy(200)))
        engine.step()
        if len(ids) == sum(len(v) for v in arrivals.values()) and all(
            len(engine.requests[i].output_token_ids) >= num_output for i in ids
        ):
            break
    pool = engine.spec_worker.pool.kv
    entries = {}
    for i in ids:
        req = engine.requests[i]
        written = req.num_cached_tokens - len(req.draft_pending_features)
        slots = engine.cache.req_to_token[req.req_pool_idx, :written]
        entries[i] = (list(req.output_token_ids), pool[:, slots].clone())
    for i in ids:
        engine.abort(i)
    return entries


def test_switching_levels_gives_plain_output_and_the_all_speculative_draft_cache(models):
    plain = LLM(str(models[0]), dtype="float32", show_progress=False)
    expected = [o.token_ids for o in plain.generate(prompts(), greedy(24))]
    fixed = spec_llm(models, speculative_adaptive=False)
    switching = spec_llm(models)
    # Levels 4 .. 6 draft chains of depth 1 .. 3 in this top-2 tree configuration.
    force_levels(switching.engine, [0, 0, 2, 0, 3, 6, 1, 0, 4, 0, 0, 3, 5, 5])
    for llm in (fixed, switching):
        outputs = llm.generate(prompts(), greedy(24))
        assert [o.token_ids for o in outputs] == expected
        assert llm.engine.num_free_blocks() == llm.engine.cache.allocator.num_usable
    metrics = switching.spec_metrics()
    assert metrics["num_plain_decode_steps"] > 0 and metrics["num_verify_steps"] > 0

    # Staggered arrivals give the requests different lags when speculation resumes.
    arrivals = {0: prompts()[:2], 3: prompts()[2:]}
    reference = run_until(fixed.engine, arrivals, 20)
    got = run_until(switching.engine, arrivals, 20)
    for (ref_tokens, ref_cache), (tokens, cache) in zip(reference.values(), got.values()):
        n = min(len(ref_tokens), len(tokens))
        assert ref_tokens[:n] == tokens[:n]
        written = min(ref_cache.shape[1], cache.shape[1])
        assert written > 20
        torch.testing.assert_close(cache[:, :written], ref_cache[:, :written], atol=1e-4, rtol=1e-4)
    assert switching.engine.num_free_blocks() == switching.engine.cache.allocator.num_usable


def test_a_request_with_one_token_left_decodes_it_without_drafting(models):
    llm = spec_llm(models)
    plain = LLM(str(models[0]), dtype="float32", show_progress=False)
    expected = [o.token_ids for o in plain.generate(prompts(), greedy(2))]
    assert [o.token_ids for o in llm.generate(prompts(), greedy(2))] == expected
    assert llm.spec_metrics()["num_verify_steps"] == 0
    assert llm.engine.spec_policy.steps_per_level[0] == 1  # the prefill made token 1, a plain step token 2


def test_blocks_whose_draft_entries_are_pending_are_not_shared(models):
    llm = spec_llm(models)
    engine = llm.engine
    force_levels(engine, [0])
    request_id = engine.add_request({"prompt_token_ids": list(range(20, 31))}, greedy(40))
    req = engine.requests[request_id]
    engine.step()  # the prefill
    for _ in range(12):
        engine.step()
        assert len(req.draft_pending_features) > 0
        published = req.num_published_blocks * engine.cache.block_size
        assert published <= req.num_cached_tokens - len(req.draft_pending_features)
    engine.abort(request_id)
    assert engine.num_free_blocks() == engine.cache.allocator.num_usable


def test_seeded_sampling_pins_the_configured_shape(models):
    llm = spec_llm(models)
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, seed=7 + i) for i in range(3)]
    first = [o.token_ids for o in llm.generate(prompts(), params)]
    assert llm.engine.spec_policy.steps_per_level[:3] == [0, 0, 0]
    again = [o.token_ids for o in llm.generate(prompts(), params)]
    assert first == again
