"""One WebSocket connection as one session: SageMaker's bidirectional streaming
(`InvokeEndpointWithBidirectionalStream`), which reaches a container's
`/invocations-bidirectional-stream` (SOCKET_PATH) on its port 8080.

The frames a client sends are bodies of the session API (`open_session`, `query`, `rollback`,
`close_session`, `generate`) with no session id: the connection holds the id its
`open_session` got, or takes it from the first frame that names one (`"session_id"`: a session
an earlier connection left). Each frame the server sends is one JSON object of the reply HTTP
would give: a whole reply, or one line of a streamed answer (its last line has `usage`, or
`error`); an error reply is HTTP's error body with its status added
(`{"error": {...}, "status": 404}`), so the codes are HTTP's. Closing the connection leaves the
session open until its TTL, to be taken up by id on another connection. Frames are answered in
order, one request at a time; the WebSocket's own pings are answered beside them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from llava.api.headers import JSON_CONTENT_TYPE, NEW_SESSION, SESSION_HEADER, STREAM_CONTENT_TYPE
from llava.api.replies import Reply
from llava.core.errors import InvalidRequest, KitError, SessionClosed, SessionNotFound

# Replies after which a connection no longer holds its session.
ENDED = {SessionClosed.code, SessionNotFound.code, "session_expired", "session_lost"}

# A front's way to one request's replies: (body, headers) -> the replies, as HTTP sends them.
Exchange = Callable[[bytes, dict[str, str]], AsyncIterator[Reply]]


def error_frame(error: KitError) -> str:
    """HTTP's JSON error body for `error`, with its status."""
    return json.dumps({**error.to_body(), "status": error.status})


class SocketSession:
    """The session one connection holds, and the frames that answer each frame it sends."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.session_id: str | None = None

    async def answer(self, frame: str | bytes) -> AsyncGenerator[str, None]:
        """Yield the frames that answer one client frame."""
        try:
            obj, headers = self._request(frame)
        except KitError as error:
            yield error_frame(error)
            return
        body = json.dumps(obj).encode()
        streamed, pending, ended = False, b"", True
        async for reply in self.exchange(body, headers):
            if reply.last is None:  # a whole reply: one frame
                yield self._whole(obj, reply)
                return
            streamed = True
            pending += reply.body
            *lines, pending = pending.split(b"\n")
            for line in filter(bytes.strip, lines):
                ended = _is_last(line)
                yield line.decode()
        if pending.strip():
            ended = _is_last(pending)
            yield pending.decode()
        if not streamed or not ended:
            yield error_frame(KitError("the answer ended before its last line: ask again"))

    def _request(self, frame: str | bytes) -> tuple[dict[str, Any], dict[str, str]]:
        """Check a frame; return its body and the headers HTTP would carry the session in."""
        try:
            obj = json.loads(frame)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"a frame is one JSON object of the session API: {exc}") from exc
        if not isinstance(obj, dict):
            raise InvalidRequest("a frame is one JSON object of the session API")
        named = obj.get("session_id")
        if named is not None and self.session_id is not None and named != self.session_id:
            raise InvalidRequest(
                f"this connection holds session {self.session_id}: open another connection "
                "for another session",
                field="session_id",
            )
        if obj.get("type") == "open_session":
            if self.session_id is not None:
                raise InvalidRequest(
                    "this connection holds a session: close_session first, or open another "
                    "connection",
                    field="type",
                )
            session: str | None = NEW_SESSION
        elif obj.get("type") == "generate":
            session = None  # answered without a session
        else:
            if isinstance(named, str):
                self.session_id = named  # taken up from an earlier connection
            elif self.session_id is None:
                raise InvalidRequest(
                    "this connection holds no session: send open_session first, or name one "
                    'an earlier connection opened with "session_id"',
                    field="session_id",
                )
            session = self.session_id
        accept = STREAM_CONTENT_TYPE if obj.get("stream") is True else JSON_CONTENT_TYPE
        headers = {"content-type": JSON_CONTENT_TYPE, "accept": accept}
        if session is not None:
            headers[SESSION_HEADER.lower()] = session
        return obj, headers

    def _whole(self, request: dict[str, Any], reply: Reply) -> str:
        """The frame of a whole reply; note the session it opens, names or ends."""
        try:
            obj = json.loads(reply.body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None
        if not isinstance(obj, dict):
            return error_frame(KitError("the server's reply was not JSON: see its log"))
        if reply.status >= 400:
            if obj.get("error", {}).get("code") in ENDED:
                self.session_id = None
            return json.dumps({**obj, "status": reply.status})
        kind = request.get("type")
        if kind == "close_session":
            self.session_id = None
        elif kind == "open_session" and isinstance(obj.get("session_id"), str):
            self.session_id = obj["session_id"]
        return reply.body.decode()


def _is_last(line: bytes) -> bool:
    """Tell whether a streamed line ends its answer (its usage, or an error)."""
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(obj, dict) and ("usage" in obj or "error" in obj)
