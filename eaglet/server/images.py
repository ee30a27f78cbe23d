"""Images of a request: data URLs (and, only when allowed, remote URLs or local files) decoded
under size limits before anything reaches the engine."""

from __future__ import annotations

import base64
import binascii
import io
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import PIL.Image

from eaglet.errors import ImageError, InvalidRequestError

ACCEPTED_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP")
_DATA_URL = re.compile(r"^data:(?P<media>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*),(?P<payload>.*)$", re.DOTALL)


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request
    max_pixels: int = 16_000_000  # width * height of one image
    max_bytes: int = 20 * 2**20  # encoded size of one image
    allow_remote_urls: bool = False
    allow_local_files: bool = False
    fetch_timeout_s: float = 10.0


def load_request_image(url: str, limits: ImageLimits) -> PIL.Image.Image:
    """Decodes one ``image_url`` into an RGB-convertible PIL image, fully loaded.

    Raises ImageError (a 400) for anything that is not a decodable PNG/JPEG/WebP within the limits,
    and InvalidRequestError for URL kinds the server does not accept.
    """
    if url.startswith("data:"):
        data = _decode_data_url(url, limits)
    elif url.startswith(("http://", "https://")):
        if not limits.allow_remote_urls:
            raise InvalidRequestError(
                "remote image URLs are not fetched by this server (start it with --allow-remote-image-urls); "
                "send the image as a base64 data URL"
            )
        data = _fetch(url, limits)
    elif url.startswith("file://") or url.startswith("/"):
        if not limits.allow_local_files:
            raise InvalidRequestError(
                "local image paths are refused by this server (start it with --allow-local-image-files); "
                "send the image as a base64 data URL"
            )
        data = _read_local(url.removeprefix("file://"), limits)
    else:
        raise InvalidRequestError("image_url.url must be a data: URL (data:image/png;base64,...)")
    return _decode_image(data, limits)


def _decode_data_url(url: str, limits: ImageLimits) -> bytes:
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("malformed data URL: expected data:image/<png|jpeg|webp>;base64,<data>")
    media = (match["media"] or "").lower()
    if media not in ACCEPTED_MEDIA_TYPES:
        raise ImageError(f"unsupported image media type {media or '(none)'!r}; use PNG, JPEG or WebP")
    if "base64" not in [p.strip().lower() for p in match["params"].split(";") if p]:
        raise ImageError("image data URLs must be base64-encoded (data:image/png;base64,...)")
    payload = match["payload"].strip()
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ImageError(f"image larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"image data URL holds invalid base64 ({exc})") from exc


def _fetch(url: str, limits: ImageLimits) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as response:
            data = response.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ImageError(f"could not fetch image {url!r}: {exc}") from exc
    if len(data) > limits.max_bytes:
        raise ImageError(f"image at {url!r} is larger than {limits.max_bytes} bytes")
    return data


def _read_local(path: str, limits: ImageLimits) -> bytes:
    file = Path(path)
    try:
        if file.stat().st_size > limits.max_bytes:
            raise ImageError(f"image file {path!r} is larger than {limits.max_bytes} bytes")
        return file.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read image file {path!r}: {exc.strerror or exc}") from exc


def _decode_image(data: bytes, limits: ImageLimits) -> PIL.Image.Image:
    try:
        image = PIL.Image.open(io.BytesIO(data))
    except PIL.Image.DecompressionBombError as exc:
        raise ImageError(f"image too large: {exc}") from exc
    except (PIL.UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError("could not decode the image (not a PNG, JPEG or WebP file)") from exc
    if image.format not in ACCEPTED_FORMATS:
        raise ImageError(f"unsupported image format {image.format}; use PNG, JPEG or WebP")
    # The header gives the size before any pixel is decoded: refuse decompression bombs here.
    pixels = image.width * image.height
    if pixels < 1:
        raise ImageError(f"image has no pixels ({image.width}x{image.height})")
    if pixels > limits.max_pixels:
        raise ImageError(f"image of {image.width}x{image.height} pixels exceeds the limit of {limits.max_pixels} pixels")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt pixel data
        raise ImageError(f"could not decode the image: {exc}") from exc
    return image
