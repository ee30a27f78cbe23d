"""Kimi-K2.5 image preprocessing: decode, NaViT resize, pad, normalise, patchify.

Reproduces transformers' ``Kimi_K25ImageProcessor`` (torchvision backend) with PIL and torch
only. The resize is torch's native uint8 bicubic with antialiasing (what torchvision runs for a
uint8 CPU tensor), so pixel values match it exactly; PIL's own bicubic differs by up to one grey
level.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch
import torch.nn.functional as F
from torch import Tensor

from eaglet.errors import ConfigError, ImageError

# PIL's BICUBIC; transformers stores `resample` as this integer.
_PIL_BICUBIC = 3


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"preprocessor config: {key} must be a positive integer, got {value!r}")
    return value


def _triple(value: Any, key: str, *, positive: bool) -> tuple[float, float, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ConfigError(f"preprocessor config: {key} must be 3 numbers, got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise ConfigError(f"preprocessor config: {key} has an invalid entry {v!r}")
        out.append(float(v))
    return out[0], out[1], out[2]


def _merged_value(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    """First present of ``names``; two spellings with different values are an error."""
    found = [(n, d[n]) for n in names if d.get(n) is not None]
    if not found:
        return default
    for other, value in found[1:]:
        if value != found[0][1]:
            raise ConfigError(f"preprocessor config: {found[0][0]}={found[0][1]!r} disagrees with {other}={value!r}")
    return found[0][1]


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_side_patches: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, d: dict) -> ImageProcessorConfig:
        """Accepts transformers' keys and the published ``media_proc_cfg`` spellings.

        transformers: patch_size, merge_size, max_patches, size.max_height (= size.max_width),
        image_mean, image_std, rescale_factor. Published (Moonshot's preprocessor_config.json, under
        ``media_proc_cfg`` or flat): patch_size, merge_kernel_size, in_patch_limit,
        patch_limit_on_one_side, image_mean, image_std. Missing keys take the Kimi-K2.5 defaults.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"preprocessor config must be a JSON object, got {type(d).__name__}")
        media = d.get("media_proc_cfg")
        if media is not None and not isinstance(media, dict):
            raise ConfigError(f"preprocessor config: media_proc_cfg must be an object, got {media!r}")
        media = media or {}
        for key in media.keys() & d.keys():
            if media[key] != d[key]:
                raise ConfigError(
                    f"preprocessor config: media_proc_cfg.{key}={media[key]!r} disagrees with {key}={d[key]!r}"
                )
        merged = {**d, **media}
        merged.pop("media_proc_cfg", None)

        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if merged.get(flag) is False:
                raise ConfigError(f"preprocessor config: {flag}=false is not supported")
        resample = merged.get("resample")
        if resample is not None and resample != _PIL_BICUBIC:
            raise ConfigError(f"preprocessor config: resample={resample!r} is not supported (only bicubic, 3)")
        if merged.get("fixed_output_tokens") is not None:
            raise ConfigError("preprocessor config: fixed_output_tokens is not supported")

        merge = _merged_value(merged, "merge_size", "merge_kernel_size", default=cls.merge_size)
        if isinstance(merge, (list, tuple)):
            if len(merge) != 2 or merge[0] != merge[1]:
                raise ConfigError(f"preprocessor config: merge_kernel_size must be square, got {merge!r}")
            merge = merge[0]

        side = merged.get("patch_limit_on_one_side")
        size = merged.get("size")
        if size is not None:
            if not isinstance(size, dict) or size.get("max_height") is None:
                raise ConfigError(f"preprocessor config: size must hold max_height (in patches), got {size!r}")
            if size.get("max_width", size["max_height"]) != size["max_height"]:
                raise ConfigError(f"preprocessor config: size.max_height and size.max_width must be equal, got {size}")
            if side is not None and side != size["max_height"]:
                raise ConfigError(
                    f"preprocessor config: patch_limit_on_one_side={side!r} disagrees with "
                    f"size.max_height={size['max_height']!r}"
                )
            side = size["max_height"]

        rescale = merged.get("rescale_factor", cls.rescale_factor)
        if isinstance(rescale, bool) or not isinstance(rescale, (int, float)) or not 0 < rescale < math.inf:
            raise ConfigError(f"preprocessor config: rescale_factor must be a positive number, got {rescale!r}")

        return cls(
            patch_size=_positive_int(merged.get("patch_size", cls.patch_size), "patch_size"),
            merge_size=_positive_int(merge, "merge_size"),
            max_patches=_positive_int(
                _merged_value(merged, "max_patches", "in_patch_limit", default=cls.max_patches), "max_patches"
            ),
            max_side_patches=_positive_int(side if side is not None else cls.max_side_patches, "size.max_height"),
            image_mean=_triple(merged.get("image_mean", cls.image_mean), "image_mean", positive=False),
            image_std=_triple(merged.get("image_std", cls.image_std), "image_std", positive=True),
            rescale_factor=float(rescale),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> ImageProcessorConfig:
        path = Path(model_dir) / "preprocessor_config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError(f"{path} does not exist") from e
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path} is not readable JSON: {e}") from e
        return cls.from_dict(raw)


@dataclass
class ProcessedImages:
    pixel_values: Tensor  # [total_patches, 3, p, p] float32
    grid_thws: Tensor  # [n_images, 3] int64
    num_placeholder_tokens: list[int]  # per image: t*h*w // merge_size**2


