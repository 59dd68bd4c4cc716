"""Decode inline images: data: URIs and raw (standard or URL-safe) base64."""

from __future__ import annotations

import base64
import binascii

from llava.core.errors import ImageError, InvalidRequest
from llava.images.limits import too_many_bytes
from llava.images.refs import clean_text, scheme_of


def _b64_limit(max_bytes: int) -> int:
    """Return the longest base64 text that can decode to at most `max_bytes`."""
    return 4 * ((max_bytes + 2) // 3)


def _decode_base64(text: str, max_bytes: int) -> bytes:
    """Decode standard or URL-safe base64 (whitespace and missing padding tolerated)."""
    limit = _b64_limit(max_bytes)
    # Two cheap bounds: the raw text (whitespace included) and the compacted payload.
    if len(text) > 2 * limit + 1024:
        raise too_many_bytes("inline image", max_bytes)
    compact = "".join(text.split())
    if len(compact) > limit:
        raise too_many_bytes("inline image", max_bytes)
    compact = compact.translate(str.maketrans("-_", "+/"))
    compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(
            "image is not valid base64; send standard base64 of the image file's bytes, "
            "optionally as data:image/png;base64,..."
        ) from None
    if not data:
        raise ImageError("image data is empty; send the bytes of a PNG, JPEG, GIF or WebP file")
    if len(data) > max_bytes:
        raise too_many_bytes("inline image", max_bytes)
    return data


def _decode_data_uri(ref: str, max_bytes: int) -> bytes:
    """Decode a `data:image/...;base64,` URI."""
    header, comma, payload = ref[5:].partition(",")
    if not comma or len(header) > 256:
        raise InvalidRequest("malformed data URI; write it as data:image/png;base64,<base64 bytes>")
    media, *params = (part.strip().lower() for part in header.split(";"))
    if not media.startswith("image/"):
        raise InvalidRequest(
            f"data URI has media type {clean_text(media, 40)!r}; "
            "only image/* data URIs are accepted"
        )
    if "base64" not in params:
        raise InvalidRequest(
            "data URI is not base64-encoded; write it as data:image/png;base64,<base64 bytes>"
        )
    return _decode_base64(payload, max_bytes)


def read_inline(text: str, max_bytes: int) -> bytes:
    """Decode an inline reference (a data URI or bare base64) into the image file's bytes."""
    if scheme_of(text) == "data":
        return _decode_data_uri(text, max_bytes)
    return _decode_base64(text, max_bytes)
