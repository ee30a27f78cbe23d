"""Paged latent cache: allocator bookkeeping, cached decode == recompute, absorbed == decompressed."""

import pytest
import torch
from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint
from runtime_utils import greedy, prompt_logits

from eaglet import LLM
from eaglet.backends import Backend, torch_backend
from eaglet.backends.pytorch.mla_attention import TorchMLAAttention
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.runtime.kv_cache import BlockAllocator, KVCacheManager, LatentKVPool, OutOfCacheBlocks

TORCH_CACHE_OPS = torch_backend().cache


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds")
    write_deepseek_v3_checkpoint(path, {"q_lora_rank": None}, seed=3)
    return LLM(str(path), dtype="float32", show_progress=False, block_size=4)


def test_allocator_refcounts_and_double_free():
    alloc = BlockAllocator(6)
    assert alloc.num_free == 5  # block 0 is reserved
    blocks = alloc.allocate(3)
    assert 0 not in blocks and alloc.num_free == 2
    alloc.incref(blocks[:1])
    alloc.decref(blocks)
    assert alloc.num_free == 4  # the shared block still has a reference
    alloc.decref(blocks[:1])
    assert alloc.num_free == 5
    with pytest.raises(RuntimeError, match="double free"):
        alloc.decref(blocks[:1])
    with pytest.raises(OutOfCacheBlocks):
        alloc.allocate(6)


def test_grow_truncate_free_row_slots():
    cache = KVCacheManager(
        num_layers=1, kv_cache_dim=4, num_blocks=5, block_size=4, max_requests=2, max_context_len=16, dtype=torch.float32,
        ops=TORCH_CACHE_OPS,
    )
    row = cache.alloc_row()
    first = cache.grow(row, 6)
    second = cache.grow(row, 9)
    assert len(set(first.tolist() + second.tolist())) == 9
    assert cache.num_free_blocks == 1
    assert cache.req_to_token[row, :9].tolist() == first.tolist() + second.tolist()
    cache.truncate(row, 5)
    # Positions 5 .. 7 are still in the row's second block (its own slots); the freed third block's are cleared.
    assert cache.num_free_blocks == 2 and cache.row_len[row] == 5
    assert cache.req_to_token[row, :8].tolist() == (first.tolist() + second.tolist())[:8]
    assert cache.req_to_token[row, 8:].sum() == 0
    cache.free_row(row)
    assert cache.num_free_blocks == 4 and cache.req_to_token.sum() == 0
    with pytest.raises(OutOfCacheBlocks):
        cache.grow(cache.alloc_row(), 17)


def assert_table_covers_blocks(cache: KVCacheManager) -> None:
    """Each row's table entries are the slots of its blocks' positions, and 0 past them."""
    size, width = cache.block_size, cache.max_context_len
    for row in range(cache.req_to_token.shape[0]):
        blocks = cache.row_blocks.get(row, [])
        expected = [b * size + i for b in blocks for i in range(size)][:width]
        assert cache.req_to_token[row].tolist() == expected + [0] * (width - len(expected))


def test_the_table_is_written_a_block_at_a_time(backend: Backend):
    """New blocks' table entries (each backend's write_block_entries), against the blocks the rows
    hold, over random growth and cuts."""
    cache = KVCacheManager(
        num_layers=1, kv_cache_dim=4, num_blocks=30, block_size=4, max_requests=3, max_context_len=18, dtype=torch.float32,
        ops=backend.cache,
    )
    g = torch.Generator().manual_seed(0)
    rows = [cache.alloc_row() for _ in range(3)]
    for _ in range(200):
        row = rows[int(torch.randint(0, 3, (1,), generator=g))]
        length = int(torch.randint(0, 19, (1,), generator=g))  # 18: the last block sticks out of the table
        if length >= cache.row_len[row]:
            new = cache.grow(row, length)
            assert new.tolist() == cache.req_to_token[row, length - len(new) : length].tolist()
        else:
            cache.truncate(row, length)
        assert_table_covers_blocks(cache)
        if int(torch.randint(0, 20, (1,), generator=g)) == 0:
            cache.free_row(row)
            assert cache.alloc_row() == row
    # Out of blocks part way through: rows keep the blocks they got (in the table) and their lengths.
    for row in rows:
        cache.truncate(row, 1)
    hog = cache.allocator.allocate(cache.num_free_blocks - 5)  # room for the first row only
    lengths = dict(cache.row_len)
    with pytest.raises(OutOfCacheBlocks):
        cache.grow_rows(rows, [18, 18, 18])
    assert cache.row_len == lengths and len(cache.row_blocks[rows[0]]) == 5
    assert_table_covers_blocks(cache)
    cache.allocator.decref(hog)
    cache.free_row(rows[0])
    adopted = cache.allocator.allocate(2)  # as a prefix-cache hit hands them over
    cache.adopt_blocks(cache.alloc_row(), adopted, 8)
    assert_table_covers_blocks(cache)
    if backend.kernels:  # a block outside the table: a precise error, nothing written
        before = cache.req_to_token.clone()
        for bad, message in (([1, 5, 3], "block 3 at index 5 of row 1"), ([3, 0, 3], "block 3 at index 0 of row 3"),
                             ([-1, 0, 3], "block 3 at index 0 of row -1"), ([1, 0, -2], "block -2 at index 0 of row 1")):
            with pytest.raises(RuntimeError, match=f"write_block_entries: {message} outside the table"):
                torch.ops.eaglet.write_block_entries(cache.req_to_token, torch.tensor([[0, 0, 2], bad]), cache.block_size)
        assert torch.equal(before, cache.req_to_token)


