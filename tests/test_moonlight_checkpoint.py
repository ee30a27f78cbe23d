"""The real-size Moonlight-16B-A3B benchmark checkpoint (eaglet.bench.moonlight_checkpoint), on tiny
shapes through the same code: its int4 routed experts are compressed-tensors' pack-quantized
format (eaglet equals transformers on compressed-tensors' decompression of them), the echo dial
and its EAGLE-3 draft accept, the cache directory is written once and rewritten when incomplete,
and the full-size config and size are Moonlight's."""

import json

import pytest
import torch
from runtime_utils import greedy, prompt_logits

from eaglet import LLM
from eaglet.bench import moonlight_checkpoint as moonlight
from eaglet.bench.moonlight_checkpoint import expected_tensor_bytes, moonlight_config, moonlight_int4_checkpoint
from eaglet.testing.checkpoints import INDEX_NAME, load_reference_deepseek_v3, read_checkpoint_tensors
from eaglet.testing.quantized_checkpoints import int4_quantization_config, write_decompressed_checkpoint

# Group-divisible widths; rms_norm_eps 1e-6 because transformers builds kv_a_layernorm with 1e-6
# whatever the config says (Moonlight's 1e-5 would differ from eaglet by more than the tolerance).
SMALL = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
)
LAYERS = 3
PROMPTS = [[3, 17, 33, 2, 99, 100, 7, 45], list(range(10, 79)), [900, 5], [77] * 13]


def write(root):
    return moonlight_int4_checkpoint(root, num_hidden_layers=LAYERS, small=SMALL)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write(tmp_path_factory.mktemp("moonlight"))


@pytest.fixture(scope="module")
def reference_dir(checkpoint, tmp_path_factory):
    return write_decompressed_checkpoint(checkpoint["target"], tmp_path_factory.mktemp("moonlight-reference"))


def test_layout_is_kimi_int4_with_bfloat16_elsewhere(checkpoint, reference_dir):
    target = checkpoint["target"]
    config = json.loads((target / "config.json").read_text())
    assert config["quantization_config"] == int4_quantization_config(32)  # as compressed-tensors writes it
    index = json.loads((target / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == 2  # shard by shard, layers never split
    assert index["metadata"]["total_size"] == expected_tensor_bytes(config)
    assert checkpoint["file_bytes"] > index["metadata"]["total_size"]
    stored = read_checkpoint_tensors(target)
    for name, tensor in stored.items():
        if ".mlp.experts." in name:
            continue
        expected = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert tensor.dtype == expected, name
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in stored
    assert "model.layers.0.mlp.down_proj.weight" in stored and "model.layers.0.self_attn.q_proj.weight" in stored
    assert torch.equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"])  # the echo dial

    base = "model.layers.2.mlp.experts.5.down_proj."
    packed, scale = stored[base + "weight_packed"], stored[base + "weight_scale"]
    assert packed.dtype == torch.int32 and packed.shape == (256, 128 // 8)
    assert scale.dtype == torch.bfloat16 and scale.shape == (256, 128 // 32)
    assert stored[base + "weight_shape"].dtype == torch.int32 and stored[base + "weight_shape"].tolist() == [256, 128]
    assert base + "weight" not in stored
    # The packing as documented (8 codes a word, + 8, least significant nibble first), checked
    # against compressed-tensors' own decompression.
    nibbles = torch.stack([(packed >> (4 * k)) & 0xF for k in range(8)], dim=-1).reshape(256, 128) - 8
    decompressed = read_checkpoint_tensors(reference_dir)[base + "weight"]
    assert torch.equal(decompressed, nibbles.float() * scale.float().repeat_interleave(32, dim=1))
    # The echo dial scales a routed expert's down_proj scales by alpha (0.05) against its gate_proj's.
    gate_scale = stored["model.layers.2.mlp.experts.5.gate_proj.weight_scale"].float()
    assert scale.float().mean() / gate_scale.mean() == pytest.approx(0.05 * (256 / 128) ** 0.5, rel=0.1)


def test_eaglet_matches_transformers_on_the_decompressed_weights(checkpoint, reference_dir):
    llm = LLM(str(checkpoint["target"]), dtype="float32", show_progress=False)
    reference = load_reference_deepseek_v3(reference_dir)
    for prompt, logits in zip(PROMPTS, prompt_logits(llm, [{"prompt_token_ids": p} for p in PROMPTS])):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        # The echo dial's logit of the current token is about hidden_size (its embedding's squared
        # norm), where float32's spacing is 3e-5: 1e-4 absolute, plus 1e-6 relative (8 ulp) there.
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-6)
    prompts = PROMPTS[:2]
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16))):
        with torch.no_grad():
            generated = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
        assert out.token_ids == generated[0, len(prompt):].tolist()


