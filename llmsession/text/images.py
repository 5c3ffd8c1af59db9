"""Images for chat messages: decoded once to RGB pixels and identified by a hash of them.

The hash is what image-aware prefix reuse compares: two turns that carry the same pixels share
the image's positions in the KV cache, whatever file, bytes or array they came from. So the pixels
are always an ``Image``'s own read-only copy: a caller reusing its array for another picture must
not leave a hash that no longer matches the pixels (a stale cached answer).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from llmsession.errors import ImageError
from llmsession.files import read_regular
from llmsession.text.messages import image_parts as image_parts  # (beside is_image_part: reads no image)

# The encoded formats read (what OpenAI's and Anthropic's APIs take, and BMP): PIL would otherwise
# try each of its plugins on hostile bytes, EPS among them (Ghostscript, where it is installed).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_FILE_BYTES = 1 << 28  # an image file read from a path, at most (16.8 MP as BMP is 50 MB)
MAX_PIXELS = 4096 * 4096  # an encoded image's, read from its header before it is decoded (~16.8 MP)

# PIL loads when the first encoded image is decoded (a PIL image passed in has loaded it already).
if TYPE_CHECKING:
    import PIL.Image

    ImageSource = bytes | bytearray | memoryview | str | Path | PIL.Image.Image | np.ndarray


class Image:
    """An image part: ``Image(source)`` with encoded bytes (in one of ``FORMATS``), a file
    path, a ``PIL.Image.Image`` or an H×W×3 uint8 array. Bad input raises ``ImageError`` at
    once, and so does an encoded or PIL image of more than ``MAX_PIXELS`` (read from its header,
    never decoded: a 420 KB PNG may unpack to 2 GB)."""

    FORMATS: ClassVar[tuple[str, ...]] = FORMATS  # the encoded formats read (PIL's names)
    MAX_PIXELS: ClassVar[int] = MAX_PIXELS

    def __init__(self, source: ImageSource) -> None:
        self.pixels = _rgb_pixels(source)
        self.pixels.flags.writeable = False
        self.height, self.width = int(self.pixels.shape[0]), int(self.pixels.shape[1])
        digest = hashlib.sha256(f"{self.width}x{self.height}:".encode())
        digest.update(self.pixels.data)
        self.digest = digest.hexdigest()[:32]

    def __repr__(self) -> str:
        return f"Image({self.width}x{self.height}, {self.digest[:12]})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Image) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)


def _rgb_pixels(source: ImageSource) -> np.ndarray:
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[2] != 3 or source.dtype != np.uint8:
            raise ImageError(f"an image array must be H×W×3 uint8, got shape {source.shape} {source.dtype}")
        if source.shape[0] == 0 or source.shape[1] == 0:
            raise ImageError(f"an image array must not be empty, got shape {source.shape}")
        return np.array(source, dtype=np.uint8, order="C", copy=True)
    pil = sys.modules.get("PIL.Image")
    if pil is not None and isinstance(source, pil.Image):
        return _from_pil(source, "the PIL image")
    if isinstance(source, bytes | bytearray | memoryview):
        return _decode(bytes(source), f"{len(source)} bytes")
    if isinstance(source, str | Path):
        path = Path(source)
        try:
            data = read_regular(path, MAX_FILE_BYTES)  # (not a FIFO's or a device's endless bytes)
        except OSError as error:
            raise ImageError(f"cannot read image file {path}: {error.strerror or error}") from None
        return _decode(data, str(path))
    raise ImageError(f"cannot make an image from {type(source).__name__}")


def _decode(data: bytes, what: str) -> np.ndarray:
    import PIL.Image

    try:
        with PIL.Image.open(io.BytesIO(data), formats=FORMATS) as image:
            return _from_pil(image, what)
    except ImageError:
        raise
    except Exception as error:  # PIL's plugins raise anything on hostile bytes (SyntaxError, ...)
        raise ImageError(f"{what} is not a readable image: {type(error).__name__}: {error}") from None


def _from_pil(image: PIL.Image.Image, what: str) -> np.ndarray:
    width, height = image.size  # (from the header: nothing decoded yet)
    if width * height > MAX_PIXELS:
        raise ImageError(f"{what}: an image has at most {MAX_PIXELS} pixels, got {width}x{height}")
    try:
        pixels = np.array(image.convert("RGB"), dtype=np.uint8)
    except Exception as error:  # as above: decoding happens here, lazily
        raise ImageError(f"{what} cannot be decoded: {type(error).__name__}: {error}") from None
    if pixels.size == 0:
        raise ImageError(f"{what} has no pixels")
    return np.ascontiguousarray(pixels)


def image_from_part(part: object) -> Image:
    """The ``Image`` of a content part: an ``Image``, or an OpenAI-style image dict
    (``{"type": "image", "image": source}`` or ``{"type": "image_url", "image_url": {"url": ...}}``
    with a file path or a base64 ``data:`` URL)."""
    if isinstance(part, Image):
        return part
    if not isinstance(part, Mapping):
        return Image(part)  # type: ignore[arg-type]  # Image() names what it cannot take
    if part.get("type") == "image":
        source = part.get("image", part.get("url"))
    else:
        url = part.get("image_url")
        source = url.get("url") if isinstance(url, Mapping) else url
    if source is None:
        raise ImageError(f"an image part needs an image source: {dict(part)!r}")
    if isinstance(source, str) and source.startswith("data:"):
        return Image(_data_url_bytes(source))
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise ImageError("image URLs are not fetched: pass the bytes, a file path or a data: URL")
    return Image(source)


def _data_url_bytes(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ImageError("a data: image URL must be base64-encoded")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"the data: URL is not valid base64: {error}") from None


def message_images(messages: Sequence[Mapping[str, Any]]) -> Iterator[Image]:
    """Every image of a transcript, in the order the prompt places their markers."""
    return (image_from_part(part) for part in image_parts(messages))
