"""Header names, content types and the session id a request names; the line format of streams."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from llava.core.errors import InvalidRequest
from llava.core.ids import is_valid_session_id

# SageMaker's session headers (botocore's sagemaker-runtime model).
SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"

NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"

CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"

NEW_SESSION = "NEW_SESSION"

STREAM_CONTENT_TYPE = "application/x-ndjson"

JSON_CONTENT_TYPE = "application/json"

# SageMaker's bidirectional streaming (InvokeEndpointWithBidirectionalStream): the WebSocket a
# container serves on its port 8080, one session per connection (llava.fronts.sockets).
SOCKET_PATH = "/invocations-bidirectional-stream"


def header(headers: Mapping[str, Any], name: str) -> str | None:
    """Look a header up case-insensitively (HTTP names are not case-sensitive)."""
    wanted = name.lower()
    for key, value in headers.items():
        if str(key).lower() == wanted:
            return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
    return None


def session_id_from(obj: Mapping[str, Any], headers: Mapping[str, Any]) -> str | None:
    """Return the session id the request names, or None for a new session."""
    from_header = header(headers, SESSION_HEADER)
    from_header = from_header.strip() if from_header is not None else None
    if from_header in ("", NEW_SESSION):
        from_header = None
    from_body = obj.get("session_id")
    if from_body is not None and not isinstance(from_body, str):
        raise InvalidRequest('"session_id" must be a string', field="session_id")
    if from_header is not None and from_body is not None and from_header != from_body:
        raise InvalidRequest(
            f'body "session_id" does not match the {SESSION_HEADER} header', field="session_id"
        )
    sid = from_header if from_header is not None else from_body
    if sid is not None and not is_valid_session_id(sid):
        raise InvalidRequest(
            "malformed session id: letters, digits and hyphens (not first or last), at most 256 "
            "characters",
            field="session_id",
        )
    return sid


def expires_header(session_id: str, expires_at: float) -> str:
    """Format the `<id>; Expires=<UTC ISO-8601 Z>` value of the new-session header."""
    return f"{session_id}; Expires={iso_utc(expires_at)}"


def iso_utc(ts: float) -> str:
    """Format a POSIX time as `YYYY-MM-DDTHH:MM:SSZ`."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def stream_line(obj: Mapping[str, Any]) -> bytes:
    """Encode one newline-delimited JSON line of a streamed answer."""
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
