"""OpenAI's reply shapes: a whole `chat.completion`, or its server-sent chunks."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

SSE_CONTENT_TYPE = "text/event-stream"


class OpenAIReplies:
    """Render an answer as OpenAI's `chat.completion`, or its server-sent chunks."""

    stream_content_type = SSE_CONTENT_TYPE

    def __init__(self, model: str, include_usage: bool) -> None:
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self._role_sent = False

    def chunk(self, delta: str) -> bytes:
        """Return one content delta as an event (the first one names the role)."""
        content: dict[str, str] = {"content": delta}
        if not self._role_sent:
            content = {"role": "assistant", **content}
            self._role_sent = True
        return self._event([{"index": 0, "delta": content, "finish_reason": None}])

    def last(self, delta: str, usage: Mapping[str, Any], finish_reason: str | None) -> bytes:
        """Return the last delta, the finish reason, the usage if asked for, and [DONE]."""
        out = self.chunk(delta) if delta or not self._role_sent else b""
        out += self._event([{"index": 0, "delta": {}, "finish_reason": finish_reason}])
        if self.include_usage:
            out += self._event([], usage=completion_usage(usage))
        return out + b"data: [DONE]\n\n"

    def whole(self, text: str, usage: Mapping[str, Any], finish_reason: str | None) -> bytes:
        """Return a whole `chat.completion` object."""
        body = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": completion_usage(usage),
        }
        return json.dumps(body, ensure_ascii=False).encode()

    def error(self, body: Mapping[str, Any]) -> bytes:
        """Return an error that arrives after the stream started, then the end of the stream."""
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\ndata: [DONE]\n\n"

    def _event(self, choices: list[Any], **extra: Any) -> bytes:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


def completion_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """Translate the kit's usage into OpenAI's, keeping the kit's figures alongside."""
    prompt = int(usage["cached_tokens"]) + int(usage["prefill_tokens"])
    completion = int(usage["generated_tokens"])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(usage["cached_tokens"])},
        "ttft_ms": usage.get("ttft_ms"),
        "session_tier": usage.get("session_tier"),
        **({"replica": usage["replica"]} if "replica" in usage else {}),
    }
