"""The Ray front's ingress: /ping waits for a replica to be ready, and `drain` waits for the
replies in flight, streams included (stand-in handles for Ray's: the end to end is in
tests/images, the Ray image stopped mid-answer)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the Ray front needs the ray extra")

from starlette.requests import Request  # noqa: E402

from llava.fronts.ray import ingress  # noqa: E402
from llava.fronts.ray.ingress import Ingress  # noqa: E402


class Replicas:
    """What the ingress calls: `options(stream=...)`, `.remote(...)`, `.ready.remote()`."""

    def __init__(self) -> None:
        self.loaded = asyncio.Event()
        self.release = asyncio.Event()  # the stream's last chunk waits for it
        self.ready = self

    def options(self, stream: bool) -> Replicas:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if not args:  # ready.remote(): answered once a replica has loaded
            return self._loaded()
        self.call = Streamed(self._replies())
        return self.call

    async def _loaded(self) -> bool:
        await self.loaded.wait()
        return True

    async def _replies(self) -> AsyncIterator[dict[str, Any]]:
        head = {"status": 200, "headers": {}, "content_type": "application/x-ndjson"}
        yield {**head, "body": b'{"text":"a"}\n', "last": False}
        await self.release.wait()
        yield {**head, "body": b'{"finish_reason":"stop"}\n', "last": True}


class Streamed:
    """A replica's streamed replies as Ray hands them over: iterable, and cancellable."""

    def __init__(self, replies: AsyncIterator[dict[str, Any]]) -> None:
        self.replies, self.cancelled = replies, False

    def __aiter__(self) -> Streamed:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self.replies.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


def request(path: str, headers: dict[str, str] | None = None) -> Request:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": path, "headers": raw, "query_string": b""}
    return Request(scope, receive)


def test_ping_says_503_until_a_replica_has_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress, "READY_WAIT_S", 0.05)

    async def run() -> list[int]:
        replicas = Replicas()
        front = Ingress(replicas)
        loading = (await front.http(request("/ping"))).status_code
        replicas.loaded.set()
        return [loading, (await front.http(request("/ping"))).status_code]

    assert asyncio.run(run()) == [503, 200]


def test_drain_waits_for_a_stream_to_end() -> None:
    async def run() -> tuple[bool, int, int]:
        replicas = Replicas()
        front = Ingress(replicas)
        response: Any = await front.http(request("/invocations"))
        chunks = response.body_iterator
        first = await chunks.__anext__()
        assert first == b'{"text":"a"}\n'
        draining = asyncio.ensure_future(front.drain(5))
        await asyncio.sleep(0.05)  # the drain must still be waiting: the stream is open
        waited = not draining.done()
        cut_at_timeout = await front.drain(0.01)
        replicas.release.set()
        async for _ in chunks:
            pass
        del chunks, response  # sent: Starlette lets the response go
        return waited, cut_at_timeout, await draining

    assert asyncio.run(run()) == (True, 1, 0)


def test_a_stream_dropped_before_it_began_is_not_waited_for() -> None:
    async def run() -> tuple[int, bool]:
        replicas = Replicas()
        front = Ingress(replicas)
        response: Any = await front.http(request("/invocations"))
        del response  # the client left before the first chunk was sent
        return await front.drain(1), replicas.call.cancelled

    assert asyncio.run(run()) == (0, True)  # counted out, and the replica's answer cancelled


def test_draining_refuses_new_sessions_and_answers_held_ones() -> None:
    async def run() -> tuple[Any, Any]:
        replicas = Replicas()
        replicas.release.set()
        front = Ingress(replicas)
        await front.drain(0)
        new = await front.http(request("/invocations"))
        held = await front.http(request("/invocations", {"X-Amzn-SageMaker-Session-Id": "abc-1"}))
        return new, held

    new, held = asyncio.run(run())
    assert new.status_code == 503 and json.loads(new.body)["error"]["code"] == "draining"
    assert held.status_code == 200


def test_a_request_arriving_as_the_last_ends_extends_the_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One on its way from Ray's proxy when the ingress fell idle is waited for too."""
    monkeypatch.setattr(ingress, "SETTLE_S", 0.2)

    async def run() -> tuple[bool, int]:
        replicas = Replicas()
        replicas.release.set()
        front = Ingress(replicas)
        first: Any = await front.http(
            request("/invocations", {"X-Amzn-SageMaker-Session-Id": "a-1"})
        )
        draining = asyncio.ensure_future(front.drain(5))
        async for _ in first.body_iterator:
            pass
        del first  # the last reply ends: the ingress is idle
        await asyncio.sleep(0.05)  # within the settle time, the next one arrives
        second: Any = await front.http(
            request("/invocations", {"X-Amzn-SageMaker-Session-Id": "a-2"})
        )
        await asyncio.sleep(0.4)  # past the settle time: the drain must still wait for it
        waited = not draining.done()
        async for _ in second.body_iterator:
            pass
        del second
        return waited, await draining

    assert asyncio.run(run()) == (True, 0)