@pytest.mark.parametrize("activations, layers", [(None, "experts"), ("int8", "experts"), ("int8", "all")],
                         ids=["w4a16", "w4a8", "w4a8-all-linear"])
def test_echo_dial_with_its_draft_is_lossless_and_accepts(checkpoint, activations, layers):
    draft_config = json.loads((checkpoint["draft"] / "config.json").read_text())
    assert draft_config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert draft_config["torch_dtype"] == "bfloat16" and draft_config["q_lora_rank"] == 256 * 3 // 4
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    quantization = {"activation_quantization": activations}
    if layers == "all":
        quantization |= {"quantization": "int4", "quantized_layers": "all"}
    plain = LLM(str(checkpoint["target"]), dtype="float32", show_progress=False, **quantization)
    spec = LLM(str(checkpoint["target"]), dtype="float32", show_progress=False, **quantization,
               speculative_algorithm="EAGLE3",
               speculative_draft_model_path=str(checkpoint["draft"]), speculative_num_steps=3,
               speculative_eagle_topk=1, speculative_num_draft_tokens=4, speculative_adaptive=False)
    expected = [o.token_ids for o in plain.generate(requests, greedy(16))]
    assert [o.token_ids for o in spec.generate(requests, greedy(16))] == expected
    assert spec.spec_metrics()["accept_length"] > 1.5


def test_written_once_and_rewritten_when_the_marker_is_missing(tmp_path, capsys):
    first = write(tmp_path)
    out = first["target"].parent
    marker = out / moonlight.MARKER
    shards = sorted(first["target"].glob("*.safetensors"))
    stamps = {f: f.stat().st_mtime_ns for f in [marker, *shards]}
    capsys.readouterr()
    assert write(tmp_path) == first
    assert {f: f.stat().st_mtime_ns for f in stamps} == stamps
    assert capsys.readouterr().out == ""  # nothing generated

    # A killed run: shards there, marker not yet; a leftover file shows the directory is rebuilt.
    contents = {f.name: f.read_bytes() for f in shards}
    marker.unlink()
    (out / "leftover").write_text("partial")
    assert write(tmp_path) == first
    assert marker.is_file() and not (out / "leftover").exists()
    assert {f.name: f.read_bytes() for f in sorted(first["target"].glob("*.safetensors"))} == contents  # seeded

    # A marker for another key (e.g. an older generator) does not count either.
    marker.write_text("{}")
    write(tmp_path)
    assert json.loads(marker.read_text())["config"] == moonlight_config(LAYERS, SMALL)


def test_full_size_is_moonlight():
    config = moonlight_config()
    published = dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=163840, hidden_size=2048,
        intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.446, scoring_func="sigmoid", topk_method="noaux_tc",
        norm_topk_prob=True, rope_theta=50000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    assert {k: config[k] for k in published} == published
    assert 9e9 < expected_tensor_bytes(config) < 12e9
    # Shards of whole layers, about 1 GB each.
    shards = moonlight._shards(moonlight._units(config, alpha=0.05, seed=0))
    assert all(0.5e9 < sum(u.nbytes for u in shard) <= moonlight.SHARD_BYTES for shard in shards)
    with pytest.raises(ValueError, match="group size"):
        moonlight_config(small={"moe_intermediate_size": 100})
    with pytest.raises(ValueError, match="may override"):
        moonlight_config(small={"q_lora_rank": 64})
