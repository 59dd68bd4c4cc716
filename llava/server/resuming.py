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

from llava.api.headers import CLOSED_SESSION_HEADER
from llava.api.replies import Reply, json_reply
from llava.api.session_api import CloseSession, OpenSession
from llava.core.errors import (
    Draining,
    SessionExpired,
    SessionLost,
    SessionNotFound,
    StoreUnavailable,
)
from llava.server.contract import Engine, StateT, TurnT
from llava.server.draining import session_of
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
    data: Future[Any]  # the state's bytes (or, to refuse, the moment it is stored)
    item: Any  # the request as it arrived (admitted again once the session is here)
    explicit: bool = False  # an `open_session` with `resume`: answered like an open
    close: bool = False  # a `close_session`: the stored state is deleted, never restored
    refuse: bool = False  # refused (the instance is stopping) once its latest state is stored


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
        """Whether a request for `sid` should wait for the store: not held here (not even
        closing), not ended by its user here."""
        if not sid or sid in self.store:
            return False
        return self.store.ended(sid) not in (CLOSED, EXPIRED)

    def admit(self, request: Any, item: Any, stopping: bool) -> Resuming | None:
        """Return the work of a request that must wait on the store, or None.

        A stopping instance refuses a held session's request (its router then sends it to
        another instance, which resumes it from the store) only once that session's latest
        state is stored: else the other instance would resume it a turn behind."""
        sid = session_of(request)
        if stopping:
            if sid is not None and sid in self.store and self.shared.pending(sid):
                return Resuming(sid, self.shared.settled(sid), item, refuse=True)
            return None
        if not self.wanted(sid):
            return None
        assert sid is not None
        explicit = isinstance(request, OpenSession)
        return self.begin(sid, item, explicit=explicit, close=isinstance(request, CloseSession))

    def arrived(self, work: Resuming, opener: Any) -> Reply | None:
        """Answer a request whose session's state was read, or return None to admit it now
        (its session is here)."""
        if work.refuse:
            raise Draining("this instance is shutting down; send the request again")
        session = self.finish(work)
        if session is None:  # a close: deleted from the store
            return closed_reply(work.sid)
        return opener.opened_reply(session) if work.explicit else None

    def begin(
        self, sid: str, item: Any, *, explicit: bool = False, close: bool = False
    ) -> Resuming:
        """Start reading `sid`'s state (on a reader thread); refuse at once when this instance
        could not make room for another session (it makes it once the state is read)."""
        if not close:
            self.store.make_room(evict=False)
        return Resuming(sid, self.shared.fetch(sid), item, explicit, close)

    def finish(self, work: Resuming) -> Session | None:
        """Restore a session whose state has been read (None for a close: its stored state is
        deleted, not restored); raise the error its request gets."""
        if work.sid in self.store:  # another request for it restored it meanwhile
            return self.store.get(work.sid)
        if self.store.ended(work.sid) in (CLOSED, EXPIRED):  # ended here while being read
            raise self.store.missing(work.sid)
        try:
            data = work.data.result()
        except NotStored:
            raise self._not_stored(work.sid) from None
        except CorruptSnapshot as exc:
            log.warning("session %s cannot be resumed from the store: %s", work.sid, exc)
            raise SessionLost(
                f"session {work.sid} was lost: its stored state is damaged ({exc}); open a new one"
            ) from None
        except StoreUnavailable:
            raise
        except Exception as exc:  # the store is down, or refuses us: the session may be fine
            log.warning("session %s: the shared store cannot be read: %s", work.sid, exc)
            raise StoreUnavailable(
                f"the session store cannot be read now ({type(exc).__name__}); retry shortly"
            ) from None
        if work.close:  # it exists: delete it, restore nothing
            self.shared.remove(work.sid, CLOSED)
            self.store.load_tombstones([work.sid], CLOSED)
            return None
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
        try:
            self.store.make_room()  # others may have opened while it was read
            session = self.store.restore(work.sid, state, state.nbytes, expires_at, info)
        except BaseException:
            self.engine.release(state)
            raise
        log.info("session %s resumed from the shared store", work.sid)
        return session

    def _not_stored(self, sid: str) -> Exception:
        if self.store.ended(sid) is not None:  # lost or evicted here, and not in the store
            return SessionLost(
                f"session {sid} was lost (its state could not be kept); open a new one"
            )
        return SessionNotFound(f'no session {sid}; open one with "open_session"')


def closed_reply(sid: str) -> Reply:
    """The reply to `close_session`: SageMaker's closed-session header unpins the id."""
    body = {"session_id": sid, "closed": True, "success": True}
    return json_reply(body, {CLOSED_SESSION_HEADER: sid})


def resumed_usage(session: Session) -> dict[str, Any]:
    """The usage a session's first answer after a resume reports (once)."""
    return {"session_tier": "store"} if session.info.pop(RESUMED, False) else {}
