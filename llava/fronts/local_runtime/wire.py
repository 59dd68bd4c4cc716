"""The HTTP plumbing of the local runtime: request bodies, chunks, event-stream frames, and how
a container says it will not take a request (gone, or draining)."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import httpx

from llava.fronts.local_runtime.errors import Refusal
from llava.fronts.local_runtime.eventstream import exception_event, payload_part


class InstanceGone(Exception):
    """The instance did not take the request: it is down, or draining (scale-in, an update)."""


def is_draining(status: int, content: bytes) -> bool:
    """Whether a container refused a request because it is shutting down (503 `draining`)."""
    return status == 503 and b'"draining"' in content[:4096]


def container_frames(r: httpx.Response) -> Iterator[bytes]:
    """Event-stream frames for the container's chunks as they arrive; a broken stream ends
    with a `ModelStreamError` event (error code `StreamBroken`)."""
    try:
        for chunk in r.iter_raw():
            if chunk:
                yield payload_part(chunk)
    except httpx.HTTPError as exc:
        yield exception_event(
            "ModelStreamError",
            f"The stream from container primary broke: {type(exc).__name__}: {exc}",
            ErrorCode="StreamBroken",
        )


def read_body(h: BaseHTTPRequestHandler, limit: int) -> bytes:
    """The request body, by Content-Length or chunked transfer coding; one over `limit` bytes
    is refused (413) without being kept."""
    if "chunked" in (h.headers.get("Transfer-Encoding") or "").lower():
        parts: list[bytes] = []
        total = 0
        while True:
            size = int(h.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
            total += size
            if total > limit:
                raise _too_large(total, limit)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            parts.append(h.rfile.read(size))
            h.rfile.readline()
    try:
        length = int(h.headers.get("Content-Length") or 0)
    except ValueError:
        raise Refusal(400, "ValidationError", "Content-Length is not a number.") from None
    if length > limit:
        raise _too_large(length, limit)
    return h.rfile.read(length) if length > 0 else b""


def _too_large(length: int, limit: int) -> Refusal:
    return Refusal(413, "ValidationError", f"Request body is {length} bytes; the limit is {limit}.")


def write_chunk(h: BaseHTTPRequestHandler, data: bytes) -> None:
    """Write one HTTP/1.1 chunk (an empty one ends the body) and flush it."""
    h.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
    h.wfile.flush()
