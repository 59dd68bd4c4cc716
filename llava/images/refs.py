"""Parse image references and describe them for logs without leaking their content."""

from __future__ import annotations

import re

INLINE_HINT = "send the image inline as base64 instead"
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}):")


def scheme_of(ref: str) -> str | None:
    """Return the lower-cased scheme of a reference, or None for bare base64."""
    # Base64 never contains ':', so anything with a scheme-shaped prefix is a URI.
    match = _SCHEME.match(ref)
    return match.group(1).lower() if match else None


def is_inline(ref: str) -> bool:
    """Tell whether a reference carries its image (data URI, base64) rather than naming one."""
    return not isinstance(ref, str) or scheme_of(ref.strip()) in (None, "data")


def clean_text(text: str, limit: int) -> str:
    """Keep only characters that are safe in a log line, and at most `limit` of them."""
    return re.sub(r"[^A-Za-z0-9.\-_:\[\]+/]", "", text[: limit * 4])[:limit]


def describe_ref(ref: str) -> str:
    """Describe an image reference for logs: scheme and host only, never path, query or data."""
    if not isinstance(ref, str):
        return "<non-string image reference>"
    text = ref.strip()
    if not text:
        return "<empty image reference>"
    scheme = scheme_of(text)
    if scheme is None:
        return f"base64 ({len(text)} chars)"
    if scheme == "data":
        media = text[5:69].split(",", 1)[0].split(";", 1)[0]
        return f"data:{clean_text(media, 32)} ({len(text)} chars)"
    if scheme in ("http", "https", "s3"):
        rest = text[len(scheme) + 1 : len(scheme) + 1 + 512].lstrip("/\\")
        authority = re.split(r"[/?#\\]", rest, maxsplit=1)[0]
        host = clean_text(authority.rpartition("@")[2].lower(), 60) or "<no host>"
        return f"{scheme}://{host}"[:80]
    return f"{clean_text(scheme, 32)}: reference (unsupported scheme)"
