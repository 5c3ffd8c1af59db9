"""A request's images, bounded before anything decodes them. Pure: no model.

The library decodes an image's every pixel (``text.images``) and bounds neither their number nor
their size (PIL refuses only past 178 MP), so a request of a few MiB could make the server decode
gigabytes. Here an image is a base64 ``data:`` URL (nothing is fetched), at most ``MAX_IMAGES``
per request, each at most ``MAX_PIXELS``: its size is read from its header (``Image.open`` reads
no pixels). A continued response's stored images are decoded again by every call: with the new
ones, at most ``MAX_TOTAL_PIXELS`` in all.
"""

from __future__ import annotations

import base64
import binascii
import io

from llmsession.serve.errors import ApiError

MAX_IMAGES = 8
MAX_PIXELS = 4096 * 4096  # ~16.8 MP
MAX_TOTAL_PIXELS = MAX_IMAGES * MAX_PIXELS  # a call's images, a continued transcript's too
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # ``llmsession.Image.FORMATS`` (a pure module's copy)


class ImageCount:
    """The images of one request, checked as they are met."""

    def __init__(self) -> None:
        self.count = 0
        self.pixels = 0  # the new images' and those of the stored responses it continues

    def kept(self, message: object, where: str) -> None:
        """A stored response's message, checked when it was asked: its images are not counted
        with the new input's, but each call that continues it decodes them again, so their
        pixels count (a chain adding 8 images a turn had no bound at all)."""
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part["image_url"]["url"]
                self._add(*_size(base64.b64decode(url.partition(",")[2]), where), where)

    def check(self, url: object, where: str) -> None:
        """``url`` is a readable image of at most ``MAX_PIXELS``, and one too many is refused."""
        self.count += 1
        if self.count > MAX_IMAGES:
            raise ApiError(f"{where}: at most {MAX_IMAGES} images in a request", where)
        if not isinstance(url, str) or not url.startswith("data:"):
            raise ApiError(f"{where}: an image must be a data: URL (nothing is fetched)", where)
        header, _, payload = url.partition(",")
        try:
            if not header.endswith(";base64"):
                raise ValueError("not base64")
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(f"{where}: an image must be a base64 data: URL", where) from None
        width, height = _size(data, where)
        if width * height > MAX_PIXELS:
            raise ApiError(f"{where}: an image has at most {MAX_PIXELS} pixels, got {width}x{height}", where)
        self._add(width, height, where)

    def _add(self, width: int, height: int, where: str) -> None:
        self.pixels += width * height
        if self.pixels > MAX_TOTAL_PIXELS:
            said = f"at most {MAX_TOTAL_PIXELS} pixels of images in all"
            raise ApiError(f"{where}: {said}, with those of the responses it continues", where)


def _size(data: bytes, where: str) -> tuple[int, int]:
    import PIL.Image

    try:
        with PIL.Image.open(io.BytesIO(data), formats=FORMATS) as image:  # (no other plugin tried)
            width, height = image.size
            return int(width), int(height)
    except PIL.Image.DecompressionBombError:
        raise ApiError(f"{where}: an image has at most {MAX_PIXELS} pixels", where) from None
    except Exception:  # PIL's plugins raise anything on hostile bytes (SyntaxError, ...)
        raise ApiError(f"{where}: not a readable image", where) from None
