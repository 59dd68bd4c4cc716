"""Resume a session this instance does not hold from the shared store, off the step thread.

A request naming a session id this instance never held (its instance was scaled in, replaced or
lost, and the router sent the conversation here), or one it evicted, is not refused: its
snapshot is read from the shared store on a reader thread while the request waits like one
whose image is downloading; then the engine rebuilds the state, the store takes the session
under its own id with the idle time it had left, and the request is admitted as if the session
had always been here. Its answer reports `usage.session_tier: "store"`. A session that was
closed or expired here is not looked up: it ended for its user.

A client whose routing lost the instance can also ask for it: `open_session` with `"resume":
"<id>"` answers like an open, with SageMaker's new-session header, so the router pins the id
to this instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic

from llava.core.errors import SessionExpired, SessionLost, SessionNotFound
from llava.server.contract import Engine, StateT, TurnT
from llava.sessions.session import CLOSED, EXPIRED, Session
from llava.sessions.shared import NotStored, SharedStore
from llava.sessions.snapshots import CorruptSnapshot
from llava.sessions.store import SessionStore

log = logging.getLogger(__name__)

RESUMED = "resumed_from_store"  # the session's info flag until its next answer reports it


@dataclass(eq=False)
class Resuming:
    """A request waiting for its session's state to be read from the shared store."""

    sid: str
    data: Future[bytes]
    item: Any  # the request as it arrived (admitted again once the session is here)
    explicit: bool = False  # an `open_session` with `resume`: answered like an open


class SessionResumer(Generic[StateT, TurnT]):
    """Look sessions up in the shared store and restore them into this instance's store."""

    def __init__(
        self,
        engine: Engine[StateT, TurnT],
        store: SessionStore,
        shared: SharedStore,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.store = store
        self.shared = shared
        self._wall_clock = wall_clock

    def wanted(self, sid: str | None) -> bool:
        """Whether a request for `sid` should wait for the store: not held, not ended by its
        user here."""
        if not sid or self.store.peek(sid) is not None:
            return False
        return self.store.ended(sid) not in (CLOSED, EXPIRED)

    def begin(self, sid: str, item: Any, *, explicit: bool = False) -> Resuming:
        """Start reading `sid`'s state (on a reader thread)."""
        return Resuming(sid, self.shared.fetch(sid), item, explicit)

    def finish(self, work: Resuming) -> Session:
        """Restore a session whose state has been read; raise the error its request gets."""
        held = self.store.peek(work.sid)
        if held is not None:  # another request for it restored it meanwhile
            return held
        try:
            data = work.data.result()
        except NotStored:
            raise self._not_stored(work.sid) from None
        except CorruptSnapshot as exc:
            log.warning("session %s cannot be resumed from the store: %s", work.sid, exc)
            raise SessionLost(
                f"session {work.sid} was lost: its stored state is damaged ({exc}); open a new one"
            ) from None
        try:
            state, extra = self.engine.resume(data)
        except ValueError as exc:  # another model's, or not a snapshot: this session only
            log.warning("session %s cannot be resumed from the store: %s", work.sid, exc)
            raise SessionLost(
                f"session {work.sid} was lost: its stored state cannot be used here ({exc}); "
                "open a new one"
            ) from None
        expires_at = float(extra.get("expires_at", 0))
        if expires_at <= self._wall_clock():
            self.engine.release(state)
            self.shared.forget(work.sid)
            self.store.load_tombstones([work.sid], EXPIRED)
            raise SessionExpired(
                f"session {work.sid} expired after {int(self.store.ttl_s)} s idle; open a new one"
            )
        info = dict(extra.get("info") or {})
        info[RESUMED] = True
        session = self.store.restore(work.sid, state, state.nbytes, expires_at, info)
        log.info("session %s resumed from the shared store", work.sid)
        return session

    def _not_stored(self, sid: str) -> Exception:
        if self.store.ended(sid) is not None:  # lost or evicted here, and not in the store
            return SessionLost(
                f"session {sid} was lost (its state could not be kept); open a new one"
            )
        return SessionNotFound(f'no session {sid}; open one with "open_session"')


def resumed_usage(session: Session) -> dict[str, Any]:
    """The usage a session's first answer after a resume reports (once)."""
    return {"session_tier": "store"} if session.info.pop(RESUMED, False) else {}
