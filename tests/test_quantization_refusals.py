"""Quantization settings eaglet does not run are refused, each with a message naming the setting:
in config.json (``parse_quantization``) and in the tensors a checkpoint holds (the loader)."""

import copy
import json

import pytest
import torch

from eaglet import LLM
from eaglet.errors import CheckpointError, ConfigError
from eaglet.models.quantization import QuantScheme, parse_quantization
from eaglet.testing.checkpoints import _write_shards, read_checkpoint_tensors, write_kimi_k25_checkpoint
from eaglet.testing.quantized_checkpoints import FP8_QUANTIZATION_CONFIG, int4_quantization_config, write_int4_checkpoint

INT4 = int4_quantization_config(32)


def int4_with(**weights) -> dict:
    config = copy.deepcopy(INT4)
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


def edited(config: dict, **changes) -> dict:
    return {**copy.deepcopy(config), **changes}


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_group_sizes_run(group_size):
    assert parse_quantization({"quantization_config": int4_with(group_size=group_size)}) == QuantScheme("int4", group_size)


def test_fp8_blocks_run():
    assert parse_quantization({"quantization_config": FP8_QUANTIZATION_CONFIG}) == QuantScheme("fp8", 128, 128)


@pytest.mark.parametrize(
    "quantization, message",
    [
        (int4_with(group_size=16), r"group_size=16 is not supported; eaglet runs int4 groups of 32, 64, 128"),
        (int4_with(group_size=None, strategy="channel"), r"strategy='channel'"),
        (int4_with(symmetric=False), r"symmetric=False .*asymmetric"),
        (int4_with(actorder="group"), r"actorder='group' .*GPTQ activation ordering"),
        (int4_with(num_bits=8), r"num_bits=8"),
        (int4_with(type="float"), r"type='float' .*FP4/NVFP4/MXFP4"),
        (int4_with(dynamic=True), r"dynamic=True"),
        (edited(INT4, format="nvfp4-pack-quantized"), r"format='nvfp4-pack-quantized'"),
        (edited(INT4, format="mxfp4-pack-quantized"), r"format='mxfp4-pack-quantized'"),
        (edited(INT4, format="naive-quantized"), r"format='naive-quantized'"),
        (edited(INT4, quantization_status="frozen"), r"quantization_status='frozen'"),
        (edited(INT4, kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme is set"),
        (edited(INT4, config_groups={**INT4["config_groups"], "group_1": INT4["config_groups"]["group_0"]}),
         r"exactly one quantization group, got 2"),
        ({**INT4, "config_groups": {"group_0": {**INT4["config_groups"]["group_0"],
                                                "input_activations": {"num_bits": 8, "type": "int"}}}},
         r"input_activations is set .*W4A16"),
        ({"quant_method": "mxfp4"}, r"quant_method='mxfp4' is not supported"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, r"quant_method='gptq' is not supported"),
        ({"quant_method": "awq"}, r"quant_method='awq' is not supported"),
        (edited(FP8_QUANTIZATION_CONFIG, fmt="e5m2"), r"fmt='e5m2'"),
        (edited(FP8_QUANTIZATION_CONFIG, activation_scheme="static"), r"activation_scheme='static'"),
        (edited(FP8_QUANTIZATION_CONFIG, weight_block_size=[64, 64]), r"weight_block_size=\[64, 64\]"),
        (edited(FP8_QUANTIZATION_CONFIG, weight_block_size=None), r"weight_block_size=None"),
        ("fp8", r"must be an object"),
    ],
)
def test_unsupported_settings_are_refused_by_name(quantization, message):
    with pytest.raises(ConfigError, match=message):
        parse_quantization({"quantization_config": quantization})


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    write_kimi_k25_checkpoint(root / "bf16", {"num_hidden_layers": 2}, seed=3, dtype=torch.bfloat16)
    return write_int4_checkpoint(root / "bf16", root / "int4", num_shards=1)


def rewrite(checkpoint, dst, edit_tensors=None, edit_config=None):
    """A copy of ``checkpoint`` with its tensors and config.json edited."""
    dst.mkdir()
    tensors = read_checkpoint_tensors(checkpoint)
    if edit_tensors:
        edit_tensors(tensors)
    config = json.loads((checkpoint / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "preprocessor_config.json").write_text((checkpoint / "preprocessor_config.json").read_text())
    _write_shards(dst, tensors, 1)
    return dst


EXPERT = "language_model.model.layers.1.mlp.experts.0.up_proj"


def test_a_refused_setting_stops_loading(int4_checkpoint, tmp_path):
    def asymmetric(config):
        for quant in (config["quantization_config"], config["text_config"]["quantization_config"]):
            quant["config_groups"]["group_0"]["weights"]["symmetric"] = False

    with pytest.raises(ConfigError, match="symmetric=False"):
        LLM(str(rewrite(int4_checkpoint, tmp_path / "m", edit_config=asymmetric)), show_progress=False)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.__setitem__(f"{EXPERT}.weight_zero_point", torch.zeros(1, 8, dtype=torch.int32)),
         rf"{EXPERT}.weight_zero_point: an asymmetric scheme \(zero points\) is not supported"),
        (lambda t: t.__setitem__(f"{EXPERT}.weight_g_idx", torch.zeros(64, dtype=torch.int32)),
         rf"{EXPERT}.weight_g_idx: GPTQ activation ordering \(g_idx\) is not supported"),
        (lambda t: t.pop(f"{EXPERT}.weight_scale"), rf"{EXPERT}.weight: int4 weight without {EXPERT}.weight_scale"),
        (lambda t: t.__setitem__(f"{EXPERT}.weight_scale", torch.ones(32, 1, dtype=torch.bfloat16)),
         r"do not describe one \[out, in\] matrix in groups of 32"),
        (lambda t: t.update({"vision_tower.encoder.blocks.0.mlp.fc0.weight":
                             t["vision_tower.encoder.blocks.0.mlp.fc0.weight"].to(torch.float8_e4m3fn),
                             "vision_tower.encoder.blocks.0.mlp.fc0.weight_scale_inv": torch.ones(1, 1)}),
         r"fc0.weight: stored fp8 but quantization_config is QuantScheme\(format='int4'"),
        (lambda t: t.__setitem__("language_model.lm_head.weight", t["language_model.lm_head.weight"].to(torch.float8_e5m2)),
         r"lm_head.weight: fp8 dtype F8_E5M2 is not supported"),
    ],
    ids=["zero-point", "g_idx", "no-scale", "scale-shape", "fp8-under-int4-config", "e5m2"],
)
def test_unsupported_tensors_are_refused_by_name(int4_checkpoint, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        LLM(str(rewrite(int4_checkpoint, tmp_path / "m", edit_tensors=edit)), show_progress=False)


def test_a_quantized_tensor_where_eaglet_runs_plain_weights_is_refused(int4_checkpoint, tmp_path):
    """The vision tower runs bfloat16 only: an int4 vision weight is named, not mis-run."""
    def quantize_vision(tensors):
        name = "vision_tower.encoder.blocks.0.mlp.fc0"
        out, inp = tensors[f"{name}.weight"].shape
        del tensors[f"{name}.weight"]
        tensors[f"{name}.weight_packed"] = torch.zeros(out, inp // 8, dtype=torch.int32)
        tensors[f"{name}.weight_scale"] = torch.ones(out, inp // 32, dtype=torch.bfloat16)
        tensors[f"{name}.weight_shape"] = torch.tensor([out, inp], dtype=torch.int32)

    with pytest.raises(CheckpointError, match=r"stored quantized where eaglet runs only plain weights: vision_tower"):
        LLM(str(rewrite(int4_checkpoint, tmp_path / "m", edit_tensors=quantize_vision)), show_progress=False)


def test_quantized_tensors_without_a_quantization_config_are_refused(int4_checkpoint, tmp_path):
    def drop(config):
        del config["quantization_config"], config["text_config"]["quantization_config"]

    with pytest.raises(CheckpointError, match=r"stored int4 \(weight_packed\) but quantization_config is None"):
        LLM(str(rewrite(int4_checkpoint, tmp_path / "m", edit_config=drop)), show_progress=False)


def test_experts_partly_quantized_are_refused_before_loading(int4_checkpoint, tmp_path):
    def dequantize_one(tensors):
        packed = tensors.pop(f"{EXPERT}.weight_packed")
        tensors.pop(f"{EXPERT}.weight_scale"), tensors.pop(f"{EXPERT}.weight_shape")
        tensors[f"{EXPERT}.weight"] = torch.zeros(packed.shape[0], packed.shape[1] * 8, dtype=torch.bfloat16)

    with pytest.raises(CheckpointError, match=r"stored in different forms: language_model.model.layers.1.mlp.experts \(int4, plain\)"):
        LLM(str(rewrite(int4_checkpoint, tmp_path / "m", edit_tensors=dequantize_one)), show_progress=False)


def test_int8_activations_need_int4_weights(int4_checkpoint, tmp_path):
    plain = int4_checkpoint.parent / "bf16"
    with pytest.raises(ConfigError, match=r"has no quantization_config; add --quantization int4"):
        LLM(str(plain), show_progress=False, activation_quantization="int8")
    with pytest.raises(ConfigError, match=r"the one activation quantization is 'int8'"):
        LLM(str(int4_checkpoint), show_progress=False, activation_quantization="fp8")
    # Quantized at load time, the plain checkpoint runs W4A8 too.
    llm = LLM(str(plain), show_progress=False, quantization="int4", activation_quantization="int8")
    assert llm.engine.backend.int8_activations


def test_quantized_layers_settings_are_refused(int4_checkpoint):
    plain = int4_checkpoint.parent / "bf16"
    with pytest.raises(ConfigError, match=r"quantized_layers='all' needs a quantization \(int4\)"):
        LLM(str(plain), show_progress=False, quantized_layers="all")
    with pytest.raises(ConfigError, match=r"quantized_layers='attention': choose one of \('experts', 'all'\)"):
        LLM(str(plain), show_progress=False, quantization="int4", quantized_layers="attention")
    with pytest.raises(ConfigError, match=r"quantization 'int2' is not supported at load time; choose one of \('int4', 'int8'\)"):
        LLM(str(plain), show_progress=False, quantization="int2")


def test_all_layers_keep_the_matrices_groups_do_not_divide(int4_checkpoint, caplog):
    """The tiny model's q_b_proj reads 24 columns (q_lora_rank) and kv_b_proj 16 (kv_lora_rank):
    ``quantized_layers="all"`` keeps them as loaded, says so, and quantizes the rest."""
    plain = int4_checkpoint.parent / "bf16"
    with caplog.at_level("WARNING", logger="eaglet.models.load_time_quantization"):
        llm = LLM(str(plain), show_progress=False, quantization="int4", quantized_layers="all")
    assert "4 matrices kept as loaded" in caplog.text and "layers.0.self_attn.q_b_proj" in caplog.text
    attention = llm.engine.model.language_model.model.layers[1].self_attn
    assert attention.q_b_proj.quantized_weight is None and attention.kv_b_proj.quantized_weight is None
    assert attention.o_proj.quantized_weight is not None and attention.q_a_proj.quantized_weight is not None
