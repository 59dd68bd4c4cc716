"""The session store: ids, idle TTL, a session cap, and a memory policy over idle sessions.

The store knows nothing about tensors: each session carries an opaque engine `state` and the
byte count the engine reports for it; `release(session, reason)` is the engine's hook to free
that state, and a `MemoryPolicy` decides, least recently used first, which idle sessions shrink
or go when memory is short (`ByteBudget` simply evicts; the engine's tiered policy first moves
caches to host memory). A background reaper frees idle sessions on time, without waiting for
traffic.

    store = SessionStore(ttl_s=1200, max_sessions=64, memory=ByteBudget(8 << 30),
                         release=engine.release)
    slot = store.reserve()                  # 429 when full, before any work is done
    session = store.add(slot, state, nbytes)
    with store.turn(session.id) as s: ...   # marks it busy; a busy session is never evicted
    store.close(session.id)

An optional `journal` (`llava.sessions.registry.SessionRegistry`) hears of every opened, used
and ended id, so that a worker started after this one died can `load_tombstones` for the ids
it lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from llava.core.errors import (
    CapacityExceeded,
    SessionBusy,
    SessionNotFound,
)
from llava.core.ids import new_session_id
from llava.sessions.policy import ByteBudget, MemoryPolicy, idle_sessions
from llava.sessions.session import (
    CLOSED,
    ENDED_ERRORS,
    EVICTED,
    EXPIRED,
    LOST,
    Session,
    SessionJournal,
    Slot,
)

log = logging.getLogger(__name__)

_TOMBSTONES = 65_536  # remembered ended ids, so a late request gets a precise error


class SessionStore:
    """Hold sessions by id with an idle TTL, a count cap and a byte budget (LRU eviction)."""

    def __init__(
        self,
        *,
        ttl_s: float = 1200.0,
        max_sessions: int = 64,
        max_opening: int = 0,
        memory: MemoryPolicy | None = None,
        budget_bytes: int | None = None,
        release: Callable[[Session, str], None] = lambda session, reason: None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        journal: SessionJournal | None = None,
        id_prefix: str = "",
    ) -> None:
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError("ttl_s and max_sessions must be positive")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_opening = max_opening  # sessions opening at once (0 = no limit)
        if memory is None and budget_bytes is not None:
            memory = ByteBudget(budget_bytes)
        self.memory = memory
        self._release = release
        self._clock = clock
        self._wall_clock = wall_clock
        self._journal = journal
        self._id_prefix = id_prefix  # where this store's instance is, for a router to read
        self._lock = threading.RLock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._slots: set[str] = set()
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        self._version = 0  # bumped whenever a session is added, used, shrunk or ended

    # -- opening ---------------------------------------------------------------------------
    def reserve(self) -> Slot:
        """Reserve room for a new session or raise `CapacityExceeded` (429).

        Sessions kept for chats sent without a session header (`implicit`) are never pinned:
        when every slot is taken, the least recently used idle one makes room. While
        `max_opening` sessions are opening, a new one is refused: the server is past what it
        can open without the conversations it holds waiting behind the queue."""
        with self._lock:
            if self.max_opening and len(self._slots) >= self.max_opening:
                raise CapacityExceeded(
                    f"{len(self._slots)} sessions are opening already (max_opening); the server "
                    "is at capacity: retry after the Retry-After seconds",
                    retry_after_s=1,
                )
            self.make_room()
            slot = Slot(new_session_id(self._id_prefix))
            self._slots.add(slot.id)
            return slot

    def make_room(self, evict: bool = True) -> None:
        """Make room for one more session (reaping, then evicting the least recently used idle
        header-less chat) or raise `CapacityExceeded` (429); `evict` False: only check it could
        (a resume not yet read: an id the store may not know must not cost a chat its cache)."""
        with self._lock:
            self.reap()
            if len(self._sessions) + len(self._slots) >= self.max_sessions:
                idle = idle_sessions(list(self._sessions.values()), None)
                implicit = [s for s in idle if s.info.get("implicit")]
                if implicit and not evict:
                    return
                if implicit:
                    self._end(implicit[0], EVICTED)
            if len(self._sessions) + len(self._slots) >= self.max_sessions:
                raise CapacityExceeded(
                    f"all {self.max_sessions} session slots are in use; retry later or close "
                    "sessions you no longer need",
                    retry_after_s=max(1, int(min(self.ttl_s, 30))),
                )

    def cancel(self, slot: Slot) -> None:
        """Give a reserved slot back (the open failed)."""
        with self._lock:
            self._slots.discard(slot.id)

    def add(self, slot: Slot, state: Any, nbytes: int, **info: Any) -> Session:
        """Turn a reserved slot into an open session."""
        with self._lock:
            if slot.id not in self._slots:
                raise SessionNotFound(f"slot {slot.id} was not reserved")
            self._slots.discard(slot.id)
            session = Session(slot.id, state, nbytes, self._clock(), info=dict(info))
            self._sessions[slot.id] = session
            self._version += 1
            self._note("opened", session.id, self.expires_at(session))
            self._enforce_budget(keep=session.id)
            return session

    def restore(
        self, sid: str, state: Any, nbytes: int, expires_at: float, info: dict[str, Any]
    ) -> Session:
        """Bring back a session an earlier worker left open, under its id and with the idle
        time it had left (a restarted worker, from its snapshot)."""
        with self._lock:
            if sid in self._sessions or sid in self._slots:
                raise ValueError(f"session {sid} is already open")
            remaining = min(self.ttl_s, max(0.0, expires_at - self._wall_clock()))
            last_used = self._clock() - (self.ttl_s - remaining)
            session = Session(sid, state, nbytes, last_used, info=dict(info))
            self._sessions[sid] = session
            self._sessions = OrderedDict(
                sorted(self._sessions.items(), key=lambda item: item[1].last_used)
            )
            self._ended.pop(sid, None)
            self._version += 1
            self._note("opened", sid, self.expires_at(session))
            self._enforce_budget(keep=sid)
            return session

    # -- using -----------------------------------------------------------------------------
    def get(self, sid: str) -> Session:
        """Return the open session `sid` (refreshing its TTL) or raise the precise error."""
        with self._lock:
            session = self._sessions.get(sid)
            if session is None or session.closing:
                raise self.missing(sid)
            if self._idle_for(session) > self.ttl_s and not session.busy:
                self._end(session, EXPIRED)
                raise self.missing(sid)
            session.last_used = self._clock()
            self._sessions.move_to_end(sid)
            return session

    def peek(self, sid: str) -> Session | None:
        """Return the open session `sid`, or None, without using it (its TTL runs on)."""
        with self._lock:
            session = self._sessions.get(sid)
            return None if session is None or session.closing else session

    def ended(self, sid: str) -> str | None:
        """Return why `sid` ended here (closed, expired, evicted, lost), or None."""
        with self._lock:
            return None if sid in self._sessions else self._ended.get(sid)

    def begin_turn(self, sid: str) -> Session:
        """Mark a session busy for one answer; a second concurrent answer gets 409."""
        with self._lock:
            session = self.get(sid)
            if session.busy:
                raise SessionBusy(
                    f"session {sid} is already answering a question; wait for that answer"
                )
            session.busy = True
            self._version += 1
            return session

    def end_turn(self, session: Session, nbytes: int | None = None) -> None:
        """Mark the answer finished, update the session's bytes and enforce the budget."""
        with self._lock:
            session.busy = False
            session.last_used = self._clock()
            self._version += 1
            if nbytes is not None:
                session.nbytes = nbytes
            if session.closing:
                self._free(session, CLOSED)
            else:
                if session.id in self._sessions:
                    self._note("opened", session.id, self.expires_at(session))
                self._enforce_budget(keep=session.id)

    @contextmanager
    def turn(self, sid: str) -> Iterator[Session]:
        """Hold a session busy for the duration of a `with` block."""
        session = self.begin_turn(sid)
        try:
            yield session
        finally:
            self.end_turn(session)

    def close(self, sid: str) -> Session:
        """Close a session; a busy one is freed as soon as its answer ends."""
        with self._lock:
            session = self.get(sid)
            self._end(session, CLOSED)
            return session

    def end(self, session: Session, reason: str) -> None:
        """End a session for `reason` (one of CLOSED, EXPIRED, EVICTED, LOST)."""
        with self._lock:
            if session.id in self._sessions and not session.closing:
                self._end(session, reason)

    def load_tombstones(self, ids: Iterable[str], reason: str = LOST) -> int:
        """Remember ids that ended elsewhere (e.g. in a dead worker): they get `reason`'s error.

        Open sessions are left alone; returns how many tombstones were added.
        """
        if reason not in ENDED_ERRORS:
            raise ValueError(f"unknown reason {reason!r}; use one of {', '.join(ENDED_ERRORS)}")
        added = 0
        with self._lock:
            for sid in ids:
                if sid not in self._sessions and sid not in self._slots:
                    self._remember(sid, reason)
                    added += 1
        return added

    def expires_at(self, session: Session) -> float:
        """Return the wall-clock time at which the session expires if left idle."""
        remaining = self.ttl_s - self._idle_for(session)
        return self._wall_clock() + max(0.0, remaining)

    # -- housekeeping ----------------------------------------------------------------------
    def reap(self) -> list[str]:
        """Free every idle session past its TTL; return their ids."""
        with self._lock:
            expired = [
                s for s in self._sessions.values() if not s.busy and self._idle_for(s) > self.ttl_s
            ]
            for session in expired:
                log.info("session %s expired after %.0f s idle", session.id, self.ttl_s)
                self._end(session, EXPIRED)
            return [s.id for s in expired]

    def start_reaper(self, interval_s: float = 5.0) -> None:
        """Reap expired sessions every `interval_s` seconds in a daemon thread."""
        if self._reaper is not None:
            return
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.reap()
                except Exception:  # keep reaping: one failed release must not stop the thread
                    log.exception("session reaper failed")

        self._reaper = threading.Thread(target=run, name="llava-session-reaper", daemon=True)
        self._reaper.start()

    def stop_reaper(self) -> None:
        """Stop the reaper thread."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
            self._reaper = None

    def stats(self) -> dict[str, int]:
        """Count open sessions, reserved slots and held bytes."""
        with self._lock:
            return {
                "sessions": len(self._sessions),
                "opening": len(self._slots),
                "bytes": sum(s.nbytes for s in self._sessions.values()),
            }

    @property
    def version(self) -> int:
        """A number that changes whenever the sessions or their memory may have changed."""
        return self._version

    def snapshot(self) -> list[Session]:
        """Return the open sessions, least recently used first."""
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, sid: object) -> bool:
        with self._lock:
            return sid in self._sessions

    # -- internals -------------------------------------------------------------------------
    def _idle_for(self, session: Session) -> float:
        return self._clock() - session.last_used

    def missing(self, sid: str) -> Exception:
        """Return the precise error for a session this store does not hold."""
        reason = self._ended.get(sid)
        if reason is None:
            return SessionNotFound(f'no session {sid}; open one with "open_session"')
        cls, template = ENDED_ERRORS[reason]
        return cls(template.format(sid, int(self.ttl_s)))

    def _end(self, session: Session, reason: str) -> None:
        """Remove a session from use; free it now, or when its running answer ends."""
        self._remember(session.id, reason)
        self._note("ended", session.id)
        self._version += 1
        if session.busy:
            session.closing = True
        else:
            self._free(session, reason)

    def _free(self, session: Session, reason: str) -> None:
        self._sessions.pop(session.id, None)
        try:
            self._release(session, reason)
        except Exception:  # the session is gone either way; never leak the slot
            log.exception("releasing session %s failed", session.id)
        session.state, session.nbytes = None, 0

    def _remember(self, sid: str, reason: str) -> None:
        self._ended[sid] = reason
        self._ended.move_to_end(sid)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    def _note(self, event: str, *args: Any) -> None:
        """Tell the journal; its failure must never cost a request its answer."""
        if self._journal is None:
            return
        try:
            getattr(self._journal, event)(*args)
        except Exception:
            log.warning("session journal failed on %s", event, exc_info=True)

    def relieve(self) -> None:
        """Ask the memory policy to free the device memory of every idle session."""
        if self.memory is None:
            return
        with self._lock:
            sessions = list(self._sessions.values())
            try:
                self.memory.relieve(sessions)
            except Exception:
                log.exception("memory policy failed to free device memory")

    def _enforce_budget(self, keep: str) -> None:
        if self.memory is None:
            return
        try:
            victims = self.memory.rebalance(list(self._sessions.values()), keep)
        except Exception:  # a broken policy must not fail the open or answer that called it
            log.exception("memory policy failed; sessions stay as they are")
            return
        for session in victims:
            if session.busy or session.id == keep or session.closing:
                continue  # a policy must not take these; refuse quietly rather than break them
            log.info(
                "evicting session %s (%d bytes) to stay within the memory budget",
                session.id,
                session.nbytes,
            )
            self._end(session, EVICTED)
