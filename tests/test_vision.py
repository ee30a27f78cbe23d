"""MoonViT tower + projector parity with transformers' Kimi-K2.5, on tiny random published checkpoints."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eaglet.testing.checkpoints import (
    load_reference_kimi_k25,
    random_image_inputs,
    read_checkpoint_tensors,
    vision_qkv_interleaved_to_rotate_half,
    write_kimi_k25_checkpoint,
)
from eaglet.errors import ConfigError, InvalidRequestError
from eaglet.models.kimi_k25_vision import KimiPositionEmbedding, KimiProjector, KimiVisionConfig, KimiVisionTower

TOL = 1e-5
# A 6 x 6 position table, so (1, 8, 8) and (1, 4, 6) both resample it and (1, 6, 6) does not.
VISION = {"pos_emb_height": 6, "pos_emb_width": 6}


def _load_eaglet(path: Path) -> tuple[KimiVisionTower, KimiProjector]:
    config = KimiVisionConfig.from_hf(json.loads((path / "config.json").read_text()))
    tensors = read_checkpoint_tensors(path)
    tower, projector = KimiVisionTower(config), KimiProjector(config)
    # strict: every published name is consumed and nothing is left unfilled
    tower.load_state_dict(
        {k.removeprefix("vision_tower."): v for k, v in tensors.items() if k.startswith("vision_tower.")}
    )
    projector.load_state_dict(
        {k.removeprefix("mm_projector."): v for k, v in tensors.items() if k.startswith("mm_projector.")}
    )
    return tower.eval(), projector.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = write_kimi_k25_checkpoint(tmp_path_factory.mktemp("kimi_vision"), vision_overrides=VISION, seed=3)
    reference = load_reference_kimi_k25(path)
    reference.config.vision_config._attn_implementation = "eager"
    tower, projector = _load_eaglet(path)
    return path, reference.model, tower, projector


def _reference(model, pixel_values, grid_thws):
    with torch.no_grad():
        merged = model.vision_tower(pixel_values, grid_thw=grid_thws).pooler_output
        projected = torch.cat(model.get_image_features(pixel_values, grid_thws).pooler_output)
    return merged, projected


def _eaglet(tower, projector, pixel_values, grid_thws):
    with torch.no_grad():
        merged = tower(pixel_values, grid_thws)
        return merged, projector(merged)


@pytest.mark.parametrize("grid", [(8, 8), (4, 6), (6, 6), (10, 4)])
def test_single_image_parity(models, grid):
    _, reference, tower, projector = models
    pixel_values, grid_thws = random_image_inputs([grid], patch_size=4, seed=sum(grid))
    ref_merged, ref_out = _reference(reference, pixel_values, grid_thws)
    merged, out = _eaglet(tower, projector, pixel_values, grid_thws)
    h, w = grid
    assert merged.shape == (h * w // 4, 4, 32)
    assert out.shape == ref_out.shape == (h * w // 4, projector.proj[2].out_features)
    assert (merged - ref_merged).abs().max() <= TOL
    assert (out - ref_out).abs().max() <= TOL


def test_two_images_in_one_call(models):
    _, reference, tower, projector = models
    pixel_values, grid_thws = random_image_inputs([(8, 8), (4, 6)], patch_size=4, seed=7)
    _, ref_out = _reference(reference, pixel_values, grid_thws)
    merged, out = _eaglet(tower, projector, pixel_values, grid_thws)
    assert (out - ref_out).abs().max() <= TOL
    # No attention across images: each image alone gives the same rows.
    first, second = pixel_values[:64], pixel_values[64:]
    alone_1 = _eaglet(tower, projector, first, grid_thws[:1])[1]
    alone_2 = _eaglet(tower, projector, second, grid_thws[1:])[1]
    assert (out - torch.cat([alone_1, alone_2])).abs().max() <= TOL


def test_video_clip_parity(models):
    """t > 1: time embedding, attention over the whole clip, mean over frames in the merge."""
    _, reference, tower, projector = models
    g = torch.Generator().manual_seed(11)
    grid_thws = torch.tensor([[3, 4, 4], [1, 4, 6]])
    pixel_values = torch.rand(3 * 16 + 24, 3, 4, 4, generator=g) * 2 - 1
    ref_merged, ref_out = _reference(reference, pixel_values, grid_thws)
    merged, out = _eaglet(tower, projector, pixel_values, grid_thws)
    assert merged.shape == (4 + 6, 4, 32)
    assert (merged - ref_merged).abs().max() <= TOL
    assert (out - ref_out).abs().max() <= TOL


def test_wrong_rope_layout_or_interpolation_would_fail(models, monkeypatch):
    """The parity above is sensitive to the two easy-to-get-wrong parts."""
    path, reference, tower, projector = models
    pixel_values, grid_thws = random_image_inputs([(8, 8)], patch_size=4, seed=1)
    ref_out = _reference(reference, pixel_values, grid_thws)[1]

    # q/k rows in transformers' rotate-half order instead of the published interleaved one
    wrong = copy.deepcopy(tower)
    heads = wrong.config.num_attention_heads
    with torch.no_grad():
        for block in wrong.encoder.blocks:
            for param in (block.wqkv.weight, block.wqkv.bias):
                q, k, v = param.chunk(3)
                q, k = (vision_qkv_interleaved_to_rotate_half(x, heads) for x in (q, k))
                param.copy_(torch.cat([q, k, v]))
    assert (_eaglet(wrong, projector, pixel_values, grid_thws)[1] - ref_out).abs().max() > 1e-3

    # bilinear instead of bicubic resampling of the position table
    def bilinear(self, height, width):
        table = self.weight.permute(2, 0, 1).unsqueeze(0)
        return F.interpolate(table, size=(height, width), mode="bilinear", align_corners=False)[0].flatten(1).t()

    monkeypatch.setattr(KimiPositionEmbedding, "spatial", bilinear)
    assert (_eaglet(tower, projector, pixel_values, grid_thws)[1] - ref_out).abs().max() > 1e-3


def test_parameter_names_are_the_published_ones(models):
    path, _, tower, projector = models
    published = set(read_checkpoint_tensors(path))
    ours = {"vision_tower." + k for k in tower.state_dict()} | {"mm_projector." + k for k in projector.state_dict()}
    assert ours == {k for k in published if k.startswith(("vision_tower.", "mm_projector."))}


def test_both_config_styles_agree(tmp_path):
    published = write_kimi_k25_checkpoint(tmp_path / "p", vision_overrides=VISION, num_shards=1)
    hf = write_kimi_k25_checkpoint(tmp_path / "t", vision_overrides=VISION, num_shards=1, config_style="transformers")
    a = KimiVisionConfig.from_hf(json.loads((published / "config.json").read_text()))
    b = KimiVisionConfig.from_hf(json.loads((hf / "config.json").read_text()))
    assert a == b
    assert (a.hidden_size, a.num_attention_heads, a.pos_emb_height, a.merge_kernel_size) == (32, 2, 6, (2, 2))
    assert a.rope_theta == 10000.0 and a.projector_ln_eps == 1e-5


PUBLISHED_VISION = {
    "init_pos_emb_height": 64,
    "init_pos_emb_time": 4,
    "init_pos_emb_width": 64,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mm_hidden_size": 1152,
    "mm_projector_type": "patchmerger",
    "patch_size": 14,
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
    "text_hidden_size": 7168,
    "video_attn_type": "spatial_temporal",
    "vt_hidden_size": 1152,
    "vt_intermediate_size": 4304,
    "vt_num_attention_heads": 16,
    "vt_num_hidden_layers": 27,
}


def test_real_published_config():
    c = KimiVisionConfig.from_hf({"vision_config": PUBLISHED_VISION, "text_config": {"hidden_size": 7168}})
    assert c == KimiVisionConfig(
        patch_size=14,
        hidden_size=1152,
        num_hidden_layers=27,
        num_attention_heads=16,
        intermediate_size=4304,
        pos_emb_height=64,
        pos_emb_width=64,
        pos_emb_time=4,
        merge_kernel_size=(2, 2),
        rope_theta=10000.0,
        layer_norm_eps=1e-5,
        projector_ln_eps=1e-5,
        text_hidden_size=7168,
    )


@pytest.mark.parametrize(
    "change, key",
    [
        ({"vt_hidden_size": None}, "vt_hidden_size"),
        ({"vt_num_attention_heads": 64}, "divisible by 4"),  # head dim 18
        ({"vt_num_attention_heads": 7}, "vt_num_attention_heads"),
        ({"vt_hidden_size": 1160, "mm_hidden_size": 1160, "vt_num_attention_heads": 20}, "divisible by 4"),
        ({"merge_kernel_size": [2]}, "merge_kernel_size"),
        ({"merge_kernel_size": [0, 2]}, "merge_kernel_size"),
        ({"patch_size": 0}, "patch_size"),
        ({"mm_hidden_size": 1024}, "mm_hidden_size"),
        ({"text_hidden_size": 4096}, "text_hidden_size"),
        ({"pos_emb_type": "learned"}, "pos_emb_type"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act"),
        ({"hidden_size": 1024}, "hidden_size"),
        ({"init_pos_emb_height": -1}, "init_pos_emb_height"),
    ],
)
def test_bad_config(change, key):
    vision = {k: v for k, v in {**PUBLISHED_VISION, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=key):
        KimiVisionConfig.from_hf({"vision_config": vision, "text_config": {"hidden_size": 7168}})


def test_missing_sections():
    with pytest.raises(ConfigError, match="vision_config"):
        KimiVisionConfig.from_hf({"text_config": {"hidden_size": 8}})
    vision = dict(PUBLISHED_VISION)
    del vision["text_hidden_size"]
    with pytest.raises(ConfigError, match="text_hidden_size"):
        KimiVisionConfig.from_hf({"vision_config": vision})
    with pytest.raises(ConfigError, match="rope_type"):
        KimiVisionConfig.from_hf(
            {"vision_config": {**PUBLISHED_VISION, "rope_parameters": {"rope_type": "yarn"}}, "text_config": {}}
        )


def test_bad_inputs(models):
    _, _, tower, _ = models
    pixel_values, grid_thws = random_image_inputs([(4, 6)], patch_size=4)
    with pytest.raises(InvalidRequestError, match="patches"):
        tower(pixel_values[:-1], grid_thws)
    with pytest.raises(InvalidRequestError, match="merge kernel"):
        tower(pixel_values[:20], torch.tensor([[1, 4, 5]]))
    with pytest.raises(InvalidRequestError, match="pixel_values"):
        tower(pixel_values[:, :, :2], grid_thws)
