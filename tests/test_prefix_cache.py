"""Prefix cache: block keys (images included), match/insert/evict/reset over the allocator's ref counts."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from eaglet.backends import torch_backend
from eaglet.engine.prefix_cache import PrefixCache, block_keys, image_content_hash, image_spans
from eaglet.multimodal.inputs import MultimodalInputs, expand_placeholders
from eaglet.runtime.kv_cache import BlockAllocator, KVCacheManager

BS = 4
IMG = 99  # placeholder id


def _image(seed: int, grid=(1, 4, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    return torch.randn(t * h * w, 3, 2, 2, generator=g), torch.tensor([grid])


def _held(alloc: BlockAllocator, n: int) -> list[int]:
    return alloc.allocate(n)


# ---------------------------------------------------------------- keys


def test_block_keys_full_blocks_only():
    assert block_keys([], BS) == []
    assert block_keys([1, 2, 3], BS) == []
    assert block_keys(list(range(9)), BS) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_block_keys_image_positions_across_block_boundary():
    h = b"img"
    ids = [1, 2, IMG, IMG, IMG, IMG, IMG, 3]  # image at [2, 7) straddles the block boundary at 4
    keys = block_keys(ids, BS, [(2, 7, h)])
    assert keys == [(1, 2, (h, 0), (h, 1)), ((h, 2), (h, 3), (h, 4), 3)]


def test_block_keys_same_image_shares_different_image_does_not():
    ids = [IMG] * 8
    a, b = image_content_hash(*_image(1)), image_content_hash(*_image(2))
    assert a != b and a == image_content_hash(*_image(1))
    assert block_keys(ids, BS, [(0, 8, a)]) == block_keys(ids, BS, [(0, 8, a)])
    assert block_keys(ids, BS, [(0, 8, a)])[0] != block_keys(ids, BS, [(0, 8, b)])[0]
    # Placeholder ids alone never match an image block.
    assert block_keys(ids, BS)[0] != block_keys(ids, BS, [(0, 8, a)])[0]
    # The same image at another offset in its block is a different key (its KV differs).
    assert block_keys([1] + ids[:7], BS, [(1, 8, a)])[0] != block_keys(ids, BS, [(0, 8, a)])[0]


def test_image_content_hash_covers_pixels_grid_and_dtype():
    px, grid = _image(1)
    base = image_content_hash(px, grid)
    px2 = px.clone()
    px2[0, 0, 0, 0] += 1e-3
    assert image_content_hash(px2, grid) != base
    assert image_content_hash(px, torch.tensor([[1, 2, 8]])) != base
    assert image_content_hash(px.double(), grid) != base


def test_block_keys_lookahead_keeps_last_token_out():
    ids = list(range(8))
    assert block_keys(ids, BS, lookahead=True) == [(0, 1, 2, 3, 4)]  # block 1 has no next token yet
    assert block_keys(ids + [8], BS, lookahead=True) == [(0, 1, 2, 3, 4), (4, 5, 6, 7, 8)]
    # Same block, different next token: different keys, so the draft's KV at the block's last
    # position (which read that next token) is never shared wrongly.
    assert block_keys([0, 1, 2, 3, 4], BS, lookahead=True) != block_keys([0, 1, 2, 3, 5], BS, lookahead=True)


def test_block_keys_rejects_span_outside_prompt():
    with pytest.raises(ValueError):
        block_keys([1, 2], BS, [(1, 3, b"x")])


def test_image_spans_from_multimodal_inputs():
    (pa, ga), (pb, gb) = _image(1, (1, 4, 4)), _image(2, (1, 4, 8))  # 4 and 8 placeholders (merge 2)
    ids, positions = expand_placeholders([5, IMG, IMG, 6], IMG, [4, 8])  # two adjacent images
    mm = MultimodalInputs(torch.cat([pa, pb]), torch.cat([ga, gb]), positions)
    spans = image_spans(mm)
    assert spans == [(1, 5, image_content_hash(pa, ga[0])), (5, 13, image_content_hash(pb, gb[0]))]
    assert ids[1:13] == [IMG] * 12


# ---------------------------------------------------------------- match / insert


def test_match_insert_refcounts_and_partial_prefix():
    alloc = BlockAllocator(10)
    cache = PrefixCache(alloc, BS)
    keys = block_keys(list(range(12)), BS)
    blocks = _held(alloc, 3)
    assert cache.match(keys) == []
    cache.insert(keys, blocks)
    assert cache.num_cached_blocks == 3 and [alloc.ref_counts[b] for b in blocks] == [2, 2, 2]
    alloc.decref(blocks)  # the publishing request finishes; the cache keeps the blocks
    assert [alloc.ref_counts[b] for b in blocks] == [1, 1, 1]

    other = block_keys(list(range(8)) + [0, 0, 0, 0], BS)  # diverges in block 2
    got = cache.match(other)
    assert got == blocks[:2] and [alloc.ref_counts[b] for b in blocks] == [2, 2, 1]
    assert cache.match(block_keys([7] * 8, BS)) == []
    assert cache.hit_tokens == 8 and cache.lookup_tokens == 12 + 12 + 8
    cache.match(keys[:1], num_tokens=6)
    assert cache.lookup_tokens == 12 + 12 + 8 + 6 and cache.hit_rate == pytest.approx(12 / 38)


def test_images_share_only_when_identical():
    alloc = BlockAllocator(10)
    cache = PrefixCache(alloc, BS)
    ids = [1] + [IMG] * 6 + [2, 3]
    a, b = image_content_hash(*_image(1)), image_content_hash(*_image(2))
    keys_a = block_keys(ids, BS, [(1, 7, a)])
    blocks = _held(alloc, 2)
    cache.insert(keys_a, blocks)
    assert cache.match(block_keys(ids, BS, [(1, 7, b)])) == []
    assert cache.match(block_keys(ids, BS)) == []
    assert cache.match(block_keys(ids, BS, [(1, 7, a)])) == blocks


def test_insert_keeps_existing_nodes_and_caller_keeps_its_duplicate():
    alloc = BlockAllocator(10)
    cache = PrefixCache(alloc, BS)
    keys = block_keys(list(range(8)), BS)
    first = _held(alloc, 2)
    cache.insert(keys, first)
    alloc.decref(first)  # the first request finished: only the cache holds its blocks
    dup = _held(alloc, 3)  # a second request computed the same two blocks itself, plus one more
    keys3 = block_keys(list(range(12)), BS)
    cache.insert(keys3, dup)
    # Its third block is not published below the cached copies it does not hold: it would keep
    # them from being evicted while the second request runs.
    assert cache.num_cached_blocks == 2
    assert [alloc.ref_counts[b] for b in dup] == [1, 1, 1]
    assert cache.match(keys3) == first
    alloc.decref(first)
    assert cache.num_evictable_blocks == 2
    before = alloc.num_free
    alloc.decref(dup)  # the caller's blocks go back to the pool on release
    assert alloc.num_free == before + 3


def test_insert_errors():
    alloc = BlockAllocator(10)
    cache = PrefixCache(alloc, BS)
    blocks = _held(alloc, 2)
    with pytest.raises(ValueError, match="keys for"):
        cache.insert(block_keys(list(range(8)), BS), blocks[:1])
    cache.insert(block_keys(list(range(4)), BS), blocks[:1])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(block_keys([9] * 4, BS), blocks[:1])
    with pytest.raises(RuntimeError, match="incref of free"):
        cache.insert(block_keys([9] * 4, BS), [5])  # a block the caller does not hold


# ---------------------------------------------------------------- evict / reset


def test_evict_lru_leaves_only_and_never_used_blocks():
    alloc = BlockAllocator(12)
    cache = PrefixCache(alloc, BS)
    # Tree: E alone, then A-B-C and A-D (A shared).
    a_b_c, a_d, e = [1] * 4 + [2] * 4 + [3] * 4, [1] * 4 + [4] * 4, [5] * 4
    blocks = {}
    for name, ids in [("e", e), ("abc", a_b_c), ("ad", a_d)]:
        keys = block_keys(ids, BS)
        got = cache.match(keys)
        new = _held(alloc, len(keys) - len(got))
        cache.insert(keys, got + new)
        alloc.decref(got + new)
        blocks[name] = got + new
    A, B, C = blocks["abc"]
    D, E = blocks["ad"][1], blocks["e"][0]
    assert cache.num_cached_blocks == 5 and cache.num_evictable_blocks == 5

    held = cache.match(block_keys(a_d, BS))  # a request now uses A and D; it is also the latest use
    assert held == [A, D] and cache.num_evictable_blocks == 3  # B, C, E
    alloc.decref(cache.match(block_keys(e, BS)))  # E, inserted first, is now used after C

    free0 = alloc.num_free
    assert cache.evict(1) == 1 and alloc.ref_counts[C] == 0 and alloc.ref_counts[B] == 1
    assert cache.evict(10) == 2  # B (now a leaf), then E; A and D are in use
    assert alloc.num_free == free0 + 3
    assert cache.num_cached_blocks == 2 and alloc.ref_counts[A] == 2 and alloc.ref_counts[D] == 2
    assert cache.evict(10) == 0
    alloc.decref(held)
    assert cache.evict(1) == 1 and alloc.ref_counts[D] == 0  # leaf first, never the parent A
    assert cache.evict(1) == 1 and cache.num_cached_blocks == 0


def test_reset_returns_every_block_with_kv_cache_manager():
    mgr = KVCacheManager(
        num_layers=1, kv_cache_dim=4, num_blocks=9, block_size=BS, max_requests=2, max_context_len=32,
        dtype=torch.float32, ops=torch_backend().cache,
    )
    alloc, free0 = mgr.allocator, mgr.num_free_blocks
    cache = PrefixCache(alloc, BS)
    row = mgr.alloc_row()
    ids = list(range(10))
    mgr.grow(row, len(ids))
    keys = block_keys(ids, BS)
    cache.insert(keys, mgr.row_blocks[row][: len(keys)])
    mgr.free_row(row)
    assert mgr.num_free_blocks == free0 - 2  # the two full blocks stay cached, the partial one is back
    still_used = cache.match(keys)
    cache.reset()
    assert cache.num_cached_blocks == 0 and cache.match(keys) == []
    assert mgr.num_free_blocks == free0 - 2  # the request's references outlive the reset
    alloc.decref(still_used)
    assert mgr.num_free_blocks == free0


def test_deep_tree_does_not_recurse():
    alloc = BlockAllocator(3002)
    cache = PrefixCache(alloc, 1)
    keys = block_keys(list(range(3000)), 1)
    blocks = alloc.allocate(3000)
    cache.insert(keys, blocks)
    alloc.decref(blocks)
    assert cache.num_evictable_blocks == 3000
    assert cache.evict(3000) == 3000 and alloc.num_free == 3001


# ---------------------------------------------------------------- property test


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests admit (match + allocate the rest), publish, release; the cache evicts under pressure.

    content[b] is the key path a block's KV was computed for; a request writes it when it allocates
    the block. A match must only return blocks whose content is exactly the query's prefix path.
    """

    NUM_BLOCKS = 14

    @initialize()
    def setup(self) -> None:
        self.alloc = BlockAllocator(self.NUM_BLOCKS)
        self.free0 = self.alloc.num_free
        self.cache = PrefixCache(self.alloc, BS)
        self.requests: dict[int, tuple[list[tuple], list[int]]] = {}
        self.content: dict[int, tuple | None] = {}
        self.next_id = 0

    def _used_by_requests(self) -> dict[int, int]:
        used: dict[int, int] = {}
        for _, blocks in self.requests.values():
            for b in blocks:
                used[b] = used.get(b, 0) + 1
        return used

    @rule(
        ids=st.lists(st.integers(1, 3), max_size=18),
        image=st.one_of(st.none(), st.tuples(st.integers(0, 10), st.integers(1, 8), st.sampled_from([b"A", b"B"]))),
    )
    def admit(self, ids: list[int], image) -> None:
        spans = []
        if image is not None and image[0] + image[1] <= len(ids):
            start, n, digest = image
            ids = ids[:start] + [IMG] * n + ids[start + n :]
            spans = [(start, start + n, digest)]
        keys = block_keys(ids, BS, spans)
        got = self.cache.match(keys)
        for i, b in enumerate(got):
            assert self.content[b] == tuple(keys[: i + 1]), "match returned a block of another prefix"
        need = -(-len(ids) // BS) - len(got)
        if need > self.alloc.num_free:
            self.cache.evict(need - self.alloc.num_free)
        if need > self.alloc.num_free:
            self.alloc.decref(got)  # not admitted
            return
        used = self._used_by_requests()
        new = self.alloc.allocate(need)
        assert not set(new) & set(used), "a block in use by a request was handed out again"
        assert not set(new) & set(self.cache._by_block), "a cached block was handed out again"
        for j, b in enumerate(new, start=len(got)):
            self.content[b] = tuple(keys[: j + 1]) if j < len(keys) else None  # None: partial block
        self.requests[self.next_id] = (keys, got + new)
        self.next_id += 1

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def publish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        keys, blocks = self.requests[rid]
        k = data.draw(st.integers(0, len(keys)))
        self.cache.insert(keys[:k], blocks[:k])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.alloc.decref(self.requests.pop(rid)[1])

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        used = self._used_by_requests()
        cached_before = self.cache.num_cached_blocks
        evictable = self.cache.num_evictable_blocks
        freed = self.cache.evict(n)
        assert freed == min(n, evictable)
        assert self.cache.num_cached_blocks == cached_before - freed
        assert all(self.alloc.ref_counts[b] >= used[b] for b in used)

    @invariant()
    def ref_counts_match_holders(self) -> None:
        if not hasattr(self, "alloc"):
            return
        used = self._used_by_requests()
        cached = set(self.cache._by_block)
        free = set(self.alloc._free)
        for b in range(1, self.NUM_BLOCKS):
            expected = used.get(b, 0) + (b in cached)
            assert self.alloc.ref_counts[b] == expected >= 0
            assert (b in free) == (expected == 0)
        assert self.alloc.ref_counts[0] == 0 and 0 not in free
        # Every cached block is reachable from the root (no orphan left behind by an eviction).
        reachable, stack = [], list(self.cache._root.children.values())
        while stack:
            node = stack.pop()
            reachable.append(node.block)
            stack.extend(node.children.values())
        assert sorted(reachable) == sorted(cached)

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for _, blocks in self.requests.values():
            self.alloc.decref(blocks)
        self.cache.reset()
        assert self.alloc.num_free == self.free0
        assert not any(self.alloc.ref_counts)


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_prefix_cache_property = PrefixCacheMachine.TestCase
