"""Quantized checkpoints as published, end to end: Kimi-K2.5 with int4 routed experts made by
compressed-tensors' own compressor, DeepSeek-V3 in FP8 128x128 blocks. eaglet's logits equal
transformers' on the same weights dequantized (compressed-tensors' decompressor; block by block for
FP8), greedy tokens are identical, a request's results do not depend on its batch, and greedy
speculation with a plain EAGLE-3 draft beside the quantized target is lossless."""

import json
import math

import pytest
import torch
from runtime_utils import greedy, prompt_logits

from eaglet import LLM, kernels
from eaglet.backends.pytorch.weights import should_pack
from eaglet.backends.quantized_matrix import QuantizedMatrix
from eaglet.testing.checkpoints import (
    load_reference_deepseek_v3,
    load_reference_kimi_k25,
    read_checkpoint_tensors,
    write_deepseek_v3_checkpoint,
    write_kimi_k25_checkpoint,
)
from eaglet.testing.checkpoints import _write_shards
from eaglet.testing.echo_checkpoints import echo_draft, echo_kimi_target, echo_text_target
from eaglet.testing.images import make_image
from eaglet.testing.quantized_checkpoints import (
    FP8_BLOCK,
    write_decompressed_checkpoint,
    write_fp8_checkpoint,
    write_int4_checkpoint,
)

IMAGE_TOKEN = 250
KIMI_REQUESTS = [
    {"prompt_token_ids": [3, 4, IMAGE_TOKEN, 9, 10, 11], "images": [make_image(40, 28, 0)]},
    {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]},
    {"prompt_token_ids": [20, IMAGE_TOKEN, 21, 22, IMAGE_TOKEN, 23], "images": [make_image(24, 56, 1), make_image(33, 17, 2)]},
    {"prompt_token_ids": list(range(40, 75))},
]
TEXT_PROMPTS = [[3, 17, 33, 2, 99, 100, 7, 45], list(range(10, 79)), [200, 5], [77] * 13]
BACKENDS = pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "pytorch-ops"])
DTYPES = pytest.mark.parametrize("dtype", ["bfloat16", "float32"])


def skip_unless_bfloat16_is_row_exact(cpu_kernels: bool, dtype: str) -> None:
    """The quantized products give a row the same bits in any batch in both dtypes; the bfloat16
    matrices beside them (lm_head, attention) do so on the kernels' tile GEMM, or where oneDNN
    multiplies bfloat16 natively: elsewhere F.linear's emulated bfloat16 GEMM rounds a row by its batch."""
    if dtype == "bfloat16" and not ((cpu_kernels and kernels.tile_backend()) or should_pack(torch.bfloat16)):
        pytest.skip("no row-exact bfloat16 GEMM on this path and CPU")


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory):
    """(int4 checkpoint, its decompressed float32 twin) from a tiny random bfloat16 Kimi-K2.5."""
    root = tmp_path_factory.mktemp("kimi-int4")
    write_kimi_k25_checkpoint(root / "bf16", seed=7, dtype=torch.bfloat16, image_token_id=IMAGE_TOKEN)
    write_int4_checkpoint(root / "bf16", root / "int4")
    return root / "int4", write_decompressed_checkpoint(root / "int4", root / "reference")


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    """(FP8 checkpoint, its block-by-block dequantized float32 twin) from a tiny bfloat16 DeepSeek-V3
    whose widths are not multiples of 128 (padded edge blocks) and exceed 128 in places."""
    root = tmp_path_factory.mktemp("deepseek-fp8")
    write_deepseek_v3_checkpoint(root / "bf16", {"hidden_size": 160, "intermediate_size": 288}, seed=1, dtype=torch.bfloat16)
    write_fp8_checkpoint(root / "bf16", root / "fp8")
    return root / "fp8", dequantize_fp8_checkpoint(root / "fp8", root / "reference")


def dequantize_fp8_checkpoint(src, dst):
    """The reference: every FP8 weight times its block's scale_inv, one 128 x 128 block at a time."""
    stored = read_checkpoint_tensors(src)
    plain = {}
    for name, tensor in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            plain[name] = tensor.float()
            continue
        scale_inv = stored[name + "_scale_inv"]
        weight = torch.empty(tensor.shape)
        for i in range(math.ceil(tensor.shape[0] / FP8_BLOCK)):
            for j in range(math.ceil(tensor.shape[1] / FP8_BLOCK)):
                rows, cols = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
                weight[rows, cols] = tensor[rows, cols].float() * scale_inv[i, j]
        plain[name] = weight
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    _write_shards(dst, plain, 1)
    return dst


