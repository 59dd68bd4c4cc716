"""How an answer is written on the wire: the session API's JSON lines, or another dialect's.

The service decides when to send (a chunk per step, the last one, an error); a `Replies` object
decides what the bytes are. The session API's own shape is here; OpenAI's chat completions are in
`openai_replies.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from llava.api.headers import JSON_CONTENT_TYPE, STREAM_CONTENT_TYPE, stream_line
from llava.core.errors import KitError

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """What to send for one request this step.

    `last` is None for a whole (non-streamed) response, False for a stream chunk with more to
    come, True for a stream's final chunk. Status and headers count only on the first reply.
    """

    body: bytes
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = JSON_CONTENT_TYPE
    last: bool | None = None


def json_reply(obj: Any, headers: dict[str, str] | None = None) -> Reply:
    """Return a whole JSON response (200)."""
    return Reply(json.dumps(obj, ensure_ascii=False).encode(), headers=headers or {})


def error_reply(error: KitError) -> Reply:
    """Render a kit error as a whole JSON response with its status."""
    headers = {}
    retry = getattr(error, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return Reply(json.dumps(error.to_body()).encode(), status=error.status, headers=headers)


def internal_error(exc: BaseException) -> KitError:
    """Log an unexpected exception and return the error the client may see (no traceback)."""
    log.error("internal error: %s", exc, exc_info=exc)
    return KitError("internal error while serving this request; see the worker log")


def as_kit_error(exc: BaseException) -> KitError:
    """Return a kit error as it is; log any other exception and hide it behind a 500."""
    return exc if isinstance(exc, KitError) else internal_error(exc)


class Replies(Protocol):
    """Render one answer: streamed deltas, its end, the whole of it, or an in-stream error."""

    stream_content_type: str

    def chunk(self, delta: str) -> bytes: ...

    def last(self, delta: str, usage: Mapping[str, Any], finish_reason: str | None) -> bytes: ...

    def whole(self, text: str, usage: Mapping[str, Any], finish_reason: str | None) -> bytes: ...

    def error(self, body: Mapping[str, Any]) -> bytes: ...


class KitReplies:
    """The session API's answers: `{"session_id", "text", "usage"}`, or JSON lines when streamed.

    `session_id` is None for a one-shot generate; `sample_reply` adds the AWS sample's
    `response_text`.
    """

    stream_content_type = STREAM_CONTENT_TYPE

    def __init__(self, session_id: str | None, *, sample_reply: bool = False) -> None:
        self.session_id = session_id
        self.sample_reply = sample_reply

    def chunk(self, delta: str) -> bytes:
        return stream_line({"text": delta})

    def last(self, delta: str, usage: Mapping[str, Any], finish_reason: str | None) -> bytes:
        head = stream_line({"text": delta}) if delta else b""
        return head + stream_line({"usage": dict(usage), "finish_reason": finish_reason})

    def whole(self, text: str, usage: Mapping[str, Any], finish_reason: str | None) -> bytes:
        body: dict[str, Any] = {"text": text, "usage": dict(usage)}
        if self.sample_reply:
            body["response_text"] = text
        if self.session_id is not None:
            body = {"session_id": self.session_id, **body}
        return json.dumps(body, ensure_ascii=False).encode()

    def error(self, body: Mapping[str, Any]) -> bytes:
        return stream_line(body)
