"""Byte limits and the overall deadline while reading an image body in chunks."""

from __future__ import annotations

import time
from collections.abc import Iterable

from llava.core.errors import ImageFetchError, ImageTooLarge
from llava.images.refs import INLINE_HINT

READ_CHUNK = 64 * 1024


def too_many_bytes(what: str, max_bytes: int) -> ImageTooLarge:
    """Build the error for an image over the byte limit."""
    return ImageTooLarge(
        f"{what} is larger than the {max_bytes}-byte limit; send a smaller or more "
        "compressed image",
        max_bytes=max_bytes,
    )


def read_limited(chunks: Iterable[bytes], max_bytes: int, deadline: float, what: str) -> bytes:
    """Collect chunks, aborting as soon as they pass `max_bytes` or the deadline."""
    buffer = bytearray()
    for chunk in chunks:
        buffer += chunk
        if len(buffer) > max_bytes:
            raise too_many_bytes(what, max_bytes)
        if time.monotonic() > deadline:
            raise ImageFetchError(
                f"fetching {what} did not finish within the total deadline; use a faster "
                f"host or {INLINE_HINT}"
            )
    return bytes(buffer)
