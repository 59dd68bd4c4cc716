"""The HTTP routes of the Ray Serve front, answered exactly as the TorchServe front answers them.

`/ping` answers 200 once a replica can answer (its engine loaded), 503 before; `/invocations`
(SageMaker's path), `/predictions/<model>[/...]` (the TorchServe paths clients already use) and
`/v1/chat/completions`, `/v1/models` (OpenAI's) go to a replica, chosen by the session affinity
router from the request's session id. Bodies and headers pass through untouched: the replica's
service parses them as the TorchServe worker does. `/invocations-bidirectional-stream` is
SageMaker's WebSocket: one connection, one session (`llava.fronts.sockets`), its frames sent to
the replicas the same way. On SIGTERM the front first waits for the replies in flight (`drain`),
streams included, then lets Ray Serve shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from llava.api.body import decode_body
from llava.api.headers import NEW_SESSION, SESSION_HEADER, SOCKET_PATH, header, session_id_from
from llava.api.replies import Reply, as_kit_error, error_reply
from llava.core.errors import Draining, KitError
from llava.core.params import Limits
from llava.fronts.sockets import SocketSession, serve

log = logging.getLogger(__name__)

ROUTED_PREFIXES = ("/invocations", "/predictions/", "/v1/")
# How long /ping waits for a replica to say it is ready (SageMaker's ping times out at 2 s).
READY_WAIT_S = 1.5
# How long the ingress must see no request before a drain ends.
SETTLE_S = 0.5
HEALTHY = b'{"status": "Healthy"}'
LOADING = b'{"status": "Unhealthy", "message": "no replica has loaded the model yet"}'


def route_of(body: bytes, headers: dict[str, str]) -> str | None:
    """Return the session id a request names (header or body), for the router; None if none
    or if the body is not even JSON (the replica then answers the error)."""
    named = header(headers, SESSION_HEADER)
    if named and named.strip() != NEW_SESSION:
        return named.strip()  # most requests: no need to parse the body here
    try:
        decoded = decode_body(body, headers, Limits()) if body else {}
        return session_id_from(decoded if isinstance(decoded, dict) else {}, headers)
    except KitError:
        return None


def not_found(path: str) -> Response:
    """The JSON error for a path the front does not serve."""
    error = {
        "error": {
            "code": "not_found",
            "message": f"no route {path}: POST /invocations or /v1/chat/completions, GET /ping",
            "field": None,
        }
    }
    return Response(json.dumps(error), status_code=404, media_type="application/json")


METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
# This process's ingress, for `routes()`: Ray builds the app after the ingress, in its actor.
_BUILT: list[Ingress] = []


def routes() -> Starlette:
    """The ingress's ASGI app (Ray Serve carries WebSockets to an ASGI ingress only), built by
    Ray in the ingress's own process once the ingress is constructed (an app of bound routes
    does not pickle: Ray ships this function instead)."""
    front = _BUILT[-1]
    return Starlette(
        routes=[
            WebSocketRoute(SOCKET_PATH, front.socket),
            Route("/{path:path}", front.http, methods=METHODS),
        ]
    )


class Ingress:
    """Forward each request to the replica holding its session and relay its replies."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas.options(stream=True)
        self.probe = replicas.options(stream=False)
        self.ready = False  # a replica has answered `ready`: from then on Ray replaces replicas
        self.in_flight = 0  # requests whose reply (a stream's last chunk included) is not sent
        self.idle = asyncio.Event()
        self.idle.set()
        self.arrived = asyncio.Event()  # set by each request that reaches this ingress
        self.draining = False
        _BUILT[:] = [self]

    async def drain(self, timeout_s: float) -> int:
        """Take no new session (503 `draining`, as the TorchServe worker answers), and wait
        until no reply has been in flight for SETTLE_S (a request may still be on its way from
        Ray's proxy when the last one ends), at most `timeout_s`; return how many still are.
        The front's SIGTERM handler calls it before Ray Serve shuts down, which would cut the
        streams still relaying."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait_for(self.idle.wait(), left)
                self.arrived.clear()
                await asyncio.wait_for(self.arrived.wait(), min(SETTLE_S, left))
            except asyncio.TimeoutError:
                if self.in_flight == 0:
                    break  # quiet for SETTLE_S
        return self.in_flight

    def _begin(self) -> None:
        self.in_flight += 1
        self.idle.clear()
        self.arrived.set()

    def _end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    async def health(self) -> Response:
        """200 once a replica has loaded its model: until then a call to one waits (Ray queues
        it while replicas start), and /ping answers 503 after READY_WAIT_S."""
        if not self.ready:
            try:
                self.ready = bool(await asyncio.wait_for(self.probe.ready.remote(), READY_WAIT_S))
            except asyncio.TimeoutError:
                pass
            except Exception:  # any failure to reach a replica: not ready yet
                log.warning("no replica answered /ping's readiness probe", exc_info=True)
        status = 200 if self.ready else 503
        body = HEALTHY if self.ready else LOADING
        return Response(body, status_code=status, media_type="application/json")

    def _refusal(self, route: str | None) -> Reply | None:
        """While draining, a request that opens a session is refused (held ones are answered)."""
        if self.draining and route is None:
            return error_reply(Draining("this instance is stopping: open the session again"))
        return None

    async def socket(self, websocket: WebSocket) -> None:
        """One session over one WebSocket: each frame answered in order (sockets.py)."""
        await websocket.accept()  # first: SageMaker wants the connection accepted within 250 ms
        with contextlib.suppress(WebSocketDisconnect):  # the session stays for its TTL
            await serve(websocket, SocketSession(self._exchange))

    async def _exchange(self, body: bytes, headers: dict[str, str]) -> AsyncGenerator[Reply, None]:
        """One socket frame's replies from the replica holding its session; a failure to reach
        one is an error reply, as HTTP's would be, and an answer left unread is cancelled."""
        route = route_of(body, headers)
        refusal = self._refusal(route)
        if refusal is not None:
            yield refusal
            return
        self._begin()
        replies = None
        finished = False
        try:
            replies = self.replicas.remote(body, headers, route=route)
            async for reply in replies:
                yield Reply(**reply)
            finished = True
        except Exception as exc:  # the replica died, or none is up: this frame's error
            finished = True
            yield error_reply(as_kit_error(exc))
        finally:
            if not finished and replies is not None:
                replies.cancel()  # the client left: the replica stops this answer
            self._end()

    async def http(self, request: Request) -> Response:
        """Answer one HTTP request: /ping here, the routed paths by a replica (`_exchange`)."""
        path = request.url.path
        if path in ("/ping", "/health"):
            return await self.health()
        if not path.startswith(ROUTED_PREFIXES):
            return not_found(path)
        replies = self._exchange(await request.body(), dict(request.headers))
        first = await replies.__anext__()
        head: dict[str, Any] = {
            "status_code": first.status,
            "headers": first.headers,
            "media_type": first.content_type,
        }
        if first.last is not False:
            async for _ in replies:  # ends at once: lets Ray close the call on the replica
                pass
            return Response(first.body, **head)
        # A relay dropped before it began (a client that left at once) is never iterated: the
        # exchange, already started, is closed when it is collected, and counted out then.
        return StreamingResponse(_rest(first.body, replies), **head)


async def _rest(first: bytes, replies: AsyncIterator[Reply]) -> AsyncIterator[bytes]:
    """Relay a stream: its first chunk, then each chunk the replica yields. A whole reply
    after the first chunk is the exchange's error for a replica lost mid-stream: the response
    is cut (its status is already sent), as a stream the replica could not finish."""
    yield first
    async for reply in replies:
        if reply.last is None:
            raise RuntimeError(f"the replica was lost mid-stream: {reply.body[:200]!r}")
        yield reply.body