def _three_row_cache(backend: Backend | None = None) -> KVCacheManager:
    return KVCacheManager(num_layers=1, kv_cache_dim=4, num_blocks=40, block_size=4, max_requests=3,
                          max_context_len=32, dtype=torch.float32, ops=(backend or torch_backend()).cache)


def test_growing_and_truncating_several_rows_at_once_equals_doing_each():
    one_by_one, at_once = _three_row_cache(), _three_row_cache()
    rows = [one_by_one.alloc_row() for _ in range(3)]
    assert [at_once.alloc_row() for _ in range(3)] == rows
    for c in (one_by_one, at_once):  # ragged starting lengths, one row still empty
        c.grow(rows[0], 3)
        c.grow(rows[2], 7)
    for grown in ([9, 5, 7], [15, 13, 16]):  # partly filled blocks, new blocks, rows that stay
        expected = torch.cat([one_by_one.grow(row, new) for row, new in zip(rows, grown)])
        assert torch.equal(at_once.grow_rows(rows, grown), expected)
        assert torch.equal(at_once.req_to_token, one_by_one.req_to_token)
        assert at_once.row_blocks == one_by_one.row_blocks and at_once.row_len == one_by_one.row_len
    for shorter in ([10, 13, 3], [10, 2, 0]):  # keeps, drops and empties blocks; one row unchanged
        for row, new in zip(rows, shorter):
            one_by_one.truncate(row, new)
        at_once.truncate_rows(rows, shorter)
        assert torch.equal(at_once.req_to_token, one_by_one.req_to_token)
        assert at_once.row_blocks == one_by_one.row_blocks and at_once.row_len == one_by_one.row_len
        assert at_once.num_free_blocks == one_by_one.num_free_blocks
        assert_table_covers_blocks(at_once)
    with pytest.raises(ValueError):
        at_once.grow_rows(rows, [9, 3, 0])  # row 0 would shrink
    with pytest.raises(OutOfCacheBlocks):
        at_once.grow_rows(rows, [16, 16, 33])


def test_prefill_plus_decode_equals_full_recompute(llm):
    """Greedy generation through the cache vs one full forward over prompt + generated tokens."""
    prompt = [5, 9, 200, 31, 8, 8, 14]
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(12))[0]
    full = prompt + out.token_ids
    recomputed = prompt_logits(llm, [{"prompt_token_ids": full}])[0]
    # The token chosen after each prefix must be the argmax of the recomputed logits there.
    assert recomputed[len(prompt) - 1 : -1].argmax(-1).tolist() == out.token_ids

    # And the logits of each decode step equal the recompute at that position.
    chunked = prompt_logits(llm, [{"prompt_token_ids": full}], chunk=1)[0]
    torch.testing.assert_close(chunked, recomputed, atol=1e-5, rtol=0)
    assert llm.engine.num_free_blocks() == llm.engine.cache.allocator.num_usable


