"""Sticky routing as SageMaker does it: a new session goes to the least-loaded instance, and
every later request for it to the instance that opened it, until it closes or expires."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from llava.api.headers import NEW_SESSION
from llava.core.ids import SESSION_ID_MAX_LEN, SESSION_ID_RE

log = logging.getLogger(__name__)

ID_PATTERN = "^[a-zA-Z0-9](-*[a-zA-Z0-9])*$"
ID_OR_NEW_PATTERN = "^(NEW_SESSION)$|^[a-zA-Z0-9](-*[a-zA-Z0-9])*$"

EXPIRES = re.compile(r"Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


class Refusal(Exception):
    """An error the runtime itself answers with (the router's, not the container's)."""

    def __init__(self, status: int, error_type: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message, self.fields = (
            status,
            error_type,
            message,
            fields,
        )


class StickyRouter:
    """Pin session ids to instance indexes; pick the least-loaded instance for new sessions."""

    def __init__(self, size: int, name: str, *, enforce_expiry: bool = True) -> None:
        self.size = size
        self.name = name
        self.enforce_expiry = enforce_expiry
        self._routes: dict[str, tuple[int, float | None]] = {}
        self._inflight = [0] * size
        self._next = 0
        self._lock = threading.Lock()

    @contextmanager
    def in_flight(self, index: int) -> Iterator[None]:
        """Count a request in flight on `index` while the block runs (it weighs on `pick`)."""
        with self._lock:
            self._inflight[index] += 1
        try:
            yield
        finally:
            with self._lock:
                self._inflight[index] -= 1

    @property
    def routes(self) -> dict[str, int]:
        """A copy of the sticky routing table: session id -> instance index."""
        with self._lock:
            return {sid: index for sid, (index, _) in self._routes.items()}

    def pick(self) -> int:
        """The least-loaded instance (pinned sessions + requests in flight), round-robin on ties."""
        with self._lock:
            pinned = [0] * self.size
            for index, _ in self._routes.values():
                pinned[index] += 1
            order = [(self._next + k) % self.size for k in range(self.size)]
            best = min(order, key=lambda i: (pinned[i] + self._inflight[i], order.index(i)))
            self._next = (best + 1) % self.size
            return best

    def lookup(self, sid: str) -> int:
        with self._lock:
            entry = self._routes.get(sid)
            expires = entry[1] if entry is not None and self.enforce_expiry else None
            if expires is not None and time.time() >= expires:
                del self._routes[sid]
                entry = None
        if entry is None:
            raise Refusal(
                400,
                "ValidationError",
                f"Session id {sid} of endpoint {self.name} is not found, closed or expired.",
            )
        return entry[0]

    def pin(self, value: str, index: int) -> str:
        sid = value.split(";", 1)[0].strip()
        match = EXPIRES.search(value)
        expires = None
        if match:
            expires = (
                datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%SZ")
                .replace(tzinfo=timezone.utc)
                .timestamp()
            )
        with self._lock:
            old = self._routes.get(sid)
            if old is not None and old[0] != index:
                log.warning("session id %s reused by instance %d (was %d)", sid, index, old[0])
            self._routes[sid] = (index, expires)
        return sid

    def unpin(self, sid: str, index: int) -> None:
        with self._lock:
            entry = self._routes.get(sid)
            if entry is not None and entry[0] == index:
                del self._routes[sid]


def check_session_id(sid: str | None, streaming: bool) -> None:
    """Refuse a session id outside SageMaker's pattern (streaming calls cannot open sessions)."""
    if sid is None:
        return
    ok = len(sid) <= SESSION_ID_MAX_LEN and (
        SESSION_ID_RE.fullmatch(sid) is not None or (sid == NEW_SESSION and not streaming)
    )
    if not ok:
        pattern = ID_PATTERN if streaming else ID_OR_NEW_PATTERN
        raise Refusal(
            400,
            "ValidationError",
            f"1 validation error detected: Value '{sid[:300]}' at 'sessionId' failed to "
            f"satisfy constraint: Member must satisfy regular expression pattern: {pattern}",
        )
