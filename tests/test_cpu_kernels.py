"""eaglet's fused CPU kernels (eaglet/kernels) against the PyTorch ops they replace, and the
property they are built for: a token's result does not depend on the tokens beside it."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from eaglet import kernels
from eaglet.backends import cpu_backend, torch_backend
from eaglet.backends.cpu.mla_attention import CpuMLAAttention
from eaglet.backends.pytorch.mla_attention import TorchMLAAttention
from eaglet.backends.cpu.weights import TileExperts, TileLinear, TileSwiGLU
from eaglet.layers.moe import NoAuxRouter
from eaglet.layers.norms import RMSNorm
from eaglet.layers.rotary import RotaryEmbedding
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.runtime.kv_cache import KVCacheManager

TORCH_LAYERS = torch_backend().layers
TORCH_WEIGHTS = torch_backend().weights

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels not built: {kernels.unavailable_reason()}")


def test_turned_off_by_environment_variable():
    code = "import eaglet.kernels as k; print(k.available(), k.unavailable_reason())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "EAGLET_CPU_KERNELS": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False turned off by EAGLET_CPU_KERNELS=0"


def test_builds_are_cached_per_cpu(monkeypatch, tmp_path):
    """-march=native builds: one made on an AMX Xeon must not load on an AVX512-BF16 EPYC sharing
    the cache directory, nor the other way round."""
    from eaglet.kernels import build, cpu_info

    monkeypatch.setenv("EAGLET_KERNEL_CACHE", str(tmp_path))
    dirs = {}
    for name, flags in {"xeon": {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "epyc": {"avx512f", "avx512_bf16"}}.items():
        monkeypatch.setattr(cpu_info, "cpu_flags", lambda flags=frozenset(flags): flags)
        dirs[name] = build.build_dir()
    assert dirs["xeon"] != dirs["epyc"] and all(d.parent == tmp_path for d in dirs.values())


# ---- argmax ----------------------------------------------------------------------------------
# (Its agreement with torch.argmax, ties and NaNs included, is tests/test_sampling.py's greedy test.)


def test_argmax_rejects_what_it_cannot_take():
    with pytest.raises(RuntimeError, match="non-empty last dimension"):
        torch.ops.eaglet.argmax_last_dim(torch.zeros(3, 0))
    with pytest.raises(RuntimeError, match="bfloat16 or float32 logits"):
        torch.ops.eaglet.argmax_last_dim(torch.zeros(3, 8, dtype=torch.float16))


# ---- RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [384, 100])  # 100: the vector loops' tails
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_pytorch_and_is_row_independent(dtype, hidden):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(hidden, generator=g).to(dtype)
    x = (torch.randn(37, hidden, generator=g) * 3).to(dtype)
    ops = cpu_backend().layers
    with torch.inference_mode():
        expected = TORCH_LAYERS.rms_norm(x, weight, 1e-6)
        got = ops.rms_norm(x, weight, 1e-6)
        alone = torch.cat([ops.rms_norm(x[i : i + 1], weight, 1e-6) for i in range(x.shape[0])])
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    else:  # the float32 sums differ in order: at most one bfloat16 rounding step apart
        torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-2)
        assert (got != expected).float().mean() < 0.02
    assert torch.equal(got, alone)


def test_rms_norm_keeps_pytorch_under_autograd():
    norm = RMSNorm(64, 1e-6, cpu_backend().layers)
    norm.weight.data = torch.ones(64)
    norm.weight.requires_grad_(True)
    x = torch.randn(3, 64, requires_grad=True)
    norm(x).sum().backward()  # the kernel has no backward: training must take the PyTorch ops
    assert x.grad is not None and norm.weight.grad is not None


# ---- rotary embedding, cache writes --------------------------------------------------------


@pytest.mark.parametrize("rope_dim", [64, 40, 8])  # 40 and 8: the vector loops' tails (the demo's rope is 8)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_pytorch_bit_for_bit(interleave, dtype, rope_dim):
    from eaglet.layers.rotary import RopeConfig

    rotary = RotaryEmbedding(rope_dim, RopeConfig(rope_type="default", theta=10000.0), interleave, TORCH_LAYERS)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(9, 5, 2 * rope_dim, generator=g).to(dtype)
    q_pe = q[..., rope_dim:]  # the strided slice MLAAttention passes
    k_pe = torch.randn(9, rope_dim, generator=g).to(dtype)
    cos, sin = rotary.cos_sin_as(torch.arange(9) * 7, dtype)
    with torch.inference_mode():
        expected = rotary.rotate_query_and_key(q_pe, k_pe, cos, sin)
        got = cpu_backend().layers.rope_query_key(q_pe, k_pe, cos, sin, interleave)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cache_write_equals_the_pool_write(cache_dtype):
    cache = _cache(cache_dtype)
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([17, 3, 200, 41])
    c_kv = torch.randn(4, 512, generator=g).bfloat16()
    k_pe = torch.randn(4, 64, generator=g).bfloat16()
    expected = cache.target.kv.clone()
    with torch.inference_mode():
        cache.target.write(0, slots, c_kv, k_pe)
        expected, cache.target.kv[:] = cache.target.kv.clone(), expected
        torch.ops.eaglet.mla_cache_write(cache.target.kv[0], slots, c_kv, k_pe)
    assert torch.equal(cache.target.kv, expected)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.eaglet.mla_cache_write(cache.target.kv[0], torch.tensor([0, 1, 2, cache.target.kv.shape[1]]), c_kv, k_pe)


# ---- routing ---------------------------------------------------------------------------------


class _RouterConfig:
    def __init__(self, **overrides):
        self.n_routed_experts, self.hidden_size, self.num_experts_per_tok = 16, 96, 3
        self.n_group, self.topk_group, self.norm_topk_prob, self.routed_scaling_factor = 4, 2, True, 2.5
        self.__dict__.update(overrides)


ROUTERS = {
    "grouped": {},
    "all-groups": {"n_group": 1, "topk_group": 1},
    "no-norm": {"norm_topk_prob": False, "routed_scaling_factor": 1.0, "num_experts_per_tok": 2},
    "odd-sizes": {"n_routed_experts": 6, "hidden_size": 35, "n_group": 3, "topk_group": 1, "num_experts_per_tok": 1},
}


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_pytorch_and_is_row_independent(name, dtype):
    g = torch.Generator().manual_seed(1)
    reference = NoAuxRouter(_RouterConfig(**ROUTERS[name]), TORCH_LAYERS)
    reference.weight.data = torch.randn(reference.weight.shape, generator=g)
    reference.e_score_correction_bias.data = torch.randn(reference.weight.shape[0], generator=g) * 0.1
    router = NoAuxRouter(_RouterConfig(**ROUTERS[name]), cpu_backend().layers)
    router.load_state_dict(reference.state_dict())
    x = torch.randn(29, router.weight.shape[1], generator=g).to(dtype)
    with torch.inference_mode():
        expected_w, expected_ids = reference(x)
        got_w, got_ids = router(x)
        alone = [router(x[i : i + 1]) for i in range(x.shape[0])]
    # The same experts per token (order is free: every consumer combines them by expert id).
    order_e, order_g = expected_ids.argsort(-1), got_ids.argsort(-1)
    assert torch.equal(expected_ids.gather(1, order_e), got_ids.gather(1, order_g))
    torch.testing.assert_close(got_w.gather(1, order_g), expected_w.gather(1, order_e), rtol=1e-5, atol=1e-6)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert torch.equal(got_w, torch.cat([w for w, _ in alone]))
    assert torch.equal(got_ids, torch.cat([i for _, i in alone]))


def test_router_rejects_a_top_k_beyond_the_kept_experts():
    router = NoAuxRouter(_RouterConfig(num_experts_per_tok=9), cpu_backend().layers)  # 2 of 4 groups keep 8 experts
    router.weight.data.normal_()
    router.e_score_correction_bias.data.zero_()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="top_k out of range"):
        router(torch.randn(2, 96))


# ---- bfloat16 GEMMs in tile layout and routed experts----------------------------------------------------

tile_kernels = pytest.mark.skipif(kernels.tile_backend() is None, reason="the kernels' build has no tile GEMM here")


@tile_kernels
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(960, 512, False), (70, 40, True), (32000, 64, False)])
def test_amx_linear_matches_f_linear_and_gives_a_row_the_same_bits_at_any_row_count(out_features, in_features, bias):
    g = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    x = torch.randn(41, in_features, generator=g).bfloat16()
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    tiled = cpu_backend().weights.linear(weight, b)
    assert isinstance(tiled, TileLinear)
    with torch.inference_mode():
        got = tiled.apply(x)
        assert got.dtype == torch.bfloat16 and got.shape == (41, out_features)
        torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
        for rows in (1, 2, 15, 16, 17, 33):
            assert torch.equal(tiled.apply(x[:rows]), got[:rows])
        assert torch.equal(tiled.apply(x[40:41])[0], got[40])
        # Logits: the same bfloat16 values, written as float32 by the kernel.
        logits = tiled.logits(x)
        assert logits.dtype == torch.float32 and torch.equal(logits, got.float())


@tile_kernels
@pytest.mark.parametrize(("out_features", "in_features"), [(200, 300), (176, 64)])
def test_tile_gemm_gives_a_row_the_same_bits_alone_or_among_up_to_40_rows(out_features, in_features):
    """A row's products are one chain per output in k order from zero, whatever register block of
    rows it lands in (AVX2 takes 4 rows at a time and 1-3 at the end): the row alone, and at each
    place of a 4-row block or last among 1-40 other rows, gives the same bits, within float32
    accumulation and one bfloat16 rounding of the float64 product. The shapes end k inside a tile and the
    columns inside a group of 64 (1 and 3 blocks of 16 left)."""
    g = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    packed = torch.ops.eaglet.amx_pack_weight(weight)
    rows = torch.randn(41, in_features, generator=g).bfloat16()
    row = rows[0:1]
    with torch.inference_mode():
        alone = torch.ops.eaglet.amx_linear(row, packed, out_features, None, True)[0]
        for others in range(1, 41):
            for at in (others % 4, others):  # each place in a block of 4 rows, and among the last rows
                batch = torch.cat([rows[1 : 1 + at], row, rows[1 + at : 1 + others]])
                got = torch.ops.eaglet.amx_linear(batch, packed, out_features, None, True)
                assert torch.equal(got[at], alone), (others, at)
    reference = row.double() @ weight.double().t()
    # float32 sums of in_features products: far below a bfloat16 step of the largest output.
    torch.testing.assert_close(alone.double(), reference[0], rtol=2**-8, atol=2**-8 * reference.abs().max().item())


@tile_kernels
def test_amx_linear_rejects_a_weight_it_did_not_pack():
    weight = torch.randn(64, 32).bfloat16()
    packed = torch.ops.eaglet.amx_pack_weight(weight)
    with pytest.raises(RuntimeError, match="does not match its packed copy"):
        torch.ops.eaglet.amx_linear(torch.randn(2, 64).bfloat16(), packed, 64, None)
    with pytest.raises(RuntimeError, match="not packed"):
        torch.ops.eaglet.amx_linear(torch.randn(2, 32).bfloat16(), weight, 64, None)


@tile_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("out_features", "in_features", "bias"),
                         [(32000, 64, False), (1000, 128, True), (65, 96, False), (64, 32, False), (1, 32, True)])
def test_fused_lm_head_argmax_is_the_argmax_of_the_logits(out_features, in_features, bias, threads):
    """Ties (duplicate weight rows: the first column wins), NaN rows (the first NaN), all-zero rows
    and column counts that end inside a tile group, on one thread and split over two."""
    g = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    if out_features > 10:
        weight[out_features // 2] = weight[3]
        weight[-1] = weight[3]
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    tiled = cpu_backend().weights.linear(weight, b)
    x = torch.randn(37, in_features, generator=g).bfloat16()
    x[1] = float("nan")
    x[4] = 0
    if out_features > 10:
        x[5] = weight[3]  # its best logit is column 3's, shared by the duplicates
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            expected = tiled.logits(x).argmax(-1)
            for rows in (1, 16, 17, 37):
                got = tiled.argmax(x[:rows])
                assert got.dtype == torch.long and torch.equal(got, expected[:rows])
    finally:
        torch.set_num_threads(previous)
    assert int(expected[1]) == 0  # a NaN row: the first NaN
    if out_features > 10 and not bias:  # three equal best logits: the first column
        assert int(expected[5]) == 3


@tile_kernels
def test_fused_lm_head_argmax_needs_the_tile_copy():
    weight = torch.randn(64, 32).bfloat16()
    with torch.inference_mode():
        # A PyTorch form of the weight, or another dtype: no argmax without logits, the caller takes them.
        assert TORCH_WEIGHTS.linear(weight).argmax(torch.randn(2, 32).bfloat16()) is None
        assert cpu_backend().weights.linear(weight).argmax(torch.randn(2, 32)) is None
    with pytest.raises(RuntimeError, match="not packed"):
        torch.ops.eaglet.amx_linear_argmax(torch.randn(2, 32).bfloat16(), weight, 64, None)


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bfloat16 w13 [E, 2I, H] and w2 [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).bfloat16()
    return w13, w2


@tile_kernels
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden", "inter"), [(1, 2, 512, 256), (13, 3, 96, 40), (40, 1, 72, 48)])
def test_routed_experts_match_pytorch_and_are_row_independent(num_tokens, top_k, hidden, inter):
    w13, w2 = _experts(6, hidden, inter, seed=num_tokens)
    reference, tiled = TORCH_WEIGHTS.experts(w13, w2), cpu_backend().weights.experts(w13, w2)
    assert isinstance(tiled, TileExperts)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(num_tokens, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(6, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    with torch.inference_mode():
        expected = reference.apply(x, weights, ids)
        got = tiled.apply(x, weights, ids)
        alone = torch.cat([tiled.apply(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(num_tokens)])
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # bfloat16 products rounded in other places: a few bfloat16 steps of the largest output apart
    scale = expected.float().abs().max()
    torch.testing.assert_close(got.float() / scale, expected.float() / scale, rtol=0, atol=2e-2)
    assert torch.equal(got, alone)


@tile_kernels
@pytest.mark.parametrize(("num_tokens", "hidden", "inter"), [(1, 512, 256), (23, 96, 40)])
def test_swiglu_matches_pytorch_and_is_row_independent(num_tokens, hidden, inter):
    g = torch.Generator().manual_seed(num_tokens)
    gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
    down = (torch.randn(hidden, inter, generator=g) / inter**0.5).bfloat16()
    reference, tiled = TORCH_WEIGHTS.swiglu(gate_up, down), cpu_backend().weights.swiglu(gate_up, down)
    assert isinstance(tiled, TileSwiGLU)
    x = torch.randn(num_tokens, hidden, generator=g).bfloat16()
    with torch.inference_mode():
        expected = reference.apply(x)
        got = tiled.apply(x)
        alone = torch.cat([tiled.apply(x[i : i + 1]) for i in range(num_tokens)])
    scale = expected.float().abs().max()
    torch.testing.assert_close(got.float() / scale, expected.float() / scale, rtol=0, atol=2e-2)
    assert torch.equal(got, alone)


@tile_kernels
def test_routed_experts_reject_an_expert_id_out_of_range():
    experts = cpu_backend().weights.experts(*_experts(4, 64, 32, seed=0))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="expert id 4 out of range"):
        experts.apply(torch.randn(2, 64).bfloat16(), torch.ones(2, 1), torch.tensor([[1], [4]]))


# ---- absorbed MLA attention --------------------------------------------------------------------


# (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim): DeepSeek-V3's, and the demo model's,
# whose latent and query widths are not multiples of the 32-wide tiles (the kernels pad them)
DIMS = {"deepseek": (512, 64, 64, 64), "demo": (48, 24, 8, 24)}


class _Layer:
    """The attributes of MLAAttention that attention reads, at the per-head sizes of ``dims``.
    ``tiles``: with the tile copies of W_UK / W_UV the CPU backend makes for bfloat16 models
    (the weights are then bfloat16 values, as those taken from a bfloat16 kv_b_proj are)."""

    def __init__(self, heads: int = 8, seed: int = 0, tiles: bool = False, dims: str = "deepseek"):
        g = torch.Generator().manual_seed(seed)
        latent, nope, rope, value = DIMS[dims]
        self.layer_id, self.num_heads, self.kv_lora_rank = 0, heads, latent
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = nope, rope, value
        self.w_uk = torch.randn(heads, nope, latent, generator=g) / nope**0.5
        self.w_uv_t = torch.randn(heads, latent, value, generator=g) / (20 * (latent / 512)**0.5)
        self.scaling = (nope + rope)**-0.5
        self.absorbed_projections: tuple[torch.Tensor, ...] = ()
        if tiles:
            self.w_uk, self.w_uv_t = self.w_uk.bfloat16().float(), self.w_uv_t.bfloat16().float()
            pack = torch.ops.eaglet.amx_pack_weight
            self.absorbed_projections = (torch.stack([pack(w.t().bfloat16().contiguous()) for w in self.w_uk]),
                                    torch.stack([pack(w.t().bfloat16().contiguous()) for w in self.w_uv_t]))


def _has_tile_kernels() -> bool:
    return kernels.tile_backend() is not None


# (query and cache dtype, tile projections): float32 projections for both dtypes, and where the tile
# kernels run the tile-layout ones, which take bfloat16 queries
needs_tiles = pytest.mark.skipif(not _has_tile_kernels(), reason="the kernels' build has no tile GEMM here")
PROJECTIONS = [pytest.param(torch.float32, False, id="float32-fp32-projections"),
               pytest.param(torch.bfloat16, False, id="bfloat16-fp32-projections"),
               pytest.param(torch.bfloat16, True, id="bfloat16-tile-projections", marks=needs_tiles)]


def _cache(dtype: torch.dtype, seed: int = 0, dims: str = "deepseek") -> KVCacheManager:
    latent, _, rope, _ = DIMS[dims]
    cache = KVCacheManager(num_layers=1, kv_cache_dim=latent + rope, num_blocks=64, block_size=8, max_requests=8,
                           max_context_len=256, dtype=dtype, ops=cpu_backend().cache)
    g = torch.Generator().manual_seed(seed)
    cache.target.kv.copy_(torch.randn(cache.target.kv.shape, generator=g).to(dtype))
    return cache


def _batch(cache: KVCacheManager, rows: list[int], prefix_lens: list[int], new_lens: list[int],
           custom_mask: torch.Tensor | None = None) -> ForwardBatch:
    slots = torch.cat([cache.grow(r, p + n)[-n:] for r, p, n in zip(rows, prefix_lens, new_lens)])
    mode = ForwardMode.DECODE if all(n == 1 for n in new_lens) and custom_mask is None else ForwardMode.VERIFY
    return ForwardBatch.build(input_ids=[0] * sum(new_lens), req_pool_indices=rows, extend_prefix_lens=prefix_lens,
                              extend_seq_lens=new_lens, out_cache_loc=slots, mode=mode, custom_mask=custom_mask)


def _queries(num_tokens: int, layer: _Layer, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(num_tokens, layer.num_heads, layer.qk_nope_head_dim, generator=g).to(dtype)
    q_pe = torch.randn(num_tokens, layer.num_heads, layer.qk_rope_head_dim, generator=g).to(dtype)
    return q_nope, q_pe


SHAPES = {
    "decode": ([30], [1]),
    "ragged-decode": ([5, 70, 33, 12], [1, 1, 1, 1]),
    "chain-verify": ([20, 41, 9], [4, 4, 4]),
    "ragged-extend": ([0, 17, 3], [6, 2, 9]),
    "long-extend": ([3, 50], [37, 1]),  # more than one 16-row block of queries in a request
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize(("dtype", "tiles"), PROJECTIONS)
@pytest.mark.parametrize("dims", list(DIMS))
def test_mla_attention_matches_pytorch(name, dtype, tiles, dims):
    prefix_lens, new_lens = SHAPES[name]
    cache, layer = _cache(dtype, dims=dims), _Layer(tiles=tiles, dims=dims)
    rows = [cache.alloc_row() for _ in prefix_lens]
    for r, p in zip(rows, prefix_lens):
        cache.grow(r, p)
    batch = _batch(cache, rows, prefix_lens, new_lens)
    q_nope, q_pe = _queries(batch.num_tokens, layer, dtype, seed=2)
    with torch.inference_mode():
        expected = TorchMLAAttention(cache)._absorbed(layer, q_nope, q_pe, batch)
        got = CpuMLAAttention(cache)._absorbed(layer, q_nope, q_pe, batch)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 4e-3}
    if tiles:  # q_latent, the probabilities and o rounded to bfloat16 for the tiles: three bfloat16 steps more
        tolerance = {"rtol": 2e-2, "atol": 1.5e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_attention_with_a_tree_mask_matches_pytorch(dtype):
    cache, layer = _cache(dtype, seed=3), _Layer(heads=4)
    prefix_lens, tree = [11, 26], 5
    rows = [cache.alloc_row() for _ in prefix_lens]
    for r, p in zip(rows, prefix_lens):
        cache.grow(r, p)
    parents = [-1, 0, 0, 1, 2]  # root, two children, a grandchild under each
    max_len = max(prefix_lens) + tree
    mask = torch.zeros(tree * len(rows), max_len, dtype=torch.bool)
    for b, p in enumerate(prefix_lens):
        for node in range(tree):
            mask[b * tree + node, :p] = True
            ancestor = node
            while ancestor >= 0:
                mask[b * tree + node, p + ancestor] = True
                ancestor = parents[ancestor]
    batch = _batch(cache, rows, prefix_lens, [tree] * len(rows), custom_mask=mask)
    q_nope, q_pe = _queries(batch.num_tokens, layer, dtype, seed=4)
    with torch.inference_mode():
        expected = TorchMLAAttention(cache)._absorbed(layer, q_nope, q_pe, batch)
        got = CpuMLAAttention(cache)._absorbed(layer, q_nope, q_pe, batch)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 4e-3}
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


@pytest.mark.parametrize(("dtype", "tiles"), PROJECTIONS)
@pytest.mark.parametrize("dims", list(DIMS))
def test_mla_attention_gives_each_token_the_bits_it_gets_alone(dtype, tiles, dims):
    """Every token of a ragged verify batch equals, bit for bit, the same token attended alone as a
    decode step over the keys it sees: what lossless greedy speculation needs, with no padding."""
    cache, layer = _cache(dtype, seed=5, dims=dims), _Layer(tiles=tiles, dims=dims)
    prefix_lens, new_lens = [9, 40, 23], [3, 5, 1]
    rows = [cache.alloc_row() for _ in prefix_lens]
    for r, p in zip(rows, prefix_lens):
        cache.grow(r, p)
    backend = CpuMLAAttention(cache)
    batch = _batch(cache, rows, prefix_lens, new_lens)
    q_nope, q_pe = _queries(batch.num_tokens, layer, dtype, seed=6)
    with torch.inference_mode():
        together = backend._absorbed(layer, q_nope, q_pe, batch)
        token = 0
        for b, (row, p, n) in enumerate(zip(rows, prefix_lens, new_lens)):
            for i in range(n):
                # The same row of the table, cut after this token: it sees the same keys.
                single = ForwardBatch.build(input_ids=[0], req_pool_indices=[row], extend_prefix_lens=[p + i],
                                            extend_seq_lens=[1], out_cache_loc=cache.req_to_token[row, p + i : p + i + 1])
                alone = backend._absorbed(layer, q_nope[token : token + 1], q_pe[token : token + 1], single)
                assert torch.equal(alone[0], together[token]), (b, i)
                token += 1


@pytest.mark.parametrize("tiles", [pytest.param(False, id="fp32-projections"),
                                   pytest.param(True, id="tile-projections", marks=needs_tiles)])
@pytest.mark.parametrize("dims", list(DIMS))
def test_mla_attention_gives_a_tree_node_the_bits_of_its_path_decoded_alone(tiles, dims):
    """A node of a verified tree equals, bit for bit, its own token decoded after the committed
    prefix and its ancestors laid out one after another: greedy tree speculation then reproduces
    plain decoding (keys the node does not see must not change its sums)."""
    dtype = torch.bfloat16
    cache, layer = _cache(dtype, seed=9, dims=dims), _Layer(tiles=tiles, dims=dims)
    prefix, parents = 13, [-1, 0, 0, 1, 2, 1, 4]
    tree = len(parents)
    row = cache.alloc_row()
    cache.grow(row, prefix)
    mask = torch.zeros(tree, prefix + tree, dtype=torch.bool)
    paths = []
    for node in range(tree):
        path, ancestor = [], node
        while ancestor >= 0:
            path.insert(0, ancestor)
            ancestor = parents[ancestor]
        paths.append(path)
        mask[node, :prefix] = True
        mask[node, [prefix + j for j in path]] = True
    batch = _batch(cache, [row], [prefix], [tree], custom_mask=mask)
    q_nope, q_pe = _queries(tree, layer, dtype, seed=10)
    backend = CpuMLAAttention(cache)
    with torch.inference_mode():
        together = backend._absorbed(layer, q_nope, q_pe, batch)
        kv = cache.target.kv[0]
        tree_slots = cache.req_to_token[row, prefix : prefix + tree]
        for node, path in enumerate(paths):
            alone_row = cache.alloc_row()
            slots = cache.grow(alone_row, prefix + len(path))
            kv[slots[:prefix]] = kv[cache.req_to_token[row, :prefix]]
            kv[slots[prefix:]] = kv[tree_slots[path]]
            single = ForwardBatch.build(input_ids=[0], req_pool_indices=[alone_row], extend_prefix_lens=[prefix + len(path) - 1],
                                        extend_seq_lens=[1], out_cache_loc=slots[-1:])
            alone = backend._absorbed(layer, q_nope[node : node + 1], q_pe[node : node + 1], single)
            assert torch.equal(alone[0], together[node]), node
            cache.free_row(alone_row)


def test_mla_attention_rejects_inconsistent_metadata():
    cache, layer = _cache(torch.float32), _Layer()
    row = cache.alloc_row()
    cache.grow(row, 10)
    q_nope, q_pe = _queries(2, layer, torch.float32, seed=7)
    slots = cache.req_to_token[[row], :10]
    op = torch.ops.eaglet.mla_absorbed_attention
    args = (q_nope, q_pe, cache.target.kv[0], layer.w_uk, layer.w_uv_t)
    with pytest.raises(RuntimeError, match="token_starts do not cover the tokens"):
        op(*args, slots, torch.tensor([10]), torch.tensor([0, 1]), None, 0.1)
    with pytest.raises(RuntimeError, match="has 2 tokens and 11 keys"):
        op(*args, slots, torch.tensor([11]), torch.tensor([0, 2]), None, 0.1)
    bad_slots = slots.clone()
    bad_slots[0, 3] = cache.target.kv.shape[1]
    with pytest.raises(RuntimeError, match="out of range"):
        op(*args, bad_slots, torch.tensor([10]), torch.tensor([0, 2]), None, 0.1)
    with pytest.raises(RuntimeError, match="float32 W_UK"):
        op(q_nope, q_pe, cache.target.kv[0], layer.w_uk.double(), layer.w_uv_t, slots, torch.tensor([10]),
           torch.tensor([0, 2]), None, 0.1)
