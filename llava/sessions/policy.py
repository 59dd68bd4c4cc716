"""Which idle sessions shrink or go when memory is short: the contract, and a plain byte budget."""

from __future__ import annotations

from typing import Protocol

from llava.sessions.session import (
    Session,
)


class MemoryPolicy(Protocol):
    """Fit the sessions into memory by shrinking or choosing idle ones to evict."""

    def rebalance(self, sessions: list[Session], keep: str | None) -> list[Session]:
        """Shrink idle sessions (least recently used first); return those to evict.

        `sessions` are all open sessions, least recently used first; busy or closing ones and
        `keep` (the session just used) must not be touched. Update each `nbytes` you change.
        """
        ...

    def relieve(self, sessions: list[Session]) -> None:
        """Free all the device memory idle sessions hold (the device ran out of it)."""
        ...


class ByteBudget:
    """Evict the least recently used idle sessions while the total exceeds `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes

    def rebalance(self, sessions: list[Session], keep: str | None) -> list[Session]:
        total = sum(s.nbytes for s in sessions)
        victims = []
        for session in idle_sessions(sessions, keep):
            if total <= self.budget_bytes:
                break
            total -= session.nbytes
            victims.append(session)
        return victims

    def relieve(self, sessions: list[Session]) -> None:
        """Nothing to move: this policy only counts bytes."""


def idle_sessions(sessions: list[Session], keep: str | None) -> list[Session]:
    """Return the sessions a memory policy may shrink or evict, in the order given."""
    return [s for s in sessions if not s.busy and not s.closing and s.id != keep]
