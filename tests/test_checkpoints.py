"""Tests of the tiny published-format checkpoint fixtures in eaglet/testing/checkpoints.py."""

from __future__ import annotations

import json
import pathlib
import re
import time

import pytest
import torch

from eaglet.testing import checkpoints as C

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _config(path: pathlib.Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _assert_clean_load(info: dict) -> None:
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), f"{key}: {sorted(info[key])[:10]}"


def _assert_state_matches(model, path: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every reference parameter equals the written tensor after the independent renaming, and
    the inverse renaming gives back exactly the written tensors."""
    written = C.read_checkpoint_tensors(path)
    config = _config(path)
    expected = C.expected_transformers_state(written, config)
    state = model.state_dict()
    assert set(state) == set(expected), (set(state) ^ set(expected))
    for name, value in expected.items():
        got = state[name]
        assert got.shape == value.shape, name
        assert got.dtype == torch.float32, name
        assert torch.equal(got, value.to(torch.float32)), name
    back = C.transformers_state_to_published(expected, config)
    n = config.get("num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers"))
    not_mtp = {k for k in written if not re.search(rf"layers\.(\d+)\.", k) or int(re.search(r"layers\.(\d+)\.", k)[1]) < n}
    assert set(back) == not_mtp
    for name in not_mtp:
        assert torch.equal(back[name], written[name]), name
    return written


def _text_forward(model, vocab: int, *, seed: int = 0, length: int = 16) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, length, vocab)
    assert torch.isfinite(logits).all()
    return logits


# ------------------------------------------------------------------------------------------
# DeepSeek-V3 / Kimi-K2 text checkpoints
# ------------------------------------------------------------------------------------------

TEXT_VARIANTS = {
    "default": dict(overrides=None, num_shards=2),
    "no_q_lora_1_shard": dict(overrides={"q_lora_rank": None}, num_shards=1),
    "yarn_3_shards": dict(overrides={"rope_scaling": YARN}, num_shards=3),
    "all_moe_one_group": dict(overrides={"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}, num_shards=2),
    "two_dense_four_groups": dict(
        overrides={"first_k_dense_replace": 2, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
        num_shards=2,
    ),
    "kimi_k2_bf16_yarn": dict(overrides={"rope_scaling": YARN, "rope_theta": 50000.0}, num_shards=2,
                              model_type="kimi_k2", dtype=torch.bfloat16),
    "attention_bias": dict(overrides={"attention_bias": True}, num_shards=2),
}


@pytest.mark.parametrize("variant", list(TEXT_VARIANTS))
def test_deepseek_variants_load_exactly(tmp_path, variant):
    spec = TEXT_VARIANTS[variant]
    t0 = time.perf_counter()
    path = C.write_deepseek_v3_checkpoint(
        tmp_path / variant, spec["overrides"], seed=3, num_shards=spec["num_shards"],
        dtype=spec.get("dtype", torch.float32), model_type=spec.get("model_type", "deepseek_v3"),
    )
    assert time.perf_counter() - t0 < 2.0
    model, info = C.load_reference_deepseek_v3(path, output_loading_info=True)
    _assert_clean_load(info)
    _assert_state_matches(model, path)

    cfg = _config(path)
    tc = C.tiny_text_config(**(spec["overrides"] or {}))
    hf = model.config
    for key in ("num_hidden_layers", "hidden_size", "q_lora_rank", "kv_lora_rank", "n_group", "topk_group",
                "first_k_dense_replace", "num_experts_per_tok", "routed_scaling_factor", "rms_norm_eps"):
        assert getattr(hf, key) == tc[key] == cfg[key], key
    if tc["rope_scaling"] is not None:
        assert hf.rope_parameters["rope_type"] == "yarn"
        assert hf.rope_parameters["factor"] == YARN["factor"]
        assert hf.rope_parameters["original_max_position_embeddings"] == 128
    else:
        assert hf.rope_parameters["rope_type"] == "default"
    assert hf.rope_parameters["rope_theta"] == tc["rope_theta"]
    assert hf.tie_word_embeddings is False
    logits = _text_forward(model, tc["vocab_size"])
    assert 0.7 < logits.std().item() < 4.0


def test_published_text_config_spellings(tmp_path):
    path = C.write_deepseek_v3_checkpoint(tmp_path / "m", {"rope_scaling": YARN}, dtype=torch.bfloat16)
    cfg = _config(path)
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["rope_scaling"] == YARN and cfg["rope_theta"] == 10000.0
    assert "rope_parameters" not in cfg and "rope_interleave" not in cfg and "head_dim" not in cfg
    assert cfg["num_nextn_predict_layers"] == 0 and cfg["tie_word_embeddings"] is False
    assert "quantization_config" not in cfg and "auto_map" not in cfg


def test_kimi_k2_model_type_needs_the_view(tmp_path):
    """transformers quirk: model_type kimi_k2 loaded as is leaves the experts unfused/random."""
    from transformers import DeepseekV3ForCausalLM

    path = C.write_deepseek_v3_checkpoint(tmp_path / "k2", model_type="kimi_k2")
    _, info = DeepseekV3ForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in info["missing_keys"])
    assert C.transformers_config_dict(_config(path))["model_type"] == "deepseek_v3"


def test_mtp_layer_is_the_only_unexpected_thing(tmp_path):
    path = C.write_deepseek_v3_checkpoint(tmp_path / "mtp", mtp_layers=1)
    cfg = _config(path)
    assert cfg["num_nextn_predict_layers"] == 1
    written = C.read_checkpoint_tensors(path)
    mtp = {k for k in written if k.startswith("model.layers.3.")}
    for leaf in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                 "shared_head.norm.weight", "shared_head.head.weight", "mlp.gate.e_score_correction_bias"):
        assert "model.layers.3." + leaf in mtp
    assert written["model.layers.3.eh_proj.weight"].shape == (64, 128)
    model, info = C.load_reference_deepseek_v3(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # transformers reports them after its expert fusion
    assert set(info["unexpected_keys"]) == set(C.fuse_experts({k: written[k] for k in mtp}))
    _assert_state_matches(model, path)


def test_sharding_and_index(tmp_path):
    one = C.write_deepseek_v3_checkpoint(tmp_path / "one", num_shards=1)
    assert sorted(p.name for p in one.glob("*.safetensors")) == ["model.safetensors"]
    assert not (one / C.INDEX_NAME).exists()
    three = C.write_deepseek_v3_checkpoint(tmp_path / "three", num_shards=3)
    names = sorted(p.name for p in three.glob("*.safetensors"))
    assert names == [f"model-0000{i}-of-000003.safetensors" for i in (1, 2, 3)]
    index = json.loads((three / C.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == set(names)
    a, b = C.read_checkpoint_tensors(one), C.read_checkpoint_tensors(three)
    assert set(a) == set(b) == set(index["weight_map"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in b.values())


def test_deterministic_and_randomised(tmp_path):
    a = C.read_checkpoint_tensors(C.write_deepseek_v3_checkpoint(tmp_path / "a", seed=5))
    b = C.read_checkpoint_tensors(C.write_deepseek_v3_checkpoint(tmp_path / "b", seed=5))
    c = C.read_checkpoint_tensors(C.write_deepseek_v3_checkpoint(tmp_path / "c", seed=6))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a)
    for name, t in a.items():  # nothing is a constant: norms, biases, router bias all random
        assert t.float().std() > 0.01, name
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            assert abs(t.float().mean() - 1.0) < 0.1, name


def test_bf16_dtypes(tmp_path):
    written = C.read_checkpoint_tensors(C.write_kimi_k25_checkpoint(tmp_path / "k", dtype=torch.bfloat16))
    for name, t in written.items():
        want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert t.dtype == want, name
    assert _config(tmp_path / "k")["torch_dtype"] == "bfloat16"


def test_logits_not_degenerate(tmp_path):
    model = C.load_reference_deepseek_v3(C.write_deepseek_v3_checkpoint(tmp_path / "m"))
    logits = _text_forward(model, 256, seed=1, length=32)
    top2 = logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    assert 1.0 < logits.std().item() < 3.0
    assert (margin > 1e-3).float().mean() > 0.95
    assert margin.median() > 0.1


# ------------------------------------------------------------------------------------------
# Kimi-K2.5
# ------------------------------------------------------------------------------------------

KIMI_VARIANTS = {
    "published": dict(config_style="published", num_shards=2, text=None),
    "published_yarn_noqlora_3_shards": dict(config_style="published", num_shards=3,
                                            text={"rope_scaling": YARN, "q_lora_rank": None}),
    "transformers": dict(config_style="transformers", num_shards=2, text=None),
    "transformers_1_shard_yarn": dict(config_style="transformers", num_shards=1, text={"rope_scaling": YARN}),
}


@pytest.mark.parametrize("variant", list(KIMI_VARIANTS))
def test_kimi_variants_load_exactly(tmp_path, variant):
    spec = KIMI_VARIANTS[variant]
    t0 = time.perf_counter()
    path = C.write_kimi_k25_checkpoint(tmp_path / variant, spec["text"], seed=11,
                                       num_shards=spec["num_shards"], config_style=spec["config_style"])
    assert time.perf_counter() - t0 < 2.0
    model, info = C.load_reference_kimi_k25(path, output_loading_info=True)
    _assert_clean_load(info)
    written = _assert_state_matches(model, path)

    # the wqkv permutation is real (not the identity) and round-trips
    heads = C.tiny_vision_config()["num_attention_heads"]
    wqkv = written["vision_tower.encoder.blocks.0.wqkv.weight"]
    q_pub = wqkv.chunk(3)[0]
    q_hf = model.model.vision_tower.layers[0].attn.q_proj.weight.detach()
    assert not torch.equal(q_hf, q_pub)
    assert torch.equal(C.vision_qkv_rotate_half_to_interleaved(q_hf, heads), q_pub)
    bias = written["vision_tower.encoder.blocks.1.wqkv.bias"].chunk(3)[1]
    assert torch.equal(model.model.vision_tower.layers[1].attn.k_proj.bias.detach(),
                       C.vision_qkv_interleaved_to_rotate_half(bias, heads))
    # and the fused experts are the per-expert tensors
    gu = model.model.language_model.layers[1].mlp.experts.gate_up_proj.detach()
    e3 = "language_model.model.layers.1.mlp.experts.3."
    assert torch.equal(gu[3], torch.cat([written[e3 + "gate_proj.weight"], written[e3 + "up_proj.weight"]]))

    cfg = model.config
    assert cfg.image_token_id == 250
    assert cfg.tie_word_embeddings is False
    assert cfg.vision_config.hidden_size == 32 and cfg.vision_config.num_hidden_layers == 2
    assert cfg.projection_hidden_size == 32
    assert cfg.text_config.model_type == "deepseek_v3"


def _image_forward(model, *, grid=(6, 8), seed=0):
    p = C.tiny_vision_config()["patch_size"]
    pixel_values, image_grid_thw = C.random_image_inputs([grid], p, seed=seed)
    n_tokens = grid[0] * grid[1] // 4
    ids = torch.tensor([[0, 5, 6, 7] + [250] * n_tokens + [9, 30, 31, 32]])
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    return out, ids, pixel_values, image_grid_thw


def test_kimi_image_forward_and_styles_agree(tmp_path):
    pub = C.load_reference_kimi_k25(C.write_kimi_k25_checkpoint(tmp_path / "pub", seed=4))
    hf = C.load_reference_kimi_k25(C.write_kimi_k25_checkpoint(tmp_path / "hf", seed=4, config_style="transformers"))
    out, ids, pixel_values, grid = _image_forward(pub)
    assert out.logits.shape == (1, ids.shape[1], 256)
    assert torch.isfinite(out.logits).all()
    assert 0.7 < out.logits.std().item() < 4.0
    out2, *_ = _image_forward(hf)
    assert torch.equal(out.logits, out2.logits)
    # the image changes the logits, and the features have one row per placeholder
    with torch.no_grad():
        feats = pub.model.get_image_features(pixel_values, grid).pooler_output
        other = pub(input_ids=ids, pixel_values=torch.flip(pixel_values, [0]), image_grid_thw=grid).logits
    assert [f.shape for f in feats] == [(12, 64)]
    assert torch.isfinite(feats[0]).all() and feats[0].std() > 0.1
    assert not torch.allclose(other, out.logits)
    # two images of different grids in one prompt
    pv, g = C.random_image_inputs([(4, 4), (2, 6)], 4, seed=2)
    ids2 = torch.tensor([[1] + [250] * 4 + [2, 3] + [250] * 3 + [4]])
    with torch.no_grad():
        logits = pub(input_ids=ids2, pixel_values=pv, image_grid_thw=g).logits
    assert torch.isfinite(logits).all()


def test_kimi_text_only_forward(tmp_path):
    model = C.load_reference_kimi_k25(C.write_kimi_k25_checkpoint(tmp_path / "k"))
    _text_forward(model, 256)


def test_kimi_config_styles(tmp_path):
    pub = _config(C.write_kimi_k25_checkpoint(tmp_path / "p", image_token_id=200))
    assert pub["architectures"] == ["KimiK25ForConditionalGeneration"] and pub["model_type"] == "kimi_k25"
    assert pub["media_placeholder_token_id"] == 200 and "image_token_id" not in pub
    assert pub["text_config"]["model_type"] == "kimi_k2"
    assert pub["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "rope_theta" in pub["text_config"] and "rope_parameters" not in pub["text_config"]
    vc = pub["vision_config"]
    assert vc["vt_hidden_size"] == 32 and vc["vt_num_hidden_layers"] == 2 and vc["vt_num_attention_heads"] == 2
    assert vc["vt_intermediate_size"] == 48 and vc["init_pos_emb_height"] == vc["init_pos_emb_width"] == 8
    assert vc["init_pos_emb_time"] == 4 and vc["merge_kernel_size"] == [2, 2] and vc["patch_size"] == 4
    assert vc["mm_hidden_size"] == 32 and vc["text_hidden_size"] == 64 and vc["projector_ln_eps"] == 1e-5
    assert pub["tie_word_embeddings"] is False

    hf = _config(C.write_kimi_k25_checkpoint(tmp_path / "t", config_style="transformers", image_token_id=200))
    assert hf["architectures"] == ["Kimi_K25ForConditionalGeneration"]
    assert hf["image_token_id"] == 200 and "media_placeholder_token_id" not in hf
    assert hf["vision_config"]["hidden_size"] == 32 and hf["vision_config"]["pos_emb_height"] == 8
    assert hf["projection_hidden_size"] == 32 and hf["tie_word_embeddings"] is False
    assert hf["text_config"]["model_type"] == "deepseek_v3" and "rope_parameters" in hf["text_config"]
    assert hf["text_config"]["num_nextn_predict_layers"] == 0

    pre = json.loads((tmp_path / "p" / "preprocessor_config.json").read_text())
    assert pre["patch_size"] == 4 and pre["merge_size"] == 2 and pre["max_patches"] == 256
    assert pre["size"]["max_height"] == pre["size"]["max_width"]
    assert pre["image_mean"] == pre["image_std"] == [0.5, 0.5, 0.5]
    assert pre["media_proc_cfg"]["in_patch_limit"] == 256 and pre["media_proc_cfg"]["patch_size"] == 4


def test_published_view_is_only_a_config_rewrite(tmp_path):
    src = C.write_kimi_k25_checkpoint(tmp_path / "src")
    dst = C.to_transformers_config_dir(src, tmp_path / "view")
    for f in src.iterdir():
        if f.name != "config.json":
            assert (dst / f.name).resolve() == f.resolve()
    cfg = _config(dst)
    assert cfg["image_token_id"] == 250 and cfg["vision_config"]["num_attention_heads"] == 2


def test_patchify_raster_order():
    pixels = torch.arange(3 * 8 * 12, dtype=torch.float32).reshape(3, 8, 12)
    pv, grid = C.patchify_image(pixels, 4)
    assert pv.shape == (6, 3, 4, 4) and grid.tolist() == [[1, 2, 3]]
    r, c = 1, 2
    assert torch.equal(pv[r * 3 + c], pixels[:, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4])


# ------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------


def test_tokenizer_kimi(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    path = C.write_kimi_k25_checkpoint(tmp_path / "k", with_tokenizer=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == 256
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(256))
    assert tok.convert_tokens_to_ids("<|media_pad|>") == 250
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.pad_token_id == 255
    cfg = _config(path)
    assert cfg["bos_token_id"] == 0 and cfg["eos_token_id"] == 1
    gen = GenerationConfig.from_pretrained(str(path))
    assert gen.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" in text
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(250) == 1 and max(ids) < 256
    assert tok.decode(ids) == text
    plain = "def f(x):\n    return x + 1  # The quick brown fox."
    assert tok.decode(tok(plain, add_special_tokens=False).input_ids) == plain
    assert len(tok(plain, add_special_tokens=False).input_ids) < len(plain)  # merges happened


def test_tokenizer_deepseek_and_extra_tokens(tmp_path):
    from transformers import AutoTokenizer

    path = C.write_deepseek_v3_checkpoint(tmp_path / "d", {"vocab_size": 512}, with_tokenizer=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == 512 and tok.bos_token == "<｜begin▁of▁sentence｜>" and tok.eos_token_id == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>"
    s = "héllo wörld ✓"  # 512 ids leave room for the full byte alphabet
    assert tok.decode(tok(s, add_special_tokens=False).input_ids) == s

    C.write_tiny_tokenizer(tmp_path / "x", 300, extra_special_tokens={"<think>": 297, "</think>": 12})
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "x"))
    assert len(tok) == 300
    assert tok.convert_tokens_to_ids("<think>") == 297 and tok.convert_tokens_to_ids("</think>") == 12
    assert tok("a<think>b", add_special_tokens=False).input_ids.count(297) == 1
    with pytest.raises(ValueError, match="collide"):  # 299 is [PAD] (the top id) in the Kimi set
        C.write_tiny_tokenizer(tmp_path / "y", 300, extra_special_tokens={"<think>": 299})


def test_tiny_configs_validate():
    with pytest.raises(ValueError):
        C.tiny_text_config(n_group=3)
    with pytest.raises(ValueError):
        C.tiny_text_config(n_group=8, topk_group=1)  # one expert per group
    with pytest.raises(ValueError):
        C.tiny_vision_config(hidden_size=24, num_attention_heads=4)  # head dim 6
    from transformers import DeepseekV3Config, Kimi_K25VisionConfig

    DeepseekV3Config(**C.tiny_text_config(rope_scaling=YARN))
    Kimi_K25VisionConfig(**C.tiny_vision_config())
