"""float32 GEMMs of the CPU backend (f32_linear on 8-column panels): a row's bits do not depend on
how many rows share the call or on the thread count, and stay within float32 rounding of the exact
product."""

import pytest
import torch

from eaglet import kernels
from eaglet.backends import cpu_backend
from eaglet.backends.cpu.weights import PanelLinear

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels not built: {kernels.unavailable_reason()}")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    panels = torch.ops.eaglet.f32_pack_weight(weight)
    return torch.ops.eaglet.f32_linear(x, panels, weight.shape[0], bias)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(960, 512, False), (70, 40, True), (13, 700, True)])
def test_a_row_has_the_same_bits_at_any_row_count(out_features, in_features, bias, threads):
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(41, in_features, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = _linear(x, weight, b)
        for rows in (1, 2, 3, 4, 5, 7, 16, 40):
            start = (rows * 7) % (41 - rows + 1)
            assert torch.equal(_linear(x[start : start + rows], weight, b), full[start : start + rows])
    finally:
        torch.set_num_threads(before)
    exact = x.double() @ weight.double().t() + (b.double() if bias else 0)
    # float32 rounding over a chain of in_features products of terms of size ~1/sqrt(in).
    assert (full.double() - exact).abs().max() < 4e-6 * in_features**0.5


def test_empty_batch_and_strided_input():
    weight = torch.randn(24, 16)
    assert _linear(torch.zeros(0, 16), weight, None).shape == (0, 24)
    x = torch.randn(16, 5).t()  # not contiguous
    assert torch.equal(_linear(x, weight, None), _linear(x.contiguous(), weight, None))


def test_rejects_panels_of_another_weight():
    panels = torch.ops.eaglet.f32_pack_weight(torch.randn(24, 16))
    with pytest.raises(RuntimeError, match="f32_pack_weight's"):
        torch.ops.eaglet.f32_linear(torch.randn(2, 16), panels, 40, None)
    with pytest.raises(RuntimeError, match="float32 x"):
        torch.ops.eaglet.f32_linear(torch.randn(2, 16).bfloat16(), panels, 24, None)


def test_the_cpu_backend_multiplies_float32_on_panels():
    weights = cpu_backend().weights
    weight, bias = torch.randn(48, 32), torch.randn(48)
    method = weights.linear(weight, bias)
    assert isinstance(method, PanelLinear)
    x = torch.randn(2, 3, 32)
    with torch.inference_mode():
        out = method.apply(x)
    assert out.shape == (2, 3, 48)
    assert torch.equal(out.view(6, 48), _linear(x.view(6, 32), weight, bias))
    with torch.enable_grad():  # draft training: the parameter itself, so gradients reach it
        weight.requires_grad_(True)
        assert weights.linear(weight).apply(x).requires_grad


@pytest.mark.parametrize("num_tokens", [1, 5, 23])
def test_float32_experts_give_a_token_its_bits_alone(num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    experts, hidden, inter, top_k = 4, 32, 24, 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    method = cpu_backend().weights.experts(w13, w2)
    x = torch.randn(num_tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(num_tokens)])
    scores = torch.rand(num_tokens, top_k, generator=g)
    with torch.inference_mode():
        together = method.apply(x, scores, ids)
        for t in range(num_tokens):
            assert torch.equal(method.apply(x[t : t + 1], scores[t : t + 1], ids[t : t + 1]), together[t : t + 1])
