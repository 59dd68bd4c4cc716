"""Sticky routing as SageMaker does it: a new session goes to the least-loaded instance, and
every later request for it to the instance that opened it, until it closes or expires.

An instance that stops answering (scaled in, replaced, lost) is taken out of rotation for a
while, and a session pinned to it is routed to another instance, which resumes it from the
shared session store: what SageMaker is assumed to do with a session whose instance is gone.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

from llava.api.headers import NEW_SESSION
from llava.core.ids import SESSION_ID_MAX_LEN, SESSION_ID_RE
from llava.fronts.local_runtime.errors import Refusal
from llava.fronts.local_runtime.prefix import PrefixIndex

log = logging.getLogger(__name__)

ID_PATTERN = "^[a-zA-Z0-9](-*[a-zA-Z0-9])*$"
ID_OR_NEW_PATTERN = "^(NEW_SESSION)$|^[a-zA-Z0-9](-*[a-zA-Z0-9])*$"

EXPIRES = re.compile(r"Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


class StickyRouter:
    """Pin session ids to instance indexes; pick the least-loaded instance for new sessions."""

    def __init__(self, size: int, name: str, *, enforce_expiry: bool = True) -> None:
        self.size = size
        self.name = name
        self.enforce_expiry = enforce_expiry
        self._routes: dict[str, tuple[int, float | None]] = {}
        self._inflight = [0] * size
        self._down_until = [0.0] * size  # out of rotation until then (it stopped answering)
        self._next = 0
        self._prefixes = PrefixIndex()
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

    def pick(self, exclude: frozenset[int] = frozenset()) -> int:
        """The least-loaded instance in rotation (pinned sessions + requests in flight),
        round-robin on ties; `exclude` those already tried."""
        with self._lock:
            return self._pick_locked(exclude)

    def _pick_locked(self, exclude: frozenset[int]) -> int:
        pinned = [0] * self.size
        for index, _ in self._routes.values():
            pinned[index] += 1
        now = time.monotonic()
        order = [(self._next + k) % self.size for k in range(self.size)]
        order = [i for i in order if i not in exclude] or order
        order = [i for i in order if self._down_until[i] <= now] or order
        best = min(order, key=lambda i: (pinned[i] + self._inflight[i], order.index(i)))
        self._next = (best + 1) % self.size
        return best

    def pick_by_prefix(self, chain: list[bytes], threshold: int) -> int:
        """Prefix-aware routing: where the longest known prefix of `chain` went, unless that
        instance is out of rotation or has `threshold` requests in flight; else the least busy.
        The prefix is then known to go where this request goes (one decision, under the lock)."""
        with self._lock:
            now = time.monotonic()
            usable = [i for i in range(self.size) if self._down_until[i] <= now]
            held = self._prefixes.longest(chain, usable)
            if held is None or self._inflight[held] >= threshold:
                held = self._pick_locked(frozenset() if held is None else frozenset({held}))
            self._prefixes.record(chain, held)
            return held

    def down(self, index: int, for_s: float = 30.0) -> None:
        """Take an instance that stopped answering out of rotation for `for_s` seconds."""
        with self._lock:
            self._down_until[index] = time.monotonic() + for_s
        log.warning("instance %d stopped answering: out of rotation for %.0f s", index, for_s)

    def up(self, index: int) -> None:
        """Put an instance back in rotation (a new one took its place)."""
        with self._lock:
            self._down_until[index] = 0.0

    def move(self, sid: str | None, gone: int, tried: frozenset[int]) -> int:
        """Pick another instance for a request `gone` did not take; a session (`sid`) is
        pinned to it from now on."""
        index = self.pick(tried | {gone})
        if sid is None:
            return index
        with self._lock:
            entry = self._routes.get(sid)
            self._routes[sid] = (index, entry[1] if entry is not None else None)
        log.info("session %s: instance %d is gone; routed to instance %d", sid, gone, index)
        return index

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
