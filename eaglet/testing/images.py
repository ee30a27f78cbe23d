"""Random RGB images, seeded, for multimodal requests in tests and the bench."""

from __future__ import annotations

import numpy as np
from PIL import Image


def make_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