def kimi_reference_inputs(llm: LLM, request: dict) -> dict:
    token_ids, mm = llm.engine._prepare_prompt(request)
    inputs = {"input_ids": torch.tensor([token_ids])}
    if mm is not None:
        inputs["pixel_values"], inputs["image_grid_thw"] = mm.pixel_values, mm.grid_thws
    return inputs


def test_int4_checkpoint_is_in_the_published_layout(kimi_int4):
    stored = read_checkpoint_tensors(kimi_int4[0])
    name = "language_model.model.layers.1.mlp.experts.3.down_proj"
    assert stored[f"{name}.weight_packed"].dtype == torch.int32
    assert stored[f"{name}.weight_packed"].shape == (64, 32 // 8)
    assert stored[f"{name}.weight_scale"].shape == (64, 1) and stored[f"{name}.weight_scale"].dtype == torch.bfloat16
    assert stored[f"{name}.weight_shape"].tolist() == [64, 32]
    assert f"{name}.weight" not in stored
    assert "language_model.model.layers.1.mlp.shared_experts.down_proj.weight" in stored
    assert stored["vision_tower.encoder.blocks.0.wqkv.weight"].dtype == torch.bfloat16


@BACKENDS
def test_int4_kimi_loads_codes_not_a_bfloat16_copy(kimi_int4, cpu_kernels):
    llm = LLM(str(kimi_int4[0]), dtype="bfloat16", show_progress=False, cpu_kernels=cpu_kernels)
    experts = llm.engine.model.language_model.model.layers[1].mlp.experts
    assert experts.w13.device.type == "meta" and experts.w2.device.type == "meta"
    held = [m.weight for m in experts.method.per_expert for m in (m.gate_up, m.down)]
    assert all(isinstance(w, QuantizedMatrix) and w.format == "int4" and w.codes.dtype == torch.int32 for w in held)
    # The vision tower is bfloat16 in the file although the ignore list does not name it.
    assert llm.engine.model.vision_tower.encoder.blocks[0].wqkv.weight.dtype == torch.bfloat16


@BACKENDS
def test_int4_kimi_logits_match_transformers(kimi_int4, cpu_kernels):
    llm = LLM(str(kimi_int4[0]), dtype="float32", show_progress=False, cpu_kernels=cpu_kernels)
    reference = load_reference_kimi_k25(kimi_int4[1])
    for request, logits in zip(KIMI_REQUESTS, prompt_logits(llm, KIMI_REQUESTS)):
        with torch.no_grad():
            expected = reference(**kimi_reference_inputs(llm, request)).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_int4_kimi_greedy_tokens_match_transformers(kimi_int4):
    llm = LLM(str(kimi_int4[0]), dtype="float32", show_progress=False)
    reference = load_reference_kimi_k25(kimi_int4[1])
    requests = KIMI_REQUESTS[:3]
    for request, out in zip(requests, llm.generate(requests, greedy(24))):
        inputs = kimi_reference_inputs(llm, request)
        with torch.no_grad():
            generated = reference.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == generated[0, inputs["input_ids"].shape[1]:].tolist()


@BACKENDS
def test_fp8_deepseek_logits_match_transformers(deepseek_fp8, cpu_kernels):
    llm = LLM(str(deepseek_fp8[0]), dtype="float32", show_progress=False, cpu_kernels=cpu_kernels)
    reference = load_reference_deepseek_v3(deepseek_fp8[1])
    ours = prompt_logits(llm, [{"prompt_token_ids": p} for p in TEXT_PROMPTS])
    for prompt, logits in zip(TEXT_PROMPTS, ours):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_fp8_deepseek_greedy_tokens_match_transformers(deepseek_fp8):
    llm = LLM(str(deepseek_fp8[0]), dtype="float32", show_progress=False)
    reference = load_reference_deepseek_v3(deepseek_fp8[1])
    prompts = TEXT_PROMPTS[:2]
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24))):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected


def assert_batch_invariant(llm: LLM, requests: list[dict]) -> None:
    """Each request of a ragged batch gives the bits it gives alone, wherever it sits in the batch."""
    batched_logits = prompt_logits(llm, requests)
    batched_tokens = [o.token_ids for o in llm.generate(requests, greedy(12))]
    reversed_logits = prompt_logits(llm, requests[::-1])[::-1]
    for i, request in enumerate(requests):
        assert torch.equal(batched_logits[i], prompt_logits(llm, [request])[0])
        assert torch.equal(batched_logits[i], reversed_logits[i])
        assert llm.generate([request], greedy(12))[0].token_ids == batched_tokens[i]


