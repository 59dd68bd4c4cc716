"""Resume a session this instance does not hold from the shared store, off the step thread.

A request naming a session id this instance never held (its instance was scaled in, replaced or
lost, and the router sent the conversation here), or one it evicted, is not refused: its
snapshot is read from the shared store on a reader thread while the request waits like one
whose image is downloading; then the engine rebuilds the state, the store takes the session
under its own id with the idle time it had left, and the request is admitted as if the session
had always been here. Its answer reports `usage.session_tier: "store"`. A session that was
closed or expired here is not looked up: it ended for its user.

With the store's `verify_turns` (the default), a request that reads or changes a session held
here first asks the store, on a reader thread, whether another instance answered it since
(`SharedStore.check`): if so, this copy is stale; it is dropped and the session resumes from
the store's newer state, so no answer comes from a stale copy. A store that cannot be reached
then costs nothing: the held copy answers (its write is still fenced).

A client whose routing lost the instance can also ask for it: `open_session` with `"resume":
"<id>"` answers like an open, with SageMaker's new-session header, so the router pins the id
to this instance.
"""

from __future__ import annotations

import logging
import math
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
    SessionClosed,
    SessionExpired,
    SessionLost,
    SessionNotFound,
    StoreUnavailable,
)
from llava.server.contract import Engine, StateT, TurnT
from llava.server.draining import session_of
from llava.sessions.fenced import ClosedInStore, NotStored
from llava.sessions.session import CLOSED, EVICTED, EXPIRED, Session
from llava.sessions.shared import SharedStore
from llava.sessions.snapshots import CorruptSnapshot
from llava.sessions.store import SessionStore

log = logging.getLogger(__name__)

RESUMED = "resumed_from_store"  # the session's info flag until its next answer reports it
CHECK_WAIT_S = 2.0  # a turn waits this long at most for its check; then answers unchecked


@dataclass(eq=False)
class Resuming:
    """A request waiting for its session's state to be read from the shared store."""

    sid: str
    data: Future[Any]  # the state's bytes (or, to refuse, the moment it is stored)
    item: Any  # the request as it arrived (admitted again once the session is here)
    explicit: bool = False  # an `open_session` with `resume`: answered like an open
    close: bool = False  # a `close_session`: the stored state is deleted, never restored
    refuse: bool = False  # refused (the instance is stopping) once its latest state is stored
    check: bool = False  # held here: `data` tells whether this copy is still the newest
    deadline: float = math.inf  # (monotonic) a check not done by then is not waited for

    def ready(self) -> bool:
        """Whether the step loop should take it up now: read, or a check past its deadline."""
        return self.data.done() or time.monotonic() > self.deadline


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

    def admit(
        self, request: Any, item: Any, stopping: bool, checked: bool = False
    ) -> Resuming | None:
        """Return the work of a request that must wait on the store, or None.

        A stopping instance refuses a held session's request (its router then sends it to
        another instance, which resumes it from the store) only once that session's latest
        state is stored: else the other instance would resume it a turn behind. A request
        for a held session is first checked against the store (unless `checked` already)."""
        sid = session_of(request)
        if stopping:
            if sid is not None and sid in self.store and self.shared.pending(sid):
                return Resuming(sid, self.shared.settled(sid), item, refuse=True)
            return None
        if sid is not None and not checked and self._verified(request, sid):
            deadline = time.monotonic() + CHECK_WAIT_S
            return Resuming(sid, self.shared.checks.check(sid), item, check=True, deadline=deadline)
        if sid is not None and self.shared.fenced.moved(sid):  # unchecked, known stale
            self._drop(sid)
        if not self.wanted(sid):
            return None
        assert sid is not None
        explicit = isinstance(request, OpenSession)
        return self.begin(sid, item, explicit=explicit, close=isinstance(request, CloseSession))

    def _verified(self, request: Any, sid: str) -> bool:
        """Whether a request must check its held session against the store first: one that
        reads or changes it (not a close, which always wins; not an explicit resume)."""
        if not self.shared.verify_turns or isinstance(request, (CloseSession, OpenSession)):
            return False
        return self.store.peek(sid) is not None

    def arrived(self, work: Resuming, opener: Any) -> Reply | None:
        """Answer a request whose session's state was read, or return None to admit it now
        (its session is here, or, when checked and stale, to resume it from the store)."""
        if work.refuse:
            raise Draining("this instance is shutting down; send the request again")
        if work.check:
            self._drop_if_stale(work)
            return None
        session = self.finish(work)
        if session is None:  # a close: deleted from the store
            return closed_reply(work.sid)
        return opener.opened_reply(session) if work.explicit else None

    def _drop_if_stale(self, work: Resuming) -> None:
        """Drop this instance's copy of a session another instance answered since: the
        request resumes it from the store. A store that cannot be read (or is slow) keeps
        the copy, and turns go unchecked a while."""
        if not work.data.done():
            log.warning("session %s: the shared store is slow to check; answering here", work.sid)
            self.shared.checks.pause()
            return
        try:
            current = work.data.result()
        except Exception as exc:
            log.warning(
                "session %s: cannot check the shared store (%s); answering here", work.sid, exc
            )
            return
        if not current:
            self._drop(work.sid)

    def _drop(self, sid: str) -> None:
        """Drop a stale copy: the store keeps its object, so the request resumes from it."""
        session = self.store.peek(sid)
        if session is None or session.busy:
            return  # gone, or answering (its request gets the usual 409)
        log.info("session %s was answered on another instance since: resuming its newer state", sid)
        self.store.end(session, EVICTED)

    def begin(
        self, sid: str, item: Any, *, explicit: bool = False, close: bool = False
    ) -> Resuming:
        """Start reading `sid`'s state (on a reader thread); refuse at once when this instance
        could not make room for another session (it makes it once the state is read)."""
        if close:  # read to find it exists, never rebuilt
            return Resuming(sid, self.shared.fetch(sid), item, explicit, close)
        self.store.make_room(evict=False)
        return Resuming(sid, self.shared.fetch_then(sid, self.engine.resume), item, explicit)

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
        except ClosedInStore:
            self.store.load_tombstones([work.sid], CLOSED)
            raise SessionClosed(f"session {work.sid} was closed; open a new one") from None
        except CorruptSnapshot as exc:
            if work.close:  # whatever is stored, the user's close wins: its tombstone
                self.shared.remove(work.sid, CLOSED)
                self.store.load_tombstones([work.sid], CLOSED)
                return None
            log.warning("session %s cannot be resumed from the store: %s", work.sid, exc)
            raise SessionLost(
                f"session {work.sid} was lost: its stored state is damaged ({exc}); open a new one"
            ) from None
        except StoreUnavailable:
            raise
        except ValueError as exc:  # the engine's: another model's, or not a snapshot
            log.warning("session %s cannot be resumed from the store: %s", work.sid, exc)
            raise SessionLost(
                f"session {work.sid} was lost: its stored state cannot be used here ({exc}); "
                "open a new one"
            ) from None
        except Exception as exc:  # the store is down, or refuses us: the session may be fine
            log.warning("session %s: the shared store cannot be read: %s", work.sid, exc)
            raise StoreUnavailable(
                f"the session store cannot be read now ({type(exc).__name__}); retry shortly"
            ) from None
        if work.close:  # it exists: delete it, restore nothing
            self.shared.remove(work.sid, CLOSED)
            self.store.load_tombstones([work.sid], CLOSED)
            return None
        state, extra = data  # rebuilt on the reader thread
        self.engine.adopt(state)
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
