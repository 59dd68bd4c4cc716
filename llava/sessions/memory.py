"""The tiered memory policy: device cache -> host cache -> image features only -> evicted.

Applied by the session store to idle sessions, least recently used first, whenever a session is
added or finishes a turn. The device budget holds per card: a session's cache can only leave
the card it is on, so each card's sessions are kept within it on their own. Each step down
frees memory at a price paid only if the session comes back: a copy back to the device, or
recomputing its prefix from the kept image features (the answers stay the same either way).
On vLLM's engine a session holds no device memory of its own: its pictures are on the host,
under the host budget, and past it the least recently used idle sessions are evicted.
"""

from __future__ import annotations

from typing import Any, Protocol

from llava.core.tiers import Tier
from llava.sessions.policy import idle_sessions
from llava.sessions.session import Session


class TierMover(Protocol):
    """What moves a session's state down a tier (the engine); each returns the bytes freed."""

    def offload(self, state: Any) -> int: ...
    def drop_cache(self, state: Any) -> int: ...
    def card(self, state: Any) -> int: ...


class TieredMemory:
    """Keep each card's device bytes and all sessions' host bytes within their budgets (None =
    unbounded)."""

    def __init__(
        self, engine: TierMover, device_budget: int | None, host_budget: int | None
    ) -> None:
        self.engine = engine
        self.device_budget = device_budget
        self.host_budget = host_budget

    def rebalance(self, sessions: list[Session], keep: str | None) -> list[Session]:
        """Move idle sessions down the tiers until both budgets hold; return those to evict."""
        states = [s.state for s in sessions if s.state is not None]
        idle = [s for s in idle_sessions(sessions, keep) if s.state is not None]
        victims: list[Session] = []
        if self.device_budget is not None:
            on_card: dict[int, int] = {}
            for state in states:
                card = self.engine.card(state)
                on_card[card] = on_card.get(card, 0) + state.device_bytes
            for session in idle:
                card = self.engine.card(session.state)
                if on_card[card] > self.device_budget:
                    on_card[card] -= self.engine.offload(session.state)
        if self.host_budget is not None:
            used = sum(state.host_bytes for state in states)
            for session in idle:
                if used <= self.host_budget:
                    break
                if session.state.tier is Tier.HOST:
                    used -= self.engine.drop_cache(session.state)
            for session in idle:
                if used <= self.host_budget:
                    break
                if session.state.tier is Tier.FEATURES:
                    used -= session.state.host_bytes
                    victims.append(session)
        for session in sessions:
            if session.state is not None:
                session.nbytes = session.state.nbytes
        return victims

    def relieve(self, sessions: list[Session]) -> None:
        """Move every idle session's cache to host memory (the device ran out of memory)."""
        for session in idle_sessions(sessions, None):
            if session.state is None:
                continue
            self.engine.offload(session.state)
            session.nbytes = session.state.nbytes

    def tiers(self, sessions: list[Session]) -> dict[str, dict[str, int]]:
        """Count sessions and bytes per tier (for metrics)."""
        out = {tier.value: {"sessions": 0, "device_bytes": 0, "host_bytes": 0} for tier in Tier}
        for session in sessions:
            state = session.state
            if state is None:
                continue
            entry = out[state.tier.value]
            entry["sessions"] += 1
            entry["device_bytes"] += state.device_bytes
            entry["host_bytes"] += state.host_bytes
        return out
