"""The HTTP routes of the Ray Serve front, answered exactly as the TorchServe front answers them.

`/ping` answers health; `/invocations` (SageMaker's path), `/predictions/<model>[/...]` (the
TorchServe paths clients already use) and `/v1/chat/completions`, `/v1/models` (OpenAI's) go to
a replica, chosen by the session affinity router from the request's session id. Bodies and
headers pass through untouched: the replica's service parses them as the TorchServe worker does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llava.api.body import decode_body
from llava.api.headers import NEW_SESSION, SESSION_HEADER, header, session_id_from
from llava.core.errors import KitError
from llava.core.params import Limits

ROUTED_PREFIXES = ("/invocations", "/predictions/", "/v1/")


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


class Ingress:
    """Forward each request to the replica holding its session and relay its replies."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path in ("/ping", "/health"):
            return Response(b'{"status": "Healthy"}', media_type="application/json")
        if not path.startswith(ROUTED_PREFIXES):
            return not_found(path)
        body = await request.body()
        headers = dict(request.headers)
        replies = self.replicas.remote(body, headers, route=route_of(body, headers))
        first = await replies.__anext__()
        head: dict[str, Any] = {
            "status_code": first["status"],
            "headers": first["headers"],
            "media_type": first["content_type"],
        }
        if first["last"] is not False:
            async for _ in replies:  # ends at once: lets Ray close the call on the replica
                pass
            return Response(first["body"], **head)
        return StreamingResponse(_rest(first["body"], replies), **head)


async def _rest(first: bytes, replies: Any) -> AsyncIterator[bytes]:
    """Relay a stream: its first chunk, then each chunk the replica yields."""
    yield first
    async for reply in replies:
        yield reply["body"]
