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

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any

from llava.api.aws import translate_dialects
from llava.api.headers import JSON_CONTENT_TYPE, NEW_SESSION, SESSION_HEADER, STREAM_CONTENT_TYPE
from llava.api.replies import Reply
from llava.core.errors import InvalidRequest, KitError, SessionClosed, SessionNotFound

# Replies after which a connection no longer holds its session.
ENDED = {SessionClosed.code, SessionNotFound.code, "session_expired", "session_lost"}

# A front's way to one request's replies: (body, headers) -> the replies, as HTTP sends them.
Exchange = Callable[[bytes, dict[str, str]], AsyncGenerator[Reply, None]]


async def serve(websocket: Any, session: SocketSession) -> None:
    """Answer an accepted connection's frames in order until it closes (`websocket`: Starlette's
    or any with its `receive()` and `send_text()`). A client that leaves mid-answer cancels the
    answer, as an HTTP client that leaves does: its session is free for the next connection."""
    frames: asyncio.Queue[str | bytes | None] = asyncio.Queue()
    reader = asyncio.create_task(_read(websocket, frames))
    try:
        while (frame := await frames.get()) is not None:
            answering = asyncio.create_task(_send_answer(websocket, session, frame))
            await asyncio.wait({answering, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not answering.done():  # the client left mid-answer
                answering.cancel()
                with suppress(asyncio.CancelledError):
                    await answering
                return
            answering.result()
    finally:
        reader.cancel()
        with suppress(asyncio.CancelledError):
            await reader


async def _read(websocket: Any, frames: asyncio.Queue[str | bytes | None]) -> None:
    """Queue each frame the client sends; None once it has closed."""
    try:
        while (message := await websocket.receive())["type"] != "websocket.disconnect":
            frames.put_nowait(message.get("text") or message.get("bytes") or b"")
    finally:
        frames.put_nowait(None)


async def _send_answer(websocket: Any, session: SocketSession, frame: str | bytes) -> None:
    async with aclosing(session.answer(frame)) as replies:
        async for reply in replies:
            await websocket.send_text(reply)


def error_frame(error: KitError) -> str:
    """HTTP's JSON error body for `error`, with its status."""
    return json.dumps({**error.to_body(), "status": error.status})


@dataclass
class Frame:
    """One client frame, checked: its body, its kind in the kit's own terms, the session."""

    body: dict[str, Any]
    kind: str | None
    session: str | None  # what HTTP's session header would say: NEW_SESSION, an id, or none


class SocketSession:
    """The session one connection holds, and the frames that answer each frame it sends."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.session_id: str | None = None

    async def answer(self, text: str | bytes) -> AsyncGenerator[str, None]:
        """Yield the frames that answer one client frame."""
        try:
            frame = self._check(text)
        except KitError as error:
            yield error_frame(error)
            return
        accept = STREAM_CONTENT_TYPE if frame.body.get("stream") is True else JSON_CONTENT_TYPE
        headers = {"content-type": JSON_CONTENT_TYPE, "accept": accept}
        if frame.session is not None:
            headers[SESSION_HEADER.lower()] = frame.session
        streamed, pending, ended = False, b"", True
        async with aclosing(self.exchange(json.dumps(frame.body).encode(), headers)) as replies:
            async for reply in replies:
                if reply.last is None:  # a whole reply (or an error once streaming began)
                    yield self._whole(frame, reply)
                    return
                if not streamed:
                    self._holds(frame)  # the stream began: its session is this connection's
                streamed = True
                pending += reply.body
                *lines, pending = pending.split(b"\n")
                for line in filter(bytes.strip, lines):
                    ended = self._is_last(line)
                    yield line.decode()
        if pending.strip():
            ended = self._is_last(pending)
            yield pending.decode()
        if not streamed or not ended:
            yield error_frame(KitError("the answer ended before its last line: ask again"))

    def _check(self, text: str | bytes) -> Frame:
        """Check a frame against the session this connection holds."""
        try:
            body = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"a frame is one JSON object of the session API: {exc}") from exc
        if not isinstance(body, dict):
            raise InvalidRequest("a frame is one JSON object of the session API")
        try:  # AWS's dialects (requestType, the LLaVA sample) in the kit's terms
            kind = translate_dialects(dict(body))[0].get("type")
        except KitError:
            kind = None  # the front answers what is wrong with it
        named = body.get("session_id")
        if named is not None and self.session_id is not None and named != self.session_id:
            raise InvalidRequest(
                f"this connection holds session {self.session_id}: open another connection "
                "for another session",
                field="session_id",
            )
        if kind == "open_session":
            if self.session_id is not None:
                raise InvalidRequest(
                    "this connection holds a session: close_session first, or open another "
                    "connection",
                    field="type",
                )
            return Frame(body, kind, NEW_SESSION)
        if kind == "generate":
            return Frame(body, kind, None)  # answered without a session
        if named is None and self.session_id is None:
            raise InvalidRequest(
                "this connection holds no session: send open_session first, or name one an "
                'earlier connection opened with "session_id"',
                field="session_id",
            )
        return Frame(body, kind, named if isinstance(named, str) else self.session_id)

    def _holds(self, frame: Frame) -> None:
        """A frame that named a session was answered: the connection holds it from now on."""
        if frame.session not in (None, NEW_SESSION):
            self.session_id = frame.session

    def _whole(self, frame: Frame, reply: Reply) -> str:
        """The frame of a whole reply; note the session it opens, names or ends."""
        try:
            obj = json.loads(reply.body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None
        if not isinstance(obj, dict):
            return error_frame(KitError("the server's reply was not JSON: see its log"))
        if reply.status >= 400:
            self._ends(obj)
            return json.dumps({**obj, "status": reply.status})
        if frame.kind == "close_session":
            self.session_id = None
        elif frame.kind == "open_session" and isinstance(obj.get("session_id"), str):
            self.session_id = obj["session_id"]
        else:
            self._holds(frame)
        return reply.body.decode()

    def _ends(self, obj: dict[str, Any]) -> None:
        """An error that says the session is gone lets the connection go of it."""
        error = obj.get("error")
        if isinstance(error, dict) and error.get("code") in ENDED:
            self.session_id = None

    def _is_last(self, line: bytes) -> bool:
        """Tell whether a streamed line ends its answer (its usage, or an error)."""
        try:
            obj = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return False
        if not isinstance(obj, dict):
            return False
        self._ends(obj)
        return "usage" in obj or "error" in obj
