"""Write reference outputs of transformers' Kimi-K2.5 image processor for tests/test_image_processor.py.

transformers' processor needs torchvision, which does not import beside the CPU torch eaglet pins,
so run this with a separate environment, e.g.:

    python3 -m venv /tmp/tv-venv
    /tmp/tv-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 pillow numpy
    /tmp/tv-venv/bin/python tools/make_image_processor_fixtures.py

Output (tests/data/image_processor/): the synthetic images as PNG, transformers' own
preprocessor_config.json for the small config used, and reference.npz holding pixel_values and
image_grid_thw for all images processed in one call, plus the per-image placeholder counts.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "image_processor"

# Small limits so that the navit budgets bite on small images and the fixture stays small.
CONFIG = {"patch_size": 14, "merge_size": 2, "max_patches": 96, "size": {"max_height": 16, "max_width": 16}}


def _pattern(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour ramps plus a fine checkerboard (so antialiasing matters) plus light noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 127.5 + 127.5 * np.sin(x / (7 + seed) + y / 13)
    g = 255 * x / max(width - 1, 1)
    b = 255 * y / max(height - 1, 1)
    img = np.stack([r, g, b], axis=-1)
    img += 40.0 * (((x // 2 + y // 2) % 2) - 0.5)[..., None]
    img += rng.normal(0, 6, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def make_images() -> dict[str, Image.Image]:
    images = {}
    # Fits every budget: no resize, padded to a multiple of 28 in both directions.
    images["rgb_fits"] = Image.fromarray(_pattern(150, 100, 1))
    # 35 x 21 = 735 patches > max_patches: scaled down by sqrt(96 / 735).
    images["rgb_over_budget"] = Image.fromarray(_pattern(500, 300, 2))
    # Smaller than one 28 x 28 merge block: kept as is and padded.
    images["rgb_tiny"] = Image.fromarray(_pattern(20, 10, 3))
    # Grayscale, taller than 16 patches: scaled by the per-side limit.
    images["gray_tall"] = Image.fromarray(_pattern(60, 400, 4)[..., 0])
    # Alpha channel: transformers composites it onto white.
    rgba = _pattern(64, 48, 5)
    alpha = np.tile(np.linspace(0, 255, 64).astype(np.uint8), (48, 1))
    images["rgba_alpha"] = Image.fromarray(np.dstack([rgba, alpha]))
    # Already an exact number of merge blocks: no resize, no padding.
    images["rgb_exact"] = Image.fromarray(_pattern(56, 84, 6))
    # Very wide: width limited per side, height rounds to a few pixels.
    images["rgb_wide"] = Image.fromarray(_pattern(900, 45, 7))
    # Palette image with a transparent index.
    pal = Image.fromarray(_pattern(40, 30, 8)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.info["transparency"] = 3
    images["palette_transparent"] = pal
    return images


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    images = make_images()
    for name, image in images.items():
        image.save(OUT / f"{name}.png")
    # Process what a reader of the PNGs gets back, so the test starts from the same pixels.
    reloaded = [Image.open(OUT / f"{name}.png") for name in images]
    for image in reloaded:
        image.load()

    processor = Kimi_K25ImageProcessor(**CONFIG)
    out = processor(images=reloaded, return_tensors="pt")
    pixel_values = out["pixel_values"].to(torch.float32).numpy()
    grid = out["image_grid_thw"].numpy().astype(np.int64)
    counts = np.array(
        [processor.get_number_of_image_patches(im.height, im.width) // CONFIG["merge_size"] ** 2 for im in reloaded]
    )
    np.savez_compressed(
        OUT / "reference.npz",
        names=np.array(list(images)),
        pixel_values=pixel_values,
        image_grid_thw=grid,
        num_placeholder_tokens=counts,
    )
    with tempfile.TemporaryDirectory() as tmp:
        processor.save_pretrained(tmp)
        saved = json.loads((Path(tmp) / "preprocessor_config.json").read_text())
    (OUT / "preprocessor_config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    for name, image, g in zip(images, reloaded, grid):
        print(f"{name:22s} {image.mode:5s} {image.width}x{image.height} -> grid {g.tolist()}")
    print("pixel_values", pixel_values.shape)


if __name__ == "__main__":
    main()
