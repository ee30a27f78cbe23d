"""Products with quantized matrices: the int4 codes read as compressed-tensors packs them, the C++
kernels and the PyTorch form against a float64 product with the dequantized weight, and a row's
bits the same in any batch."""

import pytest
import torch

from eaglet import kernels
from eaglet.backends.cpu.quantized_weights import KernelQuantizedLinear
from eaglet.backends.pytorch.quantized_weights import DequantizingLinear
from eaglet.backends.quantized_matrix import QuantizedMatrix, int8_activation_values, quantize_int8, unpack_int4
from eaglet.testing.quantized_checkpoints import fp8_block_quantize, int4_scheme

LINEARS = [DequantizingLinear, KernelQuantizedLinear]


def int4_matrix(out_features: int, in_features: int, group_size: int, seed: int = 0) -> QuantizedMatrix:
    """A random matrix compressed by compressed-tensors' pack-quantized compressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    scheme = int4_scheme(group_size)
    groups = weight.float().view(out_features, -1, group_size)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.bfloat16()}, scheme)
    return QuantizedMatrix("int4", packed["weight_packed"], packed["weight_scale"], group_size, in_features)


def fp8_matrix(out_features: int, in_features: int, seed: int = 0) -> QuantizedMatrix:
    g = torch.Generator().manual_seed(seed)
    codes, block_scales = fp8_block_quantize(torch.randn(out_features, in_features, generator=g) * 0.05)
    scales = block_scales.repeat_interleave(128, dim=0)[:out_features].contiguous()
    return QuantizedMatrix("fp8", codes, scales, 128, in_features)


def reference(x: torch.Tensor, matrix: QuantizedMatrix) -> torch.Tensor:
    return (x.double() @ matrix.dequantize(torch.float64).t()).float()


def needs_kernels(linear: type) -> None:
    if linear is KernelQuantizedLinear and not kernels.available():
        pytest.skip(f"eaglet CPU kernels unavailable: {kernels.unavailable_reason()}")


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_codes_read_as_compressed_tensors_decompresses_them(group_size):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    matrix = int4_matrix(48, 256, group_size)
    assert torch.equal(unpack_int4(matrix.codes, 256), unpack_from_int32(matrix.codes, 4, torch.Size([48, 256])))
    parts = {"weight_packed": matrix.codes, "weight_scale": matrix.scales.float(), "weight_shape": torch.tensor([48, 256])}
    decompressed = PackedQuantizationCompressor.decompress(parts, int4_scheme(group_size))["weight"]
    assert torch.equal(matrix.dequantize(), decompressed.float())


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("group_size, in_features", [(32, 32), (32, 96), (64, 320), (128, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [False, True], ids=["a16", "a8"])
def test_integer_product(linear, fmt, group_size, in_features, dtype, int8_activations):
    """W4A16 / W8A16, and W4A8 / W8A8: the product with x's int8 values, within a few percent of the
    16-bit activations' (43 outputs: the kernels take weight rows two or four at a time for one or
    two x rows, then one by one)."""
    needs_kernels(linear)
    matrix = (int4_matrix if fmt == "int4" else int8_matrix)(43, in_features, group_size, seed=in_features)
    bias = torch.randn(43)
    for rows in (1, 2, 5):
        x = torch.randn(rows, in_features).to(dtype)
        out = linear(matrix, bias, int8_activations=int8_activations).apply_float(x)
        exact = reference(x, matrix) + bias
        if not int8_activations:
            torch.testing.assert_close(out, exact, atol=2e-4, rtol=1e-5)
            continue
        torch.testing.assert_close(out, reference(int8_activation_values(x), matrix) + bias, atol=2e-4, rtol=1e-5)
        assert not torch.equal(out, exact)
        assert (out - exact).norm() < 0.02 * exact.norm()


def test_int4_rows_split_over_threads_get_the_bits_of_one_thread():
    """A matrix big enough that the kernel splits its outputs over threads, at a count that leaves
    every split a ragged end: the same bits as on one thread, for 1, 2 and 5 x rows."""
    needs_kernels(KernelQuantizedLinear)
    matrix = int4_matrix(1003, 1024, 32, seed=3)
    x = torch.randn(5, 1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [KernelQuantizedLinear(matrix).apply_float(x[:rows]) for rows in (1, 2, 5)]
        torch.set_num_threads(max(2, threads))
        split = [KernelQuantizedLinear(matrix).apply_float(x[:rows]) for rows in (1, 2, 5)]
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(alone, split):
        assert torch.equal(a, b)


def int8_matrix(out_features: int, in_features: int, group_size: int, seed: int = 0) -> QuantizedMatrix:
    g = torch.Generator().manual_seed(seed)
    return quantize_int8(torch.randn(out_features, in_features, generator=g).bfloat16(), group_size)


@pytest.mark.parametrize("group_size", [32, 128])
def test_int8_quantization_is_compressed_tensors_rule(group_size):
    """``quantize_int8`` gives the scales of compressed-tensors' ``calculate_qparams`` and the codes
    of its ``quantize`` for symmetric 8-bit groups (rows of zeros included)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group", group_size=group_size)
    weight = torch.randn(6, 256, generator=torch.Generator().manual_seed(group_size)).bfloat16()
    weight[2] = 0
    groups = weight.float().view(6, -1, group_size)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    matrix = quantize_int8(weight, group_size)
    assert matrix.codes.dtype == torch.int8 and matrix.scales.shape == (6, 256 // group_size)
    nonzero = groups.abs().amax(-1) != 0  # compressed-tensors gives an all-zero group a tiny scale, eaglet 1
    assert torch.equal(matrix.scales[nonzero], scale.bfloat16()[nonzero])
    assert torch.equal(matrix.codes[nonzero.repeat_interleave(group_size, 1)].float(),
                       quantize(weight, scale.bfloat16(), zero_point, args)[nonzero.repeat_interleave(group_size, 1)].float())
    assert torch.equal(matrix.codes[2], torch.zeros(256, dtype=torch.int8))


def test_int8_kernel_refuses_a_width_of_partial_blocks():
    needs_kernels(KernelQuantizedLinear)
    codes, scales = torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="int8_linear: K a multiple of 32, got 40"):
        torch.ops.eaglet.int8_linear(torch.zeros(1, 40), codes, scales, 32)


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("in_features", [64, 100, 200, 384])
def test_fp8_product(linear, in_features):
    needs_kernels(linear)
    matrix = fp8_matrix(150, in_features, seed=in_features)
    x = torch.randn(6, in_features)
    bias = torch.randn(150)
    out = linear(matrix, bias).apply_float(x)
    torch.testing.assert_close(out, reference(x, matrix) + bias, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_a_row_gets_the_same_bits_in_any_batch(linear, fmt):
    needs_kernels(linear)
    matrix = {"int4": int4_matrix, "int8": int8_matrix}[fmt](97, 256, 32) if fmt != "fp8" else fp8_matrix(97, 256)
    method = linear(matrix)
    x = torch.randn(40, 256)
    full = method.apply_float(x)
    for rows in (1, 2, 3, 5, 8, 17, 33):
        assert torch.equal(method.apply_float(x[:rows]), full[:rows])
        assert torch.equal(method.apply_float(x[rows - 1 : rows + 4]), full[rows - 1 : rows + 4])


def test_int8_activations_follow_q8_0s_rule():
    """Per block of 32: scale absmax / 127, codes round(x / scale) with ties to even, a block of
    zeros stays zero, and a width that is not a multiple of 32 is a short last block."""
    x = torch.zeros(1, 40)
    x[0, :4] = torch.tensor([2.0, 1.0, -0.5, 0.0])
    x[0, 32:35] = torch.tensor([0.1, -0.3, 0.05])
    values = int8_activation_values(x)
    assert values.shape == (1, 40)
    torch.testing.assert_close(values[0, :4] / (2.0 / 127), torch.tensor([127.0, 64.0, -32.0, 0.0]))  # 63.5 -> 64
    assert torch.equal(values[0, 4:32], torch.zeros(28))
    torch.testing.assert_close(values[0, 32:35] / (0.3 / 127), torch.tensor([42.0, -127.0, 21.0]))


def test_int8_activations_leave_fp8_weights_in_float():
    needs_kernels(KernelQuantizedLinear)
    matrix = fp8_matrix(40, 256)
    x = torch.randn(3, 256)
    assert torch.equal(KernelQuantizedLinear(matrix, int8_activations=True).apply_float(x),
                       KernelQuantizedLinear(matrix).apply_float(x))


@pytest.mark.parametrize("fmt", ["int4-a8", "int8", "int8-a8"])
def test_integer_rows_do_not_depend_on_batch_or_threads(fmt):
    """Each row alone, in any batch and on one thread or several: the same bits (outputs split over
    threads with ragged ends, rows 1 to 7 taking every register block)."""
    needs_kernels(KernelQuantizedLinear)
    matrix = (int4_matrix if fmt.startswith("int4") else int8_matrix)(1003, 1024, 32, seed=5)
    method = KernelQuantizedLinear(matrix, int8_activations=fmt.endswith("-a8"))
    x = torch.randn(7, 1024).bfloat16()
    batched = method.apply_float(x)
    for i in range(7):
        assert torch.equal(method.apply_float(x[i : i + 1]), batched[i : i + 1])
        assert torch.equal(method.apply_float(x[i:]), batched[i:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = method.apply_float(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batched)


def stacked(fmt: str, num_experts: int, out_features: int, in_features: int, seed: int) -> QuantizedMatrix:
    def make(e: int) -> QuantizedMatrix:
        if fmt == "fp8":
            return fp8_matrix(out_features, in_features, seed + e)
        return {"int4": int4_matrix, "int8": int8_matrix}[fmt](out_features, in_features, 32, seed + e)

    parts = [make(e) for e in range(num_experts)]
    return QuantizedMatrix(fmt, torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]),
                           parts[0].group_size, in_features)


@pytest.mark.skipif(not kernels.available(), reason="eaglet CPU kernels unavailable")
@pytest.mark.parametrize("fmt", ["int4", "int4-a8", "int8", "int8-a8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7])
def test_routed_experts_in_one_call_give_the_bits_of_the_per_expert_ops(fmt, dtype, tokens):
    """``quantized_routed_experts`` (C++) runs QuantizedExperts' ops in its order: the same bits as
    the Python loop over the chosen experts, for a decode token and a ragged batch of them."""
    from eaglet.backends.cpu.quantized_weights import KernelQuantizedExperts
    from eaglet.backends.pytorch.quantized_weights import QuantizedExperts

    num_experts, hidden, inter, top_k = 6, 64, 96, 3
    base = fmt.removesuffix("-a8")
    w13, w2 = stacked(base, num_experts, 2 * inter, hidden, 1), stacked(base, num_experts, hidden, inter, 50)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)

    def linear(matrix: QuantizedMatrix) -> KernelQuantizedLinear:
        return KernelQuantizedLinear(matrix, int8_activations=fmt.endswith("-a8"))

    one_call_experts = KernelQuantizedExperts(w13, w2, linear, int8_activations=fmt.endswith("-a8"))
    with torch.no_grad():  # under autograd both would run the Python loop
        python = QuantizedExperts(w13, w2, linear).apply(x, weights, ids)
        one_call = one_call_experts.apply(x, weights, ids)
    assert one_call.dtype == dtype and torch.equal(one_call, python)


@pytest.mark.skipif(not kernels.available(), reason="eaglet CPU kernels unavailable")
def test_routed_experts_in_one_call_refuse_bad_input():
    w13, w2 = stacked("int4", 2, 64, 32, 1), stacked("int4", 2, 32, 32, 2)
    x, weights = torch.randn(1, 32), torch.ones(1, 1)
    call = torch.ops.eaglet.quantized_routed_experts
    with pytest.raises(RuntimeError, match="quantized matrix format 'int4', 'int8' or 'fp8', got 'int3'"):
        call(x, w13.codes, w13.scales, w2.codes, w2.scales, 32, "int3", False, weights, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"expert id 2 out of \[0, 2\)"):
        call(x, w13.codes, w13.scales, w2.codes, w2.scales, 32, "int4", False, weights, torch.full((1, 1), 2))
    with pytest.raises(RuntimeError, match="int8 activations run integer weights only"):
        call(x, w13.codes, w13.scales, w2.codes, w2.scales, 32, "fp8", True, weights, torch.zeros(1, 1, dtype=torch.long))
