"""Keep each session's latest finished state: on local disk, and in the shared store if one is set.

The step thread only takes the engine's snapshot producer (references, no copying); the local
snapshot writer and the shared store's writer each run it on their own thread, and `once`
makes the two share one serialisation.
"""

from __future__ import annotations

import logging
from typing import Any

from llava.server.contract import Engine
from llava.sessions.session import Session
from llava.sessions.shared import SharedStore, once
from llava.sessions.snapshots import SnapshotDir
from llava.sessions.store import SessionStore

log = logging.getLogger(__name__)

GENERATION = "generation"  # in a session's info: how many states of it were kept (fencing)


class Keeper:
    """Queue a snapshot of a session at its last finished turn for every place that keeps one."""

    def __init__(
        self,
        engine: Engine[Any, Any],
        store: SessionStore,
        snapshots: SnapshotDir | None = None,
        shared: SharedStore | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.snapshots = snapshots
        self.shared = shared

    @property
    def enabled(self) -> bool:
        return self.snapshots is not None or self.shared is not None

    def keep(self, session: Session) -> None:
        """Queue the session's snapshot (written off this thread); never raises."""
        if not self.enabled or session.closing:
            return
        try:
            generation = int(session.info.get(GENERATION, 0)) + 1
            session.info[GENERATION] = generation  # restored with the state, wherever it is
            extra = {"info": dict(session.info), "expires_at": self.store.expires_at(session)}
            produce = self.engine.snapshot(session.state, extra)
            if produce is None:
                return
            produce = once(produce)
            if self.snapshots is not None:
                self.snapshots.save(session.id, produce)
            if self.shared is not None:
                self.shared.save(session.id, produce, generation)
        except Exception:  # a missing snapshot costs a restart's recovery, never this answer
            log.exception("could not snapshot session %s", session.id)

    def size_of(self, sid: str) -> int:
        """Bytes of the session's snapshot as last written (local, else shared)."""
        if self.snapshots is not None:
            return self.snapshots.size_of(sid)
        return self.shared.size_of(sid) if self.shared is not None else 0
