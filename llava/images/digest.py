"""Identify a picture by its content: the same image sent by URL, s3 or inline base64 matches."""

from __future__ import annotations

import hashlib
from typing import Any

from llava.images.inline import read_inline
from llava.images.refs import is_inline


def content_digest(data: Any) -> str:
    """Hash what an image reference read to: the image file's bytes, whatever carried them.

    Inline references are read as text (their base64 is decoded with the image, off the worker's
    threads); their bytes are hashed here, so base64 and a URL to the same file agree.
    """
    if isinstance(data, str):
        text = data.encode()
        data = read_inline(data, max_bytes=len(data)) if is_inline(data) else text
    elif not isinstance(data, (bytes, bytearray)):
        raw = getattr(data, "tobytes", None)  # an already decoded image
        data = raw() if callable(raw) else repr(data).encode()
    return hashlib.sha256(data).hexdigest()
