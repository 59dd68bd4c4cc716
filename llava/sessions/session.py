"""One session as the store keeps it, why it ends, and who hears of ids opening and ending."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from llava.core.errors import (
    SessionClosed,
    SessionExpired,
    SessionLost,
)

# Reasons a session ended, and the error a later request for it gets.
CLOSED = "closed"
EXPIRED = "expired"
EVICTED = "evicted"
LOST = "lost"

ENDED_ERRORS = {
    CLOSED: (SessionClosed, "session {} was closed; open a new one"),
    EXPIRED: (SessionExpired, "session {} expired after {} s idle; open a new one"),
    EVICTED: (SessionExpired, "session {} was evicted to make room for others; open a new one"),
    LOST: (SessionLost, "session {} was lost (its state could not be kept); open a new one"),
}


@dataclass(eq=False)
class Session:
    """One open session: the engine's state plus the store's bookkeeping."""

    id: str
    state: Any
    nbytes: int
    last_used: float
    busy: bool = False
    closing: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class SessionJournal(Protocol):
    """Hears of session ids as they open, are used (new expiry) and end; must not raise."""

    def opened(self, sid: str, expires_at: float) -> None: ...
    def ended(self, sid: str) -> None: ...


@dataclass(frozen=True)
class Slot:
    """A reserved place for a session being opened (its image may still be loading)."""

    id: str
