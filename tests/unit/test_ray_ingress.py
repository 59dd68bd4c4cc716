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
        return self._replies()

    async def _loaded(self) -> bool:
        await self.loaded.wait()
        return True

    async def _replies(self) -> AsyncIterator[dict[str, Any]]:
        head = {"status": 200, "headers": {}, "content_type": "application/x-ndjson"}
        yield {**head, "body": b'{"text":"a"}\n', "last": False}
        await self.release.wait()
        yield {"body": b'{"finish_reason":"stop"}\n'}


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
    async def run() -> int:
        front = Ingress(Replicas())
        response: Any = await front.http(request("/invocations"))
        del response  # the client left before the first chunk was sent
        return await front.drain(1)

    assert asyncio.run(run()) == 0


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