def test_decode_steps_in_absorbed_form_match_decompressed(llm):
    engine = llm.engine
    cache = engine.cache
    prompts = [[4, 8, 15, 16, 23, 42, 7], [1, 2, 3], list(range(30, 60))]
    rows = [cache.alloc_row() for _ in prompts]
    try:
        with torch.inference_mode():
            slots = [cache.grow(r, len(p)) for r, p in zip(rows, prompts)]
            prefill = ForwardBatch.build(
                input_ids=sum(prompts, []),
                req_pool_indices=rows,
                extend_prefix_lens=[0] * 3,
                extend_seq_lens=[len(p) for p in prompts],
                out_cache_loc=torch.cat(slots),
            )
            engine.model(prefill, engine.runner.attention)
            next_ids = [11, 12, 13]
            decode_slots = torch.cat([cache.grow(r, len(p) + 1) for r, p in zip(rows, prompts)])
            kwargs = dict(
                input_ids=next_ids,
                req_pool_indices=rows,
                extend_prefix_lens=[len(p) for p in prompts],
                extend_seq_lens=[1, 1, 1],
                out_cache_loc=decode_slots,
            )
            absorbed = engine.model(ForwardBatch.build(**kwargs), TorchMLAAttention(cache)).logits
            decompressed = engine.model(ForwardBatch.build(mode=ForwardMode.EXTEND, **kwargs), engine.runner.attention).logits
            # A multi-token extend in the absorbed form too (the path speculative verify uses).
            forced = TorchMLAAttention(cache, absorbed_extend=True)
            for r, p in zip(rows, prompts):
                cache.truncate(r, 0)
            slots = [cache.grow(r, len(p)) for r, p in zip(rows, prompts)]
            prefill.out_cache_loc = torch.cat(slots)
            absorbed_prefill = engine.model(prefill, forced).logits
            decompressed_prefill = engine.model(prefill, engine.runner.attention).logits
    finally:
        for r in rows:
            cache.free_row(r)
    assert ForwardBatch.build(**kwargs).mode == ForwardMode.DECODE
    torch.testing.assert_close(absorbed, decompressed, atol=1e-5, rtol=0)
    torch.testing.assert_close(absorbed_prefill, decompressed_prefill, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def mla_llm(tmp_path_factory):
    """One layer with DeepSeek-V3's per-head attention sizes (nope 64 / rope 64 / v 64, latent 512)
    and the 72M bench model's 8 heads: the shapes whose float32 products the row padding is for."""
    path = tmp_path_factory.mktemp("mla")
    config = {"q_lora_rank": None, "num_hidden_layers": 1, "hidden_size": 256, "num_attention_heads": 8,
              "num_key_value_heads": 8, "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
              "v_head_dim": 64}
    write_deepseek_v3_checkpoint(path, config, seed=5)
    return LLM(str(path), dtype="float32", show_progress=False, block_size=4)


@pytest.mark.parametrize("num_new", [2, 4, 8])
def test_absorbed_attention_gives_a_token_the_same_bits_whatever_the_tokens_beside_it(mla_llm, num_new, backend: Backend):
    """The first of ``num_new`` verified tokens of each request equals the same token decoded alone,
    bit for bit, in float32: greedy speculation needs the verify pass to reproduce plain decoding,
    and MKL rounds one row of a product differently from several (backends/pytorch/gemm_rows.py, MIN_BMM_ROWS).
    The padding is measured for these sizes: for other shapes MKL's kernel choice can still depend
    on the row count (noted in the README)."""
    engine = mla_llm.engine
    cache = engine.cache
    layer = engine.model.model.layers[0].self_attn
    attention = backend.mla_attention(cache, None)
    prefix_lens = [21, 40, 17]
    rows = [cache.alloc_row() for _ in prefix_lens]
    g = torch.Generator().manual_seed(num_new)
    heads, latent, rope = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim

    def attend(num_tokens_each: int, first: dict[str, torch.Tensor]) -> torch.Tensor:
        total = num_tokens_each * len(rows)
        inputs = {
            "q_nope": torch.randn(total, heads, layer.qk_nope_head_dim, generator=g),
            "q_pe": torch.randn(total, heads, rope, generator=g),
            "c_kv": torch.randn(total, latent, generator=g),
            "k_pe": torch.randn(total, rope, generator=g),
        }
        for name, value in first.items():  # every request's first new token: the shared inputs
            inputs[name][::num_tokens_each] = value
        slots = torch.cat([cache.grow(r, p + num_tokens_each)[-num_tokens_each:] for r, p in zip(rows, prefix_lens)])
        batch = ForwardBatch.build(
            input_ids=[0] * total,
            req_pool_indices=rows,
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=[num_tokens_each] * len(rows),
            out_cache_loc=slots,
            mode=ForwardMode.DECODE if num_tokens_each == 1 else ForwardMode.VERIFY,
        )
        out = attention.forward(layer, inputs["q_nope"], inputs["q_pe"], inputs["c_kv"], inputs["k_pe"], batch)
        for r, p in zip(rows, prefix_lens):
            cache.truncate(r, p)
        return out[::num_tokens_each]

    try:
        with torch.inference_mode():
            for r, p in zip(rows, prefix_lens):
                slots = cache.grow(r, p)
                attention.pool.write(layer.layer_id, slots, torch.randn(p, latent, generator=g), torch.randn(p, rope, generator=g))
            first = {"q_nope": torch.randn(len(rows), heads, layer.qk_nope_head_dim, generator=g),
                     "q_pe": torch.randn(len(rows), heads, rope, generator=g),
                     "c_kv": torch.randn(len(rows), latent, generator=g),
                     "k_pe": torch.randn(len(rows), rope, generator=g)}
            decoded = attend(1, first)
            verified = attend(num_new, first)
    finally:
        for r in rows:
            cache.free_row(r)
    assert torch.equal(decoded, verified)


def test_long_tensor_equals_torch_tensor():
    from eaglet.runtime.forward_batch import long_tensor

    for values in ([], [0], [3, -1, 2**62, -(2**63)], list(range(100))):
        got = long_tensor(values)
        assert got.dtype == torch.long and torch.equal(got, torch.tensor(values, dtype=torch.long))
    with pytest.raises(OverflowError):
        long_tensor([2**63])


def test_reserve_scratch_equals_reserve_rows():
    """A round's one-pass reserve (rows checked, grown by the scratch) leaves what reserve_rows
    leaves; a row not at its committed length, or too long a row, raises before anything changes."""
    reference, one_pass = _three_row_cache(), _three_row_cache()
    rows = [reference.alloc_row() for _ in range(3)]
    assert [one_pass.alloc_row() for _ in range(3)] == rows
    for lens in ([3, 0, 7], [4, 6, 8]):  # within a block, new blocks, a row already holding them
        for c in (reference, one_pass):
            c.truncate_rows(rows, [0, 0, 0], reserve=5)
            c.grow_rows(rows, lens)
        reference.reserve_rows(rows, [n + 5 for n in lens])
        one_pass.reserve_scratch(rows, lens, 5)
        assert torch.equal(one_pass.req_to_token, reference.req_to_token)
        assert one_pass.row_blocks == reference.row_blocks and one_pass.row_len == reference.row_len
    before = (one_pass.req_to_token.clone(), [list(b) for b in one_pass.row_blocks.values()], dict(one_pass.row_len))
    with pytest.raises(RuntimeError, match="exactly its request's committed tokens"):
        one_pass.reserve_scratch(rows, [4, 6, 9], 5)
    with pytest.raises(OutOfCacheBlocks):
        one_pass.reserve_scratch(rows, [4, 6, 28], 5)
    assert torch.equal(one_pass.req_to_token, before[0])
    assert [list(b) for b in one_pass.row_blocks.values()] == before[1] and one_pass.row_len == before[2]


def test_same_length_batch_equals_build():
    from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode

    rows, prefix, n = [2, 0, 5], [7, 3, 11], 4
    ids, slots = torch.arange(100, 112), torch.arange(40, 52)
    positions = (torch.tensor(prefix)[:, None] + torch.arange(n)).reshape(-1)
    common = dict(input_ids=ids, out_cache_loc=slots, positions=positions, mode=ForwardMode.VERIFY,
                  logits_indices=torch.arange(12), capture_layers=(1,), greedy_ids_only=True)
    built = ForwardBatch.build(req_pool_indices=rows, extend_prefix_lens=prefix, extend_seq_lens=[n] * 3, **common)
    same = ForwardBatch.same_length(new_tokens=n, req_pool_indices=torch.tensor(rows), prefix_lens=torch.tensor(prefix),
                                    prefix_lens_cpu=prefix, **common)
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "extend_seq_lens",
                 "extend_prefix_lens", "extend_start_loc", "logits_indices"):
        assert torch.equal(getattr(same, name), getattr(built, name)), name
    for name in ("seq_lens_cpu", "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "mode", "capture_layers", "greedy_ids_only"):
        assert getattr(same, name) == getattr(built, name), name
    # token_starts: made with the batch either way, and what it derives from extend_start_loc.
    built._memo.clear()
    assert torch.equal(same.token_starts(), torch.tensor([0, 4, 8, 12])) and torch.equal(built.token_starts(), same.token_starts())
    assert torch.equal(ForwardBatch.build(req_pool_indices=rows, extend_prefix_lens=prefix, extend_seq_lens=[n] * 3,
                                          **common).token_starts(), same.token_starts())
    with pytest.raises(ValueError, match="expected 8"):
        ForwardBatch.same_length(new_tokens=n, req_pool_indices=torch.tensor(rows[:2]), prefix_lens=torch.tensor(prefix[:2]),
                                 prefix_lens_cpu=prefix[:2], **common)


def test_ragged_batch_equals_build():
    """ForwardBatch.ragged (the per-request tensors made by commit_table) against build from the
    same lengths, field by field; inconsistent lengths raise."""
    from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode

    rows, prefix, lens = [2, 0, 5], [7, 3, 11], [1, 4, 2]
    starts = [0, 1, 5, 7]
    ids, slots = torch.arange(100, 107), torch.arange(40, 47)
    positions = torch.tensor([p + i for p, n in zip(prefix, lens) for i in range(n)])
    common = dict(input_ids=ids, out_cache_loc=slots, positions=positions, mode=ForwardMode.EXTEND)
    built = ForwardBatch.build(req_pool_indices=rows, extend_prefix_lens=prefix, extend_seq_lens=lens, **common)

    def ragged_batch(**changes) -> ForwardBatch:
        args = dict(
            req_pool_indices=torch.tensor(rows), prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(lens),
            seq_lens=torch.tensor([p + n for p, n in zip(prefix, lens)]), token_starts=torch.tensor(starts),
            logits_indices=torch.tensor([s + n - 1 for s, n in zip(starts, lens)]), prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=lens, **common,
        )
        return ForwardBatch.ragged(**(args | changes))

    ragged = ragged_batch()
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "extend_seq_lens",
                 "extend_prefix_lens", "extend_start_loc", "logits_indices"):
        assert torch.equal(getattr(ragged, name), getattr(built, name)), name
    for name in ("seq_lens_cpu", "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "mode"):
        assert getattr(ragged, name) == getattr(built, name), name
    assert torch.equal(ragged.token_starts(), built.token_starts())
    for changes, message in (
        (dict(extend_seq_lens_cpu=[1, 4, 3]), "expected 8"),
        (dict(token_starts=torch.tensor(starts[:-1])), "B \\+ 1 token starts"),
        (dict(extend_seq_lens_cpu=[0, 5, 2]), "at least one new token"),
        (dict(req_pool_indices=torch.tensor(rows[:2])), "one row index"),
    ):
        with pytest.raises(ValueError, match=message):
            ragged_batch(**changes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_slots_equals_indexing(dtype, backend: Backend):
    """Each backend's copy_slots against kv[:, dst] = kv[:, src]: sources read before any write (a
    slot that is both a source and a destination), entries in place skipped; bad slots raise,
    nothing written."""
    cache = _three_row_cache(backend)

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        pool = LatentKVPool(3, 40, 6, dtype, "cpu")
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
        n = int(torch.randint(1, 10, (1,), generator=g))
        perm = torch.randperm(40, generator=g)
        # dst overlaps src's second half (slots that are read and written), then one entry in place.
        src = torch.cat([perm[:n], perm[2 * n : 2 * n + 1]])
        dst = torch.cat([perm[n // 2 : n // 2 + n], perm[2 * n : 2 * n + 1]])
        expected = pool.kv.clone()
        expected[:, dst] = expected[:, src]
        cache.copy_slots(pool, src, dst)
        assert torch.equal(pool.kv, expected)
    if not backend.kernels:
        return
    before = pool.kv.clone()
    with pytest.raises(RuntimeError, match="copy_cache_slots: slot 40 outside 0 .. 39"):
        cache.copy_slots(pool, torch.tensor([1, 2]), torch.tensor([3, 40]))
    with pytest.raises(RuntimeError, match="copy_cache_slots: slot -1 outside 0 .. 39"):
        cache.copy_slots(pool, torch.tensor([1, -1]), torch.tensor([3, 4]))
    with pytest.raises(RuntimeError, match="copy_cache_slots: a destination slot appears twice"):
        cache.copy_slots(pool, torch.tensor([7, 5]), torch.tensor([5, 5]))
    assert torch.equal(pool.kv, before)


def test_scratch_slots_are_the_table_entries(backend: Backend):
    """A round's slots: row rows[b]'s table entries at prefix[b] .. prefix[b] + scratch - 1; a window
    past the table raises (the kernel with a precise message)."""
    cache = _three_row_cache(backend)
    rows = [cache.alloc_row() for _ in range(3)]
    cache.grow_rows(rows, [3, 9, 20])
    rows_t, prefix = torch.tensor([2, 0, 1]), torch.tensor([20, 3, 9])
    slots = cache.scratch_slots(rows_t, prefix, 5)
    assert slots.tolist() == [cache.req_to_token[r, p : p + 5].tolist() for r, p in zip(rows_t.tolist(), prefix.tolist())]
    assert cache.scratch_slots(rows_t, prefix, 0).shape == (3, 0)
    match = "scratch_slots: row 2 at 30 \\+ 5 outside the table" if backend.kernels else None
    with pytest.raises((RuntimeError, IndexError), match=match):
        cache.scratch_slots(torch.tensor([2]), torch.tensor([30]), 5)
