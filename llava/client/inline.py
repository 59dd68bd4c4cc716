"""Turn a URL, data: URI, raw bytes or local file into a request's `image` value."""

from __future__ import annotations

import base64
import mimetypes
import os
from pathlib import Path

from llava.core.errors import ImageTooLarge
from llava.core.params import MAX_BODY_BYTES

# A base64 image inside the JSON body must keep the body under SageMaker's 6 MiB: base64 grows
# bytes by 4/3, and the envelope needs a little room (about 4.5 MB of raw image).
MAX_INLINE_IMAGE_BYTES = (MAX_BODY_BYTES - 4096) // 4 * 3
_URL_PREFIXES = ("https://", "http://", "s3://", "data:")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")


def image_ref(image: str | os.PathLike[str] | bytes) -> str:
    """Turn a URL, a data: URI, raw bytes or a local file path into the request's `image`."""
    if isinstance(image, (bytes, bytearray)):
        return _data_uri(bytes(image), None)
    if isinstance(image, str) and image.startswith(_URL_PREFIXES):
        return image
    path = Path(image)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a long base64 string is no path
        is_file = False
    if is_file:
        size = path.stat().st_size
        if size > MAX_INLINE_IMAGE_BYTES:
            raise _too_large(size, str(path))
        return _data_uri(path.read_bytes(), path.name)
    if str(image).lower().endswith(_IMAGE_SUFFIXES):
        raise FileNotFoundError(f"image file not found: {image}")
    return str(image)  # base64 or another form: the server validates it


def _data_uri(data: bytes, name: str | None) -> str:
    if len(data) > MAX_INLINE_IMAGE_BYTES:
        raise _too_large(len(data), name or "image")
    mime = _sniff(data) or (mimetypes.guess_type(name)[0] if name else None)
    return f"data:{mime or 'application/octet-stream'};base64,{base64.b64encode(data).decode()}"


def _too_large(size: int, what: str) -> ImageTooLarge:
    return ImageTooLarge(
        f"{what} is {size} bytes; inline images must stay under {MAX_INLINE_IMAGE_BYTES} bytes "
        "(SageMaker's 6 MiB body limit with base64): upload it and pass an https:// URL or an "
        "s3:// URI instead",
        field="image",
    )


def _sniff(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data.startswith(b"BM"):
        return "image/bmp"
    return None