def navit_resize(
    height: int, width: int, patch_size: int, merge_size: int, max_patches: int, max_side_patches: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(resized (h, w), padded (h, w)): fit the patch budgets without upscaling, pad to merge blocks."""
    patches_h = max(1, height // patch_size)
    patches_w = max(1, width // patch_size)
    scale = min(
        1.0,
        math.sqrt(max_patches / (patches_h * patches_w)),
        max_side_patches * patch_size / height,
        max_side_patches * patch_size / width,
    )
    limit = max_side_patches * patch_size
    new_h = min(max(1, int(height * scale)), limit)
    new_w = min(max(1, int(width * scale)), limit)
    block = merge_size * patch_size
    return (new_h, new_w), (-(-new_h // block) * block, -(-new_w // block) * block)


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB, with any transparency composited onto white (as transformers does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


class KimiImageProcessor:
    def __init__(self, config: ImageProcessorConfig) -> None:
        self.config = config
        # The same float32 arithmetic as transformers' fused rescale + normalise.
        factor = 1.0 / config.rescale_factor
        self._mean = (torch.tensor(config.image_mean) * factor).view(3, 1, 1)
        self._std = (torch.tensor(config.image_std) * factor).view(3, 1, 1)

    def sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        c = self.config
        return navit_resize(height, width, c.patch_size, c.merge_size, c.max_patches, c.max_side_patches)

    def num_placeholder_tokens(self, height: int, width: int) -> int:
        _, (pad_h, pad_w) = self.sizes(height, width)
        return (pad_h // self.config.patch_size) * (pad_w // self.config.patch_size) // self.config.merge_size**2

    def _process_one(self, image: PIL.Image.Image) -> tuple[Tensor, tuple[int, int, int]]:
        if not isinstance(image, PIL.Image.Image):
            raise ImageError(f"expected a PIL image, got {type(image).__name__}")
        if image.width < 1 or image.height < 1:
            raise ImageError(f"image has no pixels ({image.width}x{image.height})")
        try:
            rgb = np.asarray(to_rgb(image), dtype=np.uint8)
        except (OSError, ValueError) as e:
            raise ImageError(f"cannot convert image (mode {image.mode}) to RGB: {e}") from e
        pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()  # [3, H, W] uint8

        p = self.config.patch_size
        (new_h, new_w), (pad_h, pad_w) = self.sizes(image.height, image.width)
        if (new_h, new_w) != (image.height, image.width):
            # uint8 in, uint8 out: torch's integer antialiased bicubic, rounding like torchvision.
            pixels = F.interpolate(
                pixels[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True
            )[0]
        pixels = F.pad(pixels, (0, pad_w - new_w, 0, pad_h - new_h), value=0)

        normalized = (pixels.to(torch.float32) - self._mean) / self._std
        grid_h, grid_w = pad_h // p, pad_w // p
        patches = normalized.view(3, grid_h, p, grid_w, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
        return patches, (1, grid_h, grid_w)

    def __call__(self, images: list[PIL.Image.Image]) -> ProcessedImages:
        if isinstance(images, PIL.Image.Image):
            images = [images]
        p = self.config.patch_size
        patches, grids = [], []
        for image in images:
            x, grid = self._process_one(image)
            patches.append(x)
            grids.append(grid)
        return ProcessedImages(
            pixel_values=torch.cat(patches) if patches else torch.empty(0, 3, p, p),
            grid_thws=torch.tensor(grids, dtype=torch.int64).view(-1, 3),
            num_placeholder_tokens=[t * h * w // self.config.merge_size**2 for t, h, w in grids],
        )


def _decode(data: bytes) -> PIL.Image.Image:
    if not data:
        raise ImageError("image data is empty")
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()
    except PIL.Image.DecompressionBombError as e:
        raise ImageError(f"image is too large to decode: {e}") from e
    except PIL.UnidentifiedImageError as e:
        raise ImageError("image data is not in a recognised image format") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"image data is corrupt or truncated: {e}") from e
    return image


def load_image(source: bytes | str | PIL.Image.Image) -> PIL.Image.Image:
    """Decode an image to RGB (EXIF orientation applied, transparency composited onto white).

    ``source``: encoded bytes, a PIL image, or a string holding a ``data:image/...;base64,`` URL,
    bare base64, or a local file path. URLs are not fetched.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        image = _decode(bytes(source))
    elif isinstance(source, PIL.Image.Image):
        image = source
    elif isinstance(source, str):
        if source.startswith(("http://", "https://")):
            raise ImageError("image URLs are not fetched; send the image bytes (e.g. a base64 data URL)")
        if source.startswith("data:"):
            header, sep, payload = source.partition(",")
            if not sep or ";base64" not in header:
                raise ImageError("data URL must be base64-encoded (data:image/...;base64,...)")
            image = _decode(_b64decode(payload))
        elif len(source) < 4096 and os.path.isfile(source):
            try:
                data = Path(source).read_bytes()
            except OSError as e:
                raise ImageError(f"cannot read image file {source!r}: {e}") from e
            image = _decode(data)
        else:
            image = _decode(_b64decode(source))
    else:
        raise ImageError(f"unsupported image source type {type(source).__name__}")

    if image.width < 1 or image.height < 1:
        raise ImageError(f"image has no pixels ({image.width}x{image.height})")
    try:
        return to_rgb(PIL.ImageOps.exif_transpose(image))
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"cannot convert image (mode {image.mode}) to RGB: {e}") from e


def _b64decode(payload: str) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError("image string is neither a readable file path nor valid base64") from e
