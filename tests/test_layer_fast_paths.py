"""The decode fast paths compute what the plain formulas do: small-batch GEMM form, fused
projections, the one-token MoE path, float32 absorbed attention, oneDNN-packed bfloat16 and
float32 weights; and the "auto" dtype and packing policies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from eaglet.backends import Backend, torch_backend
from eaglet.backends.cpu_caps import auto_dtype, has_native_bf16, packs_float32
from eaglet.backends.pytorch.layer_ops import TorchLayerOps
from eaglet.backends.pytorch.weights import (
    DENSE_MAX_TOKENS,
    EXACT_ROWS,
    PADDED_MAX_ROWS,
    SMALL_BATCH_ROWS,
    DenseLinear,
    OneDnnLinear,
    TorchWeightMethods,
    dense_linear,
    padded_rows,
    should_pack,
)
from eaglet.layers.moe import MoE, RoutedExperts, SwiGLU
from eaglet.models.config import parse_text_config
from eaglet.models.registry import resolve_dtype
from eaglet.testing.checkpoints import tiny_text_config

TORCH = torch_backend()


class DenseWeights(TorchWeightMethods):
    """Every matrix as it is (no packed copies): the reference the packed forms must equal."""

    @staticmethod
    def _linear_class(dtype: torch.dtype) -> type[DenseLinear]:
        return DenseLinear


@pytest.mark.parametrize("rows", [1, 2, min(SMALL_BATCH_ROWS), max(SMALL_BATCH_ROWS), max(SMALL_BATCH_ROWS) + 1, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g)
    w = torch.randn(40, 48, generator=g)
    b = torch.randn(40, generator=g) if with_bias else None
    out = dense_linear(x, w, b)
    assert out.shape == (rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    bf16 = dense_linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16())
    torch.testing.assert_close(bf16, F.linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()))


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_swiglu_fused_gate_up_matches_separate_projections():
    mlp = SwiGLU(32, 24, TORCH.weights)
    _randomize(mlp, 0)
    gate, up = mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone()
    mlp.process_weights_after_loading()
    # the checkpoint-named parameters are views of the fused matrix, values unchanged
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
    assert torch.equal(mlp.gate_proj.weight, gate) and torch.equal(mlp.up_proj.weight, up)
    x = torch.randn(5, 32)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-6)


def test_one_token_moe_path_matches_the_grouped_path():
    cfg = parse_text_config(tiny_text_config(hidden_size=32, moe_intermediate_size=16, num_experts_per_tok=3), "test")
    moe = MoE(cfg, TORCH)
    _randomize(moe, 1)
    for module in moe.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    moe.experts.method.w13_t = moe.experts.method.w2_t = None  # these experts are small enough for the dense path
    tokens = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    batched = moe(tokens)  # four tokens: the sort / grouped-matmul path
    for i in range(4):
        torch.testing.assert_close(moe(tokens[i : i + 1]), batched[i : i + 1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_experts, hidden, inter, dense", [(4, 32, 16, True), (8, 256, 256, False)])
def test_dense_moe_path_for_small_experts_matches_the_routed_path(num_experts, hidden, inter, dense):
    experts = RoutedExperts(num_experts, hidden, inter, TORCH.weights)
    generator = torch.Generator().manual_seed(3)
    experts.w13.data = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * 0.1
    experts.w2.data = torch.randn(num_experts, hidden, inter, generator=generator) * 0.1
    experts.process_weights_after_loading()
    assert (experts.method.w13_t is not None) == dense  # only experts that together fit in cache
    for num_tokens in (1, 4, 16, DENSE_MAX_TOKENS + 1):
        x = torch.randn(num_tokens, hidden, generator=generator)
        expert_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:2] for _ in range(num_tokens)])
        weights = torch.rand(num_tokens, 2, generator=generator)
        with torch.inference_mode():
            got = experts(x, weights, expert_ids)
        expected = torch.zeros_like(x)
        for t in range(num_tokens):
            for e, w in zip(expert_ids[t].tolist(), weights[t].tolist()):
                gate, up = F.linear(x[t], experts.w13.data[e]).chunk(2)
                expected[t] += w * F.linear(F.silu(gate) * up, experts.w2.data[e])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_reference_formula_bit_for_bit(dtype):
    """The PyTorch backend's (the kernel's float32 sums run in another order: test_cpu_kernels.py)."""
    from eaglet.layers.norms import RMSNorm

    generator = torch.Generator().manual_seed(5)
    for hidden in (7, 48, 128, 512, 7168):
        norm = RMSNorm(hidden, 1e-6, torch_backend().layers)
        norm.weight.data = torch.randn(hidden, generator=generator).to(dtype)
        for num_tokens in (1, 3, 16, 65):
            x = (torch.randn(num_tokens, hidden, generator=generator) * 3).to(dtype)
            x32 = x.float()  # DeepSeek-V3's RMSNorm, as transformers writes it
            expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            with torch.inference_mode():
                assert torch.equal(norm(x), expected)


def test_rotating_query_and_key_together_equals_rotating_each(backend: Backend):
    from eaglet.layers.rotary import RopeConfig
    from eaglet.layers.rotary import RotaryEmbedding

    generator = torch.Generator().manual_seed(6)
    for interleave in (False, True):
        rotary = RotaryEmbedding(8, RopeConfig(theta=10000.0, rope_type="default"), interleave, backend.layers)
        positions = torch.tensor([0, 5, 9])
        for dtype in (torch.float32, torch.bfloat16):
            q_pe = torch.randn(3, 4, 8, generator=generator).to(dtype)
            k_pe = torch.randn(3, 8, generator=generator).to(dtype)
            cos, sin = rotary.cos_sin(positions)
            with torch.inference_mode():
                q, k = rotary.rotate_query_and_key(q_pe, k_pe, *rotary.cos_sin_as(positions, dtype))
            assert torch.equal(q, rotary(q_pe, cos, sin)) and torch.equal(k, rotary(k_pe, cos, sin))


def test_auto_dtype_follows_native_bf16_support_or_the_tile_gemm():
    assert auto_dtype(frozenset({"avx2", "fma"})) == torch.float32
    assert auto_dtype(frozenset({"avx2", "fma"}), tile_gemm=True) == torch.bfloat16
    assert auto_dtype(frozenset({"avx512f", "avx512_bf16"})) == torch.bfloat16
    assert auto_dtype(frozenset({"amx_bf16", "amx_tile"})) == torch.bfloat16
    assert resolve_dtype("auto") == (torch.bfloat16 if has_native_bf16() else torch.float32)
    assert resolve_dtype("auto", tile_gemm=True) == torch.bfloat16
    with pytest.raises(ValueError, match="'auto'"):
        resolve_dtype("int8")


def test_fused_projections_leave_training_gradients_on_the_named_parameters():
    mlp = SwiGLU(16, 8, TORCH.weights)
    _randomize(mlp, 3)
    mlp.process_weights_after_loading()
    for p in mlp.parameters():
        p.requires_grad_(True)
    x = torch.randn(3, 16)
    mlp(x).square().sum().backward()
    assert mlp.gate_proj.weight.grad is not None and mlp.up_proj.weight.grad.abs().sum() > 0
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)), atol=1e-6, rtol=1e-6)


needs_native_bf16 = pytest.mark.skipif(not should_pack(torch.bfloat16), reason="CPU without native bfloat16 GEMMs")


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_weight_is_bit_identical_to_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(80, 96, generator=g).bfloat16()
    b = torch.randn(80, generator=g).bfloat16() if with_bias else None
    expected = F.linear(x, w, b)
    packed = OneDnnLinear(w, b)
    with torch.no_grad():
        assert torch.equal(packed.apply(x), expected)
        assert torch.equal(packed.apply(x[:, None].expand(rows, 2, 96)[:, 0]), expected)  # a strided x


def test_padded_row_counts_are_few_and_pad_at_most_a_quarter():
    counts = [padded_rows(rows) for rows in range(0, PADDED_MAX_ROWS + 1)]
    assert counts[: EXACT_ROWS + 1] == list(range(EXACT_ROWS + 1))
    assert all(rows <= padded <= 1.25 * rows for rows, padded in enumerate(counts))
    assert counts == sorted(counts)
    assert all(padded_rows(padded) == padded for padded in counts)
    assert len(set(counts)) == EXACT_ROWS + 1 + 4 * 6  # four per power of two from 16 to 1024
    assert [padded_rows(rows) for rows in (PADDED_MAX_ROWS + 1, 3000)] == [PADDED_MAX_ROWS + 1, 3000]


@needs_native_bf16
def test_packed_gemm_rows_do_not_depend_on_the_row_count_or_padding():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g).bfloat16()
    expected = F.linear(x, w)
    packed = OneDnnLinear(w)
    with torch.no_grad():
        for rows in [*range(1, 40), 63, 64, 65, 100, 130]:
            out = packed.apply(x[:rows])
            assert out.shape == (rows, 48)
            assert torch.equal(out, expected[:rows]), rows


def test_float32_weights_are_packed_on_amd_cpus_only():
    assert packs_float32("AuthenticAMD") and not packs_float32("GenuineIntel") and not packs_float32("")
    assert should_pack(torch.float32) == (packs_float32() and torch.backends.mkldnn.is_available())
    assert not should_pack(torch.float16)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (960, 512)])
def test_packed_float32_weight_matches_f_linear(out_features, in_features):
    """oneDNN's float32 GEMM in place of MKL's: within float32 rounding of F.linear, bias included;
    where the packing policy uses it (AMD), also the same bits for a row at any row count."""
    g = torch.Generator().manual_seed(in_features)
    x = torch.randn(130, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    expected = F.linear(x, w, b)
    method = OneDnnLinear(w, b)
    with torch.no_grad():
        packed = method.apply(x)
        torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-4)
        if packs_float32():
            for rows in [*range(1, 40), 63, 64, 65, 100]:
                assert torch.equal(method.apply(x[:rows]), packed[:rows]), rows


@needs_native_bf16
def test_packed_weight_is_not_used_after_an_in_place_update_or_with_gradients():
    w = torch.randn(32, 16).bfloat16()
    x = torch.randn(4, 16).bfloat16()
    method = OneDnnLinear(w)
    with torch.no_grad():
        w.mul_(2)  # an optimizer step: the packed copy is stale now
        assert torch.equal(method.apply(x), F.linear(x, w))
    w2 = torch.randn(32, 16).bfloat16().requires_grad_()
    out = OneDnnLinear(w2).apply(x)  # grad mode: through the parameter itself, so the gradient reaches it
    out.sum().backward()
    assert w2.grad is not None and w2.grad.abs().sum() > 0


@needs_native_bf16
def test_packed_moe_layer_equals_the_unpacked_one():
    config = parse_text_config(tiny_text_config(hidden_size=32, moe_intermediate_size=16), "test")
    torch.manual_seed(0)
    dense = dataclasses.replace(TORCH, weights=DenseWeights())
    reference = MoE(config, dense).bfloat16()
    _randomize(reference, 5)
    reference.gate.float()  # the router runs in float32, as the loader builds it
    for module in reference.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    packed = MoE(config, TORCH).bfloat16()
    packed.gate.float()
    packed.load_state_dict(reference.state_dict())
    for module in packed.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    methods = [m for pair in packed.experts.method.per_expert for m in pair]
    methods += [packed.shared_experts.method.gate_up, packed.shared_experts.method.down]
    assert all(isinstance(m, OneDnnLinear) for m in methods)  # experts' w13 / w2, shared gate_up / down
    x = torch.randn(7, config.hidden_size).bfloat16()
    with torch.no_grad():
        assert torch.equal(packed(x), reference(x))
        assert torch.equal(packed(x[:1]), reference(x[:1]))


def test_router_and_dense_experts_give_a_token_the_same_bits_whatever_the_tokens_beside_it(backend: Backend):
    """Float32 routing and dense experts: the first token alone equals it among 3 or 20 tokens, bit
    for bit (one row through MKL rounds differently from several without the padding)."""
    config = parse_text_config(tiny_text_config(hidden_size=128, moe_intermediate_size=32), "test")
    torch.manual_seed(0)
    moe = MoE(config, backend)
    _randomize(moe, 7)
    for module in moe.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    x = torch.randn(20, config.hidden_size)
    with torch.no_grad():
        weights, ids = moe.gate(x[:1])
        for num_tokens in (3, 20):
            more_weights, more_ids = moe.gate(x[:num_tokens])
            assert torch.equal(more_weights[:1], weights) and torch.equal(more_ids[:1], ids)
        # Small experts: the dense path on PyTorch ops; the kernels' float32 panels never batch experts.
        assert (moe.experts.method.w13_t is not None) == (backend.name == "pytorch")
        alone = moe.experts(x[:1], weights, ids)
        beside = moe.experts(x[:3], *moe.gate(x[:3]))
        assert torch.equal(beside[:1], alone)


def test_pytorch_routing_gives_a_token_the_same_bits_among_any_number_of_tokens():
    """Every token at every position of 1 to 64 tokens routes to the bits it gets alone: the
    sigmoid's vector loop rounds differently in its scalar tail, which an unpadded [T, E] score
    tensor sends the last token of an odd count through (about 3% of values differ there)."""
    config = parse_text_config(tiny_text_config(hidden_size=64), "test")
    route = TorchLayerOps().noaux_route
    args = (config.num_experts_per_tok, config.n_group, config.topk_group, config.norm_topk_prob,
            config.routed_scaling_factor)
    bias = torch.zeros(config.n_routed_experts)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        router = torch.randn(config.n_routed_experts, config.hidden_size, generator=g)
        x = torch.randn(64, config.hidden_size, generator=g)
        alone = [route(x[t : t + 1], router, bias, *args) for t in range(64)]
        for count in range(1, 65):
            weights, ids = route(x[:count], router, bias, *args)
            for t in range(count):
                assert torch.equal(weights[t], alone[t][0][0]) and torch.equal(ids[t], alone[t][1][0]), (seed, count, t)
