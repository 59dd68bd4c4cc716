"""The WebSocket session protocol (llava.fronts.sockets) against a recorded front: which session
header each frame goes with, what the connection holds after each reply, and the frames that
stand for replies a front could not finish (the end to end is tests/integration/test_sockets
and tests/images)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from llava.api.headers import NEW_SESSION, SESSION_HEADER
from llava.api.replies import Reply
from llava.fronts.sockets import SocketSession, serve

HEADER = SESSION_HEADER.lower()


class Front:
    """Answers each request with the replies queued for it; records the headers it got."""

    def __init__(self, *replies: list[Reply]) -> None:
        self.replies = list(replies)
        self.headers: list[dict[str, str]] = []

    async def exchange(self, body: bytes, headers: dict[str, str]) -> AsyncIterator[Reply]:
        self.headers.append(headers)
        for reply in self.replies.pop(0):
            yield reply


def whole(obj: dict[str, Any], status: int = 200) -> list[Reply]:
    return [Reply(json.dumps(obj).encode(), status=status)]


def answer(session: SocketSession, frame: Any) -> list[dict[str, Any]]:
    async def run() -> list[str]:
        text = frame if isinstance(frame, str) else json.dumps(frame)
        return [out async for out in session.answer(text)]

    return [json.loads(out) for out in asyncio.run(run())]


def test_the_connection_holds_what_open_gave_until_close() -> None:
    front = Front(
        whole({"session_id": "s-1"}),
        whole({"text": "a"}),
        whole({"session_id": "s-1", "closed": True}),
    )
    session = SocketSession(front.exchange)
    assert answer(session, {"type": "open_session", "image": "data:,"}) == [{"session_id": "s-1"}]
    assert answer(session, {"type": "query", "prompt": "q"}) == [{"text": "a"}]
    answer(session, {"type": "close_session"})
    assert [h.get(HEADER) for h in front.headers] == [NEW_SESSION, "s-1", "s-1"]
    assert session.session_id is None


def test_a_session_ended_elsewhere_is_let_go() -> None:
    gone = {"error": {"code": "session_expired", "message": "expired", "field": None}}
    session = SocketSession(Front(whole(gone, 400)).exchange)
    session.session_id = "s-1"
    assert answer(session, {"type": "query", "prompt": "q"}) == [{**gone, "status": 400}]
    assert session.session_id is None


def test_a_busy_session_is_kept() -> None:
    busy = {"error": {"code": "session_busy", "message": "busy", "field": None}}
    session = SocketSession(Front(whole(busy, 409)).exchange)
    session.session_id = "s-1"
    assert answer(session, {"type": "query", "prompt": "q"})[0]["status"] == 409
    assert session.session_id == "s-1"


def test_a_streamed_answer_is_one_frame_a_line_whatever_the_chunks() -> None:
    chunks = [b'{"text": "a"}\n{"te', b'xt": "b"}\n', b'{"usage": {}, "finish_reason": "stop"}\n']
    replies = [Reply(chunk, last=i == len(chunks) - 1) for i, chunk in enumerate(chunks)]
    session = SocketSession(Front(replies).exchange)
    session.session_id = "s-1"
    frames = answer(session, {"type": "query", "prompt": "q", "stream": True})
    assert frames == [{"text": "a"}, {"text": "b"}, {"usage": {}, "finish_reason": "stop"}]


def test_a_stream_cut_before_its_last_line_ends_with_an_error_frame() -> None:
    session = SocketSession(Front([Reply(b'{"text": "a"}\n', last=False)]).exchange)
    session.session_id = "s-1"
    *_, last = answer(session, {"type": "query", "prompt": "q", "stream": True})
    assert last["status"] == 500 and "ask again" in last["error"]["message"]


def test_a_named_session_is_held_only_once_it_is_answered() -> None:
    refused = {"error": {"code": "invalid_request", "message": "bad id", "field": "session_id"}}
    front = Front(whole(refused, 400), whole({"session_id": "s-9"}))
    session = SocketSession(front.exchange)
    answer(session, {"type": "query", "prompt": "q", "session_id": "bad id!"})
    assert session.session_id is None  # so the connection can still open one
    assert answer(session, {"type": "open_session", "image": "data:,"}) == [{"session_id": "s-9"}]


def test_aws_s_close_ends_the_held_session_too() -> None:
    session = SocketSession(Front(whole({"session_id": "s-1", "closed": True})).exchange)
    session.session_id = "s-1"
    answer(session, {"requestType": "CLOSE"})
    assert session.session_id is None


def test_a_session_lost_mid_stream_is_let_go() -> None:
    lost = b'{"error": {"code": "session_lost", "message": "gone", "field": null}}\n'
    replies = [Reply(b'{"text": "a"}\n', last=False), Reply(lost, last=True)]
    session = SocketSession(Front(replies).exchange)
    session.session_id = "s-1"
    frames = answer(session, {"type": "query", "prompt": "q", "stream": True})
    assert frames[-1]["error"]["code"] == "session_lost" and session.session_id is None


def test_a_client_that_leaves_mid_answer_cancels_it() -> None:
    """The front's exchange is closed at once (its replica call cancelled), not read to its
    end into a closed socket."""
    closed = asyncio.Event()

    async def exchange(body: bytes, headers: dict[str, str]) -> AsyncIterator[Reply]:
        try:
            yield Reply(b'{"text": "a"}\n', last=False)
            await asyncio.sleep(3600)  # an answer that would go on for an hour
            yield Reply(b'{"usage": {}}\n', last=True)
        finally:
            closed.set()

    class Socket:
        def __init__(self) -> None:
            self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            self.sent: list[str] = []

        async def receive(self) -> dict[str, Any]:
            return await self.incoming.get()

        async def send_text(self, text: str) -> None:
            self.sent.append(text)
            if len(self.sent) == 1:  # the first line is out: the client leaves
                self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1001})

    async def run() -> list[str]:
        socket = Socket()
        session = SocketSession(exchange)
        session.session_id = "s-1"
        frame = json.dumps({"type": "query", "prompt": "q", "stream": True})
        socket.incoming.put_nowait({"type": "websocket.receive", "text": frame})
        await asyncio.wait_for(serve(socket, session), 30)
        await asyncio.wait_for(closed.wait(), 30)
        return socket.sent

    assert asyncio.run(run()) == ['{"text": "a"}']


def test_frames_the_front_never_sees() -> None:
    front = Front()
    session = SocketSession(front.exchange)
    [bad] = answer(session, "{not json")
    [listed] = answer(session, [1, 2])
    [orphan] = answer(session, {"type": "query", "prompt": "q"})
    session.session_id = "s-1"
    [again] = answer(session, {"type": "open_session", "image": "data:,"})
    [other] = answer(session, {"type": "query", "prompt": "q", "session_id": "s-2"})
    assert [f["status"] for f in (bad, listed, orphan, again, other)] == [400] * 5
    assert [f["error"]["field"] for f in (orphan, again, other)] == [
        "session_id",
        "type",
        "session_id",
    ]
    assert front.headers == []


def test_a_reply_that_is_not_json_is_an_error_frame_not_a_crash() -> None:
    front = Front([Reply(b"<html>oops</html>", status=502)])
    session = SocketSession(front.exchange)
    session.session_id = "s-1"
    [frame] = answer(session, {"type": "generate", "image": "data:,", "prompt": "q"})
    assert frame["status"] == 500 and frame["error"]["code"]
    assert HEADER not in front.headers[0]  # a generate is answered without the session
