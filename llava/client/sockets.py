"""The WebSocket transport: one session over one connection to a container's
`/invocations-bidirectional-stream` (SageMaker's bidirectional streaming), with `websockets`.

Each request goes as one frame, the session API's body with the session id in it; each answer
comes back as the frames the server sends (llava.fronts.sockets): one for a whole reply, one per
line of a streamed answer. A connection holds one session: open another connection for another.

    client = SessionClient.connect("ws://127.0.0.1:8080")
    with client.session(image="examples/sample.png") as s:
        print(s.ask("What is in the picture?").text)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llava.api.headers import JSON_CONTENT_TYPE, NEW_SESSION, SOCKET_PATH
from llava.client.errors import ErrorResponse, TransportError
from llava.client.response import Response

SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}


def socket_url(url: str) -> str:
    """The WebSocket URL for a server's root URL, or the socket's own URL as it is."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{url!r}: a ws://, wss://, http:// or https:// URL")
    path = parts.path if parts.path not in ("", "/") else SOCKET_PATH
    return urlunsplit((SCHEMES[parts.scheme], parts.netloc, path, parts.query, ""))


class SocketTransport:
    """Move requests over one WebSocket: frames out, frames back, in order."""

    def __init__(self, url: str, *, timeout: float = 120.0) -> None:
        from websockets.sync.client import connect

        self.url = socket_url(url)
        self.timeout = timeout
        self._stack = ExitStack()  # websockets wants its connection used as a context
        self._broken: str | None = None  # why the connection was closed under its caller
        self._streaming = False
        try:
            # max_size: a reply holds at most a session's answer; frames out are bodies the
            # server limits itself (16 MiB, as over HTTP).
            connection = connect(self.url, open_timeout=timeout, max_size=2**24)
            self._socket = self._stack.enter_context(connection)
        except Exception as exc:  # refused, unreachable, timed out, not a WebSocket
            raise TransportError(f"{self.url}: {exc}", original=exc) from exc

    def _send(self, body: bytes, session_id: str | None) -> None:
        if self._broken is not None:
            raise TransportError(self._broken)
        if self._streaming:
            raise TransportError(
                "a streamed answer on this connection is still being read: finish it first"
            )
        obj = json.loads(body)
        if session_id not in (None, NEW_SESSION):
            obj["session_id"] = session_id  # the frame carries what HTTP's header would
        try:
            self._socket.send(json.dumps(obj))
        except Exception as exc:
            raise self._break(exc) from exc

    def _receive(self) -> dict[str, Any]:
        try:
            frame = self._socket.recv(timeout=self.timeout)
        except Exception as exc:  # timed out, or closed
            raise self._break(exc) from exc
        try:
            obj = json.loads(frame)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._break(f"unreadable frame {frame[:200]!r}: {exc}") from exc
        if not isinstance(obj, dict):
            raise self._break(f"a frame that is not a JSON object: {frame[:200]!r}")
        return obj

    def _break(self, cause: object) -> TransportError:
        """Close a connection whose next frame could be the wrong reply's (an answer still
        coming after a timeout): every later call says so instead of misreading it."""
        self._broken = (
            f"{self.url}: {cause}; this connection is closed: connect again and take the "
            "session up by its id"
        )
        self._stack.close()
        return TransportError(
            self._broken, original=cause if isinstance(cause, Exception) else None
        )

    def invoke(self, body: bytes, session_id: str | None) -> Response:
        self._send(body, session_id)
        return _response(self._receive())

    def invoke_stream(self, body: bytes, session_id: str | None) -> Iterator[bytes]:
        self._send(body, session_id)
        self._streaming = True
        ended = False
        try:
            while not ended:
                frame = self._receive()
                if "status" in frame and "error" in frame:  # refused before the answer began
                    ended = True
                    raise ErrorResponse(_response(frame))
                ended = _ends_answer(frame)
                yield json.dumps(frame).encode() + b"\n"
        finally:
            with suppress(TransportError):  # a broken connection says so on its next call
                while not ended and self._broken is None:  # left unread: its frames still come
                    frame = self._receive()
                    ended = _ends_answer(frame)
            self._streaming = False

    def close(self) -> None:
        """Close the connection; the session stays on the server until its TTL."""
        self._stack.close()


def _ends_answer(frame: dict[str, Any]) -> bool:
    """A streamed answer's last frame: its usage, or an error."""
    return "usage" in frame or "error" in frame


def _response(frame: dict[str, Any]) -> Response:
    """A whole reply's frame as HTTP's response: an error frame's status comes out of it."""
    status = int(frame.pop("status", 200)) if "error" in frame else 200
    return Response(status, {"Content-Type": JSON_CONTENT_TYPE}, json.dumps(frame).encode())