@BACKENDS
@DTYPES
def test_int4_kimi_batch_invariance(kimi_int4, cpu_kernels, dtype):
    skip_unless_bfloat16_is_row_exact(cpu_kernels, dtype)
    assert_batch_invariant(LLM(str(kimi_int4[0]), dtype=dtype, show_progress=False, cpu_kernels=cpu_kernels), KIMI_REQUESTS)


@BACKENDS
@DTYPES
def test_int4_a8_kimi_batch_invariance(kimi_int4, cpu_kernels, dtype):
    skip_unless_bfloat16_is_row_exact(cpu_kernels, dtype)
    llm = LLM(str(kimi_int4[0]), dtype=dtype, show_progress=False, cpu_kernels=cpu_kernels, activation_quantization="int8")
    assert llm.engine.backend.int8_activations
    assert_batch_invariant(llm, KIMI_REQUESTS)


def relative_errors(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
    """Per prompt position, |logits - reference| / |reference|."""
    return torch.cat([(a - b).norm(dim=-1) / b.norm(dim=-1) for a, b in zip(logits, reference)])


@BACKENDS
def test_int4_a8_kimi_logits_stay_near_w4a16(kimi_int4, cpu_kernels):
    """int8 activations move the float32 logits (so the engine did quantize them), typically by
    about 1%, a tenth of what int4 weights moved them from bfloat16 (a position whose routing flips
    moves more, hence medians); the kernels and the PyTorch ops, both W4A8, agree to rounding."""
    def logits(path, **kwargs):
        llm = LLM(str(path), dtype="float32", show_progress=False, cpu_kernels=cpu_kernels, **kwargs)
        return prompt_logits(llm, KIMI_REQUESTS)

    bf16, w4a16 = logits(kimi_int4[0].parent / "bf16"), logits(kimi_int4[0])
    ours = logits(kimi_int4[0], activation_quantization="int8")
    activation_error, weight_error = relative_errors(ours, w4a16), relative_errors(w4a16, bf16)
    assert activation_error.min() > 0
    assert activation_error.median() < 0.03
    assert activation_error.median() < 0.25 * weight_error.median()
    if cpu_kernels:
        pytorch_ops = LLM(str(kimi_int4[0]), dtype="float32", show_progress=False, cpu_kernels=False,
                          activation_quantization="int8")
        for a, b in zip(ours, prompt_logits(pytorch_ops, KIMI_REQUESTS)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@BACKENDS
def test_int8_at_load_time_stays_near_bfloat16(kimi_int4, cpu_kernels):
    """``--quantization int8`` (every linear layer): float32 logits a median a few times closer to
    the bfloat16 model's than int4 experts alone put them (8 bits against 4); with int8 activations
    (W8A8) still close, and the kernels and the PyTorch ops agree to rounding at nearly every
    position (their float sums differ in the last bits; a router's near-tie can flip an expert)."""
    plain = kimi_int4[0].parent / "bf16"

    def logits(path, cpu_kernels=cpu_kernels, **kwargs):
        llm = LLM(str(path), dtype="float32", show_progress=False, cpu_kernels=cpu_kernels, **kwargs)
        return prompt_logits(llm, KIMI_REQUESTS)

    bf16, int4_experts = logits(plain), logits(kimi_int4[0])
    int8 = logits(plain, quantization="int8", quantized_layers="all")
    w8a8 = logits(plain, quantization="int8", quantized_layers="all", activation_quantization="int8")
    int8_error, int4_error = relative_errors(int8, bf16), relative_errors(int4_experts, bf16)
    assert 0 < int8_error.median() < 0.25 * int4_error.median()
    assert relative_errors(w8a8, int8).median() < 0.03
    if cpu_kernels:
        pytorch_ops = logits(plain, cpu_kernels=False, quantization="int8", quantized_layers="all",
                             activation_quantization="int8")
        agree = torch.cat([((a - b).abs().amax(-1) < 1e-4) for a, b in zip(w8a8, pytorch_ops)])
        assert agree.float().mean() > 0.8


@BACKENDS
@DTYPES
@pytest.mark.parametrize("activations", [None, "int8"], ids=["w8a16", "w8a8"])
def test_int8_at_load_time_batch_invariance(kimi_int4, cpu_kernels, dtype, activations):
    skip_unless_bfloat16_is_row_exact(cpu_kernels, dtype)
    llm = LLM(str(kimi_int4[0].parent / "bf16"), dtype=dtype, show_progress=False, cpu_kernels=cpu_kernels,
              quantization="int8", quantized_layers="all", activation_quantization=activations)
    assert isinstance(llm.engine.model.language_model.lm_head.quantized_weight, QuantizedMatrix)
    assert_batch_invariant(llm, KIMI_REQUESTS)


@BACKENDS
@DTYPES
def test_fp8_deepseek_batch_invariance(deepseek_fp8, cpu_kernels, dtype):
    skip_unless_bfloat16_is_row_exact(cpu_kernels, dtype)
    llm = LLM(str(deepseek_fp8[0]), dtype=dtype, show_progress=False, cpu_kernels=cpu_kernels)
    assert_batch_invariant(llm, [{"prompt_token_ids": p} for p in TEXT_PROMPTS])


@pytest.fixture(scope="module")
def speculative_pairs(tmp_path_factory):
    """{format: (quantized echo target, its plain EAGLE-3 draft, requests)}: targets whose tokens
    repeat often enough that drafts are accepted, rejected and completed by bonus tokens."""
    root = tmp_path_factory.mktemp("quantized-spec")
    kimi = echo_kimi_target(root / "kimi", alpha=1.0)
    text = echo_text_target(root / "text", alpha=1.0)
    kimi_draft = echo_draft(kimi, root / "kimi-draft", kind="mla")
    return {
        "int4": (write_int4_checkpoint(kimi, root / "kimi-int4"), kimi_draft, KIMI_REQUESTS),
        "int8-all": (kimi, kimi_draft, KIMI_REQUESTS),  # quantized at load
        "fp8": (write_fp8_checkpoint(text, root / "text-fp8"), echo_draft(text, root / "text-draft", kind="llama"),
                [{"prompt_token_ids": p} for p in TEXT_PROMPTS]),
    }


@BACKENDS
@DTYPES
@pytest.mark.parametrize("fmt", ["int4", "int4-a8", "int8-all-a8", "fp8"])
def test_greedy_speculation_on_a_quantized_target_is_lossless(speculative_pairs, fmt, cpu_kernels, dtype):
    skip_unless_bfloat16_is_row_exact(cpu_kernels, dtype)
    target, draft, requests = speculative_pairs[fmt.removesuffix("-a8")]
    params = greedy(16)
    activations = {"activation_quantization": "int8"} if fmt.endswith("-a8") else {}
    if fmt.startswith("int8-all"):
        activations |= {"quantization": "int8", "quantized_layers": "all"}
    plain = LLM(str(target), dtype=dtype, show_progress=False, cpu_kernels=cpu_kernels, **activations)
    spec = LLM(str(target), dtype=dtype, show_progress=False, cpu_kernels=cpu_kernels, **activations,
               speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft), speculative_num_steps=3,
               speculative_eagle_topk=2, speculative_num_draft_tokens=5, speculative_adaptive=False)
    assert next(spec.engine.spec_worker.draft.parameters()).dtype == getattr(torch, dtype)
    expected = [o.token_ids for o in plain.generate(requests, params)]
    outputs = spec.generate(requests, params)
    assert [o.token_ids for o in outputs] == expected
    assert [spec.generate([r], params)[0].token_ids for r in requests] == expected
    assert sum(o.spec_accepted_tokens for o in outputs) > 0


def test_int4_at_load_time_equals_the_compressed_tensors_checkpoint(kimi_int4):
    """``quantization="int4"`` on the plain bfloat16 checkpoint gives the codes and scales
    compressed-tensors wrote, so the same logits, bit for bit."""
    at_load = LLM(str(kimi_int4[0].parent / "bf16"), dtype="bfloat16", show_progress=False, quantization="int4")
    published = LLM(str(kimi_int4[0]), dtype="bfloat16", show_progress=False)
    experts = at_load.engine.model.language_model.model.layers[1].mlp.experts
    assert experts.w13.device.type == "meta"
    for a, b in zip(prompt_logits(at_load, KIMI_REQUESTS), prompt_logits(published, KIMI_REQUESTS)):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def kimi_int4_all(tmp_path_factory):
    """(plain bfloat16 checkpoint, every language-model linear layer compressed to int4 by
    compressed-tensors, that one decompressed in float32) of a tiny Kimi-K2.5 whose widths are
    multiples of the group of 32."""
    root = tmp_path_factory.mktemp("kimi-int4-all")
    write_kimi_k25_checkpoint(root / "bf16", {"q_lora_rank": 32, "kv_lora_rank": 32}, seed=11, dtype=torch.bfloat16,
                              image_token_id=IMAGE_TOKEN)
    write_int4_checkpoint(root / "bf16", root / "int4", layers="all")
    return root / "bf16", root / "int4", write_decompressed_checkpoint(root / "int4", root / "reference")


@BACKENDS
def test_all_linear_int4_checkpoint_logits_match_transformers(kimi_int4_all, cpu_kernels):
    """Attention, dense and shared MLPs and lm_head stored int4 too (the published layout's names on
    every linear layer) load and match transformers on the decompressed weights."""
    llm = LLM(str(kimi_int4_all[1]), dtype="float32", show_progress=False, cpu_kernels=cpu_kernels)
    language_model = llm.engine.model.language_model
    assert isinstance(language_model.lm_head.quantized_weight, QuantizedMatrix)
    assert isinstance(language_model.model.layers[0].self_attn.kv_b_proj.quantized_weight, QuantizedMatrix)
    reference = load_reference_kimi_k25(kimi_int4_all[2])
    for request, logits in zip(KIMI_REQUESTS, prompt_logits(llm, KIMI_REQUESTS)):
        with torch.no_grad():
            expected = reference(**kimi_reference_inputs(llm, request)).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_all_linear_int4_at_load_time_equals_the_compressed_tensors_checkpoint(kimi_int4_all):
    """``quantized_layers="all"``: every linear layer of the language model quantized at load gives
    the codes and scales compressed-tensors wrote for them, so the same logits, bit for bit; the
    vision tower and the router stay as loaded."""
    at_load = LLM(str(kimi_int4_all[0]), dtype="bfloat16", show_progress=False, quantization="int4",
                  quantized_layers="all")
    published = LLM(str(kimi_int4_all[1]), dtype="bfloat16", show_progress=False)
    model = at_load.engine.model
    layer = model.language_model.model.layers[1]
    held = [model.language_model.lm_head, layer.self_attn.o_proj, layer.self_attn.q_a_proj, layer.mlp.shared_experts.down_proj]
    assert all(m.weight.device.type == "meta" and m.quantized_weight.format == "int4" for m in held)
    assert layer.mlp.gate.weight.dtype == torch.float32 and layer.mlp.gate.weight.device.type == "cpu"
    assert model.vision_tower.encoder.blocks[0].wqkv.weight.dtype == torch.bfloat16
    for a, b in zip(prompt_logits(at_load, KIMI_REQUESTS), prompt_logits(published, KIMI_REQUESTS)):
        assert torch.equal(a, b)


@BACKENDS
@DTYPES
def test_all_linear_int4_a8_batch_invariance(kimi_int4_all, cpu_kernels, dtype):
    """Every matrix of the language model in int4 against int8 activations: no bfloat16 GEMM left
    in it, yet a row's bits still do not depend on its batch."""
    skip_unless_bfloat16_is_row_exact(cpu_kernels, dtype)
    llm = LLM(str(kimi_int4_all[0]), dtype=dtype, show_progress=False, cpu_kernels=cpu_kernels, quantization="int4",
              quantized_layers="all", activation_quantization="int8")
    assert_batch_invariant(llm, KIMI_REQUESTS)


def test_roofline_counts_quantized_experts_as_stored(tmp_path):
    """The bench's read floor counts a routed expert's int4 codes and scales, not bf16 bytes."""
    from eaglet.bench.roofline import step_floor
    from eaglet.layers.moe import RoutedExperts

    write_kimi_k25_checkpoint(tmp_path / "bf16", {"moe_intermediate_size": 64}, seed=3, dtype=torch.bfloat16,
                              image_token_id=IMAGE_TOKEN)
    plain = LLM(str(tmp_path / "bf16"), dtype="bfloat16", show_progress=False)
    int4 = LLM(str(write_int4_checkpoint(tmp_path / "bf16", tmp_path / "int4")), dtype="bfloat16", show_progress=False)
    floors = {}
    for name, llm in (("bf16", plain), ("int4", int4)):
        model = llm.engine.model
        experts = {n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}
        floors[name] = step_floor(model, llm.engine.model_config.text, torch.bfloat16, 1, 8.0,
                                  {n: 2.0 for n in experts}, read_gbps=10.0, gemm_gflops=10.0)["bytes"]
    # int4: 4 bits per weight + one bfloat16 scale per 32 weights = 0.5625 bytes, against 2
    assert floors["int4"]["active_experts"] == pytest.approx(floors["bf16"]["active_experts"] * 0.5625 / 2)
    assert floors["int4"]["dense_weights"] == floors["bf16"]["dense_weights"]
