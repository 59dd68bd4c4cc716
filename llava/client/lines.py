"""Reassemble newline-delimited JSON objects from streamed byte chunks."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from llava.client.errors import TransportError


def ndjson_lines(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """Reassemble newline-delimited JSON objects from byte chunks with arbitrary boundaries."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield _parse_line(line)
    if buffer.strip():
        yield _parse_line(buffer)


def _parse_line(line: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(f"unreadable stream line {line[:200]!r}: {exc}") from exc
    if not isinstance(obj, dict):
        raise TransportError(f"stream line is not a JSON object: {line[:200]!r}")
    return obj
