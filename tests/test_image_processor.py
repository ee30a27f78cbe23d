"""eaglet's Kimi-K2.5 image processor against transformers' (fixtures from tools/make_image_processor_fixtures.py)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from eaglet.errors import ConfigError, ImageError
from eaglet.multimodal.image_processor import (
    ImageProcessorConfig,
    KimiImageProcessor,
    load_image,
    navit_resize,
)

DATA = Path(__file__).parent / "data" / "image_processor"

# The published moonshotai/Kimi-K2.5 preprocessor_config.json keeps its settings under media_proc_cfg.
PUBLISHED = {
    "auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
    "media_proc_cfg": {
        "in_patch_limit": 16384,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2,
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff",
    },
}


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(DATA / "reference.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def images(reference) -> list[Image.Image]:
    out = []
    for name in reference["names"]:
        with Image.open(DATA / f"{name}.png") as im:
            im.load()
            out.append(im)
    return out


def test_matches_transformers(reference, images):
    processor = KimiImageProcessor(ImageProcessorConfig.from_pretrained(DATA))
    out = processor(images)
    assert out.pixel_values.dtype == torch.float32
    assert out.grid_thws.dtype == torch.int64
    assert out.grid_thws.tolist() == reference["image_grid_thw"].tolist()
    assert out.num_placeholder_tokens == reference["num_placeholder_tokens"].tolist()
    assert out.pixel_values.shape == reference["pixel_values"].shape
    # Same integer resize kernel and the same float32 arithmetic: exact.
    diff = np.abs(out.pixel_values.numpy() - reference["pixel_values"]).max()
    assert diff <= 1e-6, diff


def test_each_image_alone_matches_batch(reference, images):
    processor = KimiImageProcessor(ImageProcessorConfig.from_pretrained(DATA))
    batch = processor(images)
    offset = 0
    for image, grid in zip(images, reference["image_grid_thw"]):
        single = processor([image])
        n = int(np.prod(grid))
        assert single.grid_thws.tolist() == [grid.tolist()]
        assert torch.equal(single.pixel_values, batch.pixel_values[offset : offset + n])
        assert single.num_placeholder_tokens == [n // 4]
        assert processor.num_placeholder_tokens(image.height, image.width) == n // 4
        offset += n


def test_fixture_covers_the_interesting_cases(reference, images):
    names = list(reference["names"])
    modes = {im.mode for im in images}
    assert {"RGB", "L", "RGBA", "P"} <= modes
    cfg = ImageProcessorConfig.from_pretrained(DATA)
    resized = [
        navit_resize(im.height, im.width, cfg.patch_size, cfg.merge_size, cfg.max_patches, cfg.max_side_patches)
        for im in images
    ]
    by_name = dict(zip(names, resized))
    # Downscaled by the total budget, by the per-side budget, and one below a single merge block.
    assert by_name["rgb_over_budget"][0] != (300, 500)
    assert by_name["gray_tall"][0][0] == 16 * 14
    assert by_name["rgb_tiny"] == ((10, 20), (28, 28))
    assert by_name["rgb_exact"] == ((84, 56), (84, 56))


def test_load_image_roundtrip_and_rgb():
    buf = io.BytesIO()
    Image.new("RGBA", (5, 3), (255, 0, 0, 0)).save(buf, format="PNG")
    data = buf.getvalue()
    for source in (data, "data:image/png;base64," + base64.b64encode(data).decode(), base64.b64encode(data).decode()):
        image = load_image(source)
        assert image.mode == "RGB" and image.size == (5, 3)
        # Fully transparent pixels become white, as transformers' RGB conversion does.
        assert image.getpixel((0, 0)) == (255, 255, 255)
    gray = load_image(Image.new("L", (4, 4), 7))
    assert gray.mode == "RGB" and gray.getpixel((1, 1)) == (7, 7, 7)


def test_load_image_path(tmp_path):
    path = tmp_path / "a.png"
    Image.new("RGB", (6, 2), (1, 2, 3)).save(path)
    assert load_image(str(path)).getpixel((0, 0)) == (1, 2, 3)


@pytest.mark.parametrize(
    "source",
    [
        b"",
        b"not an image at all",
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,  # PNG signature, garbage body
        "data:image/png;base64,!!!notbase64",
        "data:image/png,rawtext",
        "https://example.com/cat.png",
        12345,
    ],
)
def test_load_image_rejects_bad_input(source):
    with pytest.raises(ImageError):
        load_image(source)


def test_truncated_image_is_rejected():
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    with pytest.raises(ImageError, match="corrupt|truncated|format"):
        load_image(buf.getvalue()[: len(buf.getvalue()) // 2])


def test_processor_rejects_non_images():
    processor = KimiImageProcessor(ImageProcessorConfig())
    with pytest.raises(ImageError):
        processor([np.zeros((4, 4, 3), dtype=np.uint8)])
    empty = processor([])
    assert empty.pixel_values.shape == (0, 3, 14, 14) and empty.grid_thws.shape == (0, 3)


def test_config_spellings():
    published = ImageProcessorConfig.from_dict(PUBLISHED)
    assert published == ImageProcessorConfig(
        patch_size=14,
        merge_size=2,
        max_patches=16384,
        max_side_patches=512,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        rescale_factor=1 / 255,
    )
    transformers_style = ImageProcessorConfig.from_dict(
        {
            "patch_size": 14,
            "merge_size": 2,
            "max_patches": 16384,
            "size": {"max_height": 512, "max_width": 512},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "rescale_factor": 0.00392156862745098,
            "resample": 3,
            "do_resize": True,
        }
    )
    assert transformers_style == published
    flat = ImageProcessorConfig.from_dict(
        {"in_patch_limit": 64, "patch_limit_on_one_side": 8, "merge_kernel_size": [2, 2]}
    )
    assert (flat.max_patches, flat.max_side_patches, flat.merge_size) == (64, 8, 2)
    assert ImageProcessorConfig.from_dict(json.loads((DATA / "preprocessor_config.json").read_text())).max_patches == 96


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"patch_size": 0}, "patch_size"),
        ({"patch_size": "14"}, "patch_size"),
        ({"max_patches": -1}, "max_patches"),
        ({"size": {"max_height": 16, "max_width": 32}}, "max_width"),
        ({"size": {"height": 16, "width": 16}}, "size"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"merge_kernel_size": [2, 3]}, "merge_kernel_size"),
        ({"resample": 2}, "resample"),
        ({"do_normalize": False}, "do_normalize"),
        ({"media_proc_cfg": {"fixed_output_tokens": 256}}, "fixed_output_tokens"),
        ({"max_patches": 100, "in_patch_limit": 200}, "in_patch_limit"),
        ({"rescale_factor": 0}, "rescale_factor"),
        ({"media_proc_cfg": [1, 2]}, "media_proc_cfg"),
        ({"patch_size": 14, "media_proc_cfg": {"patch_size": 16}}, "patch_size"),
    ],
)
def test_bad_config(bad, key):
    with pytest.raises(ConfigError, match=key):
        ImageProcessorConfig.from_dict(bad)


def test_checkpoint_helper_preprocessor_config(tmp_path):
    """eaglet/testing/checkpoints.py writes both spellings side by side; they must agree."""
    from eaglet.testing.checkpoints import write_kimi_k25_checkpoint

    path = write_kimi_k25_checkpoint(tmp_path, num_shards=1, max_patches=64)
    cfg = ImageProcessorConfig.from_pretrained(path)
    assert (cfg.patch_size, cfg.merge_size, cfg.max_patches, cfg.max_side_patches) == (4, 2, 64, 512)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PUBLISHED))
    assert ImageProcessorConfig.from_pretrained(tmp_path).max_patches == 16384