def replica_call(replies: list[dict[str, Any]], failure: Exception | None = None) -> Streamed:
    """What `replicas.remote(...)` gives for a socket frame: replies, then a failure if any."""

    async def relayed() -> AsyncIterator[dict[str, Any]]:
        for reply in replies:
            yield reply
        if failure is not None:
            raise failure

    return Streamed(relayed())


class SocketReplicas(Replicas):
    def __init__(self, call: Streamed) -> None:
        super().__init__()
        self.call = call

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.call


LINE = {"status": 200, "headers": {}, "content_type": "application/x-ndjson", "last": False}
HELD = {"x-amzn-sagemaker-session-id": "a-1"}


def exchange(front: Ingress, headers: dict[str, str], take: int | None = None) -> list[Any]:
    """Run one socket frame's exchange, reading `take` replies (all if None)."""

    async def run() -> list[Any]:
        replies = front._exchange(b"{}", headers)
        out = []
        async for reply in replies:
            out.append(reply)
            if take is not None and len(out) == take:
                await replies.aclose()  # the client left
                break
        return out

    return asyncio.run(run())


def test_a_replica_that_fails_under_a_socket_is_an_error_frame_and_is_counted_out() -> None:
    call = replica_call([{**LINE, "body": b'{"text":"a"}\n'}], RuntimeError("the replica died"))
    front = Ingress(SocketReplicas(call))
    replies = exchange(front, HELD)
    assert [r.status for r in replies] == [200, 500]
    assert json.loads(replies[-1].body)["error"]["message"]
    assert front.in_flight == 0 and not call.cancelled


def test_an_answer_its_socket_left_is_cancelled_and_counted_out() -> None:
    call = replica_call([{**LINE, "body": b'{"text":"a"}\n'}, {**LINE, "body": b'{"text":"b"}\n'}])
    front = Ingress(SocketReplicas(call))
    exchange(front, HELD, take=1)
    assert call.cancelled and front.in_flight == 0


def test_a_draining_ingress_refuses_a_socket_s_new_session() -> None:
    call = replica_call([{**LINE, "body": b'{"text":"a"}\n', "last": True}])
    front = Ingress(SocketReplicas(call))
    asyncio.run(front.drain(0))
    [refused] = exchange(front, {"x-amzn-sagemaker-session-id": "NEW_SESSION"})
    assert refused.status == 503 and json.loads(refused.body)["error"]["code"] == "draining"
    assert [r.status for r in exchange(front, HELD)] == [200]


def test_a_replica_that_fails_before_answering_http_is_an_error_reply_and_is_counted_out() -> None:
    """The same exchange as a socket frame's: the kit's error body, not a bare 500 from Ray."""
    front = Ingress(SocketReplicas(replica_call([], RuntimeError("the replica died"))))

    async def run() -> Any:
        return await front.http(request("/invocations", dict(HELD)))

    response = asyncio.run(run())
    assert response.status_code == 500 and front.in_flight == 0
    assert json.loads(response.body)["error"]["message"]


class Unroutable(Replicas):
    """Ray's handle failing as it is called (its router not set up): before any reply."""

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Router is not initialized")


def test_a_call_ray_refuses_at_once_is_an_error_reply_and_is_counted_out() -> None:
    front = Ingress(Unroutable())

    async def run() -> Any:
        return await front.http(request("/invocations", dict(HELD)))

    response = asyncio.run(run())
    assert response.status_code == 500 and front.in_flight == 0
    assert json.loads(response.body)["error"]["message"]


def test_a_replica_lost_mid_stream_cuts_the_http_stream_it_cannot_finish() -> None:
    """The status is sent: the stream is cut, as before, not ended with a stray JSON body."""
    call = replica_call([{**LINE, "body": b'{"text":"a"}\n'}], RuntimeError("the replica died"))
    front = Ingress(SocketReplicas(call))

    async def run() -> list[bytes]:
        response: Any = await front.http(request("/invocations", dict(HELD)))
        chunks = []
        with pytest.raises(RuntimeError, match="lost mid-stream"):
            async for chunk in response.body_iterator:
                chunks.append(chunk)
        return chunks

    assert asyncio.run(run()) == [b'{"text":"a"}\n']
    assert front.in_flight == 0
