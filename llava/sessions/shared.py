"""A shared session store: every session's latest snapshot in S3, so any instance can resume it.

Local snapshots survive a worker restart; these survive the instance: scale-in, a deployment
that replaces every instance, a lost host. After an open and after each finished turn the
service hands `save` the engine's snapshot producer (references taken on the step thread); one
writer thread serialises, seals (`sealed.py`) and uploads it. The queue holds at most one
pending write per session (a newer snapshot replaces the one not yet written: only the latest
matters) and at most `max_pending` sessions holding `max_pending_bytes` of state (a pending
write keeps its session's state alive, even once closed); past either the oldest pending write
is dropped and
counted. Nothing here ever blocks the step thread, and a store that fails (an outage, missing
permissions) costs only the writes, retried a few times and counted, never an answer: local
snapshots still cover a restart.

Each snapshot's large arrays (pictures, or their features) are written once, as objects named
by their content (`parts.py`, `stored_parts.py`); each turn writes the rest, a few KB.

Reading happens on reader threads (`fetch` returns a future): a request for a session this
instance does not hold waits for it like an image, never stalling other streams.

Every write is fenced (`fenced.py`): conditional on the object this instance wrote or read
last, so a stale holder never overwrites a newer copy; it learns its copy moved and drops it.
Deletion follows the session's end: a close leaves a sealed tombstone that no stale write can
undo; an expiry or a loss deletes the object only if it is still the one this instance wrote or
resumed from; an eviction keeps it, so the session resumes from the store on its next request
instead of being lost. With `verify_turns`, each turn of a held session first checks (one HEAD,
on a thread of its own) that no other instance answered it since (`checks`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from llava.core.errors import StoreUnavailable
from llava.sessions import parts
from llava.sessions.fenced import FencedObjects, TurnChecks
from llava.sessions.objects import ObjectStore, StoreLocation
from llava.sessions.sealed import Sealed, store_key
from llava.sessions.session import CLOSED, EVICTED
from llava.sessions.stored_parts import StoredParts

log = logging.getLogger(__name__)
T = TypeVar("T")

ATTEMPTS = 4  # tries of one write before it is given up (counted as a failure)
MAX_READS = 64  # reads waiting or running at once; past it a resume is refused (503)
SETTLE_S = 30.0  # how long a read waits for this instance's own pending write of the session


@dataclass
class _Write:
    """One pending operation on a session's object: a put (with its producer), a close
    (a tombstone) or a delete."""

    produce: Callable[[], bytes] | None  # None: a close, or a delete
    queued_at: float
    generation: int = 0  # the state's (its session's count of kept states)
    nbytes: int = 0  # what it keeps alive until written: the session's last snapshot's size
    closed: bool = False  # a tombstone
    attempts: int = 0


def once(produce: Callable[[], bytes]) -> Callable[[], bytes]:
    """Wrap a snapshot producer so the local and shared writers serialise it only once."""
    lock = threading.Lock()
    done: list[bytes] = []

    def call() -> bytes:
        with lock:
            if not done:
                done.append(produce())
            return done[0]

    return call


class SharedStore:
    """Write sessions' snapshots to an object store off the step thread; read them back.

    store = SharedStore(S3Objects.connect("bucket"), StoreLocation.parse("s3://bucket/p"))
    store.save(sid, producer, 7)     # queued; the writer uploads the latest one (generation 7)
    data = store.fetch(sid).result() # on a reader thread; NotStored / ClosedInStore / Corrupt...
    store.checks.check(sid).result() # False: another instance answered it since
    store.remove(sid, "closed")
    store.flush(30)                  # before the instance goes away
    """

    def __init__(
        self,
        objects: ObjectStore,
        location: StoreLocation,
        *,
        secret: str = "",
        verify_turns: bool = True,
        max_pending: int = 256,
        max_pending_bytes: int = 1 << 30,
        readers: int = 4,
        retry_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.location = location
        self.verify_turns = verify_turns
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.retry_s = retry_s
        self.part_min_bytes = parts.PART_MIN_BYTES
        self.fenced = FencedObjects(objects, location, store_key(location.uri, secret))
        self.parts = StoredParts(self.fenced)
        self._clock = clock
        self._pending: OrderedDict[str, _Write] = OrderedDict()  # oldest first
        self._busy: tuple[str, _Write] | None = None  # the write in progress
        self._dirty: set[str] = set()  # sessions whose latest state was never stored (gave up)
        self._reads = 0
        self._counts = {
            "writes": 0,
            "bytes_written": 0,  # snapshots' skeletons and parts, tombstones
            "closes": 0,
            "deletes": 0,
            "failures": 0,
            "dropped": 0,
            "resumes": 0,
        }
        self._bytes: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._unreachable = False  # a start-up look-up failed (holds)
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="llava-store-read")
        self.checks = TurnChecks(self.fenced, readers)
        self._writer = threading.Thread(target=self._run, name="llava-store-write", daemon=True)
        self._writer.start()
        log.info("sessions are kept in the shared store %s", location.uri)

    def object_key(self, sid: str) -> str:
        """The key of `sid`'s object (named by `sealed.object_name`)."""
        return self.fenced.object_key(sid)

    # -- the step thread's side: never blocks on the network -------------------------------
    def save(self, sid: str, produce: Callable[[], bytes], generation: int) -> None:
        """Queue the latest snapshot of `sid`, its `generation`-th kept state (replacing one
        not yet written)."""
        with self._cond:
            nbytes = self._bytes.get(sid, 0)  # a turn's snapshot weighs about its last one's
        self._queue(sid, _Write(produce, self._clock(), generation, nbytes))

    def remove(self, sid: str, reason: str) -> None:
        """Queue the deletion of `sid`'s object for a session that ended for `reason`."""
        if reason == EVICTED:  # not ended for the user: it resumes from the store next time
            with self._cond:
                self._bytes.pop(sid, None)  # no longer held here
            return
        self._queue(sid, _Write(None, self._clock(), closed=reason == CLOSED))

    def pending(self, sid: str) -> bool:
        """Tell whether a write or deletion of `sid` is queued or in progress."""
        with self._cond:
            return sid in self._pending or (self._busy is not None and self._busy[0] == sid)

    def settled(self, sid: str) -> Future[None]:
        """Return a future done once no write of `sid` is pending (on a reader thread)."""
        return self._readers.submit(self._settle, sid)

    def dirty(self) -> set[str]:
        """Return the sessions whose latest state is not in the store (its write was given up
        or dropped): a drain saves them again."""
        with self._cond:
            return set(self._dirty)

    def size_of(self, sid: str) -> int:
        """Bytes of `sid`'s object as this instance last wrote it (0 when none)."""
        with self._cond:
            return self._bytes.get(sid, 0)

    def stats(self) -> dict[str, float]:
        """Count writes, failures and drops; pending writes and the oldest one's age (lag)."""
        with self._cond:
            oldest = [w.queued_at for w in self._pending.values()]
            if self._busy is not None:
                oldest.append(self._busy[1].queued_at)
            lag = self._clock() - min(oldest) if oldest else 0.0
            return {
                **self._counts,
                **self.fenced.counts,
                "parts_written": self.parts.written,
                "pending": len(self._pending) + (self._busy is not None),
                "lag_s": round(lag, 3),
                "objects": len(self._bytes),  # sessions whose latest state this instance wrote
                "bytes": sum(self._bytes.values()),
            }

    # -- readers ---------------------------------------------------------------------------
    def fetch(self, sid: str) -> Future[bytes]:
        """Read `sid`'s snapshot on a reader thread: the bytes, or NotStored, ClosedInStore,
        CorruptSnapshot (damaged, or older than the copy this instance held)."""
        return self.fetch_then(sid, bytes)

    def fetch_then(self, sid: str, then: Callable[[bytes], T]) -> Future[T]:
        """Read `sid`'s snapshot and pass it to `then` (an engine's `resume`), both on a reader
        thread, so the step loop is handed a ready state. Refuses (StoreUnavailable) while
        MAX_READS reads wait already: a flood of unknown ids must not hold up real resumes."""
        with self._cond:
            if self._reads >= MAX_READS:
                raise StoreUnavailable(
                    f"{self._reads} session-store reads are waiting; retry shortly"
                )
            self._reads += 1
        future = self._readers.submit(self._read, sid, then)
        future.add_done_callback(self._read_done)  # also when cancelled before it ran
        return future

    def _read_done(self, _: Future[Any]) -> None:
        with self._cond:
            self._reads -= 1

    def _settle(self, sid: str) -> None:
        deadline = time.monotonic() + SETTLE_S
        with self._cond:
            while (
                sid in self._pending or (self._busy is not None and self._busy[0] == sid)
            ) and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())

    def _read(self, sid: str, then: Callable[[bytes], T]) -> T:
        self._settle(sid)  # this instance's own newer state first (an evicted session's)
        payload = self._get(sid)
        try:
            return then(payload)
        except ValueError:
            raise
        except Exception as exc:  # whatever else a snapshot makes `then` raise: its own loss
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc

    def _get(self, sid: str) -> bytes:
        skeleton = self.fenced.read(sid).payload  # held from now: its next write is fenced
        payload = parts.join(skeleton, self.parts.read)
        with self._cond:
            self._counts["resumes"] += 1
        return payload

    def holds(self, sid: str) -> bool:
        """Tell whether the store has an object for `sid` (blocking: start-up only); False if
        the store cannot be reached, so local snapshots take over."""
        if self._unreachable:  # one failed look-up is enough: start-up must not crawl
            return False
        try:
            return self.fenced.objects.etag(self.object_key(sid)) is not None
        except Exception as exc:
            log.warning("shared session store unreachable (%s): using local snapshots", exc)
            self._unreachable = True
            return False

    def forget(self, sid: str) -> None:
        """Queue the deletion of a stored session that can no longer be used (expired), if
        its object is still the one read."""
        self._queue(sid, _Write(None, self._clock()))

    # -- shutting down ---------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write is done or given up; False if time ran out first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued (within `timeout_s`), then stop the threads."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout=5)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self.checks.close()

    # -- the writer thread -----------------------------------------------------------------
    def _queue(self, sid: str, write: _Write) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending.pop(sid, None)  # only the latest state of a session matters
            self._pending[sid] = write
            puts = [s for s, w in self._pending.items() if w.produce is not None]
            held = sum(self._pending[s].nbytes for s in puts)
            held += self._busy[1].nbytes if self._busy is not None else 0
            over = max(0, len(self._pending) - self.max_pending)
            for n, old in enumerate(puts):
                # past the count, the oldest go; past the bytes too, but never the one queued
                if n >= over and (held <= self.max_pending_bytes or old == sid):
                    break
                held -= self._pending[old].nbytes
                del self._pending[old]  # deletions are never dropped: a closed chat must go
                self._dirty.add(old)
                self._counts["dropped"] += 1
                log.warning(
                    "shared session store: %d writes pending (the store is slow or down); "
                    "dropped the write of %s, which a lost instance would lose",
                    len(self._pending),
                    old,
                )
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                sid, write = self._pending.popitem(last=False)
                self._busy = (sid, write)
            try:
                self._apply(sid, write)
            except Exception as exc:
                self._failed(sid, write, exc)
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _apply(self, sid: str, write: _Write) -> None:
        if write.produce is None and not write.closed:
            with self._cond:
                self._bytes.pop(sid, None)
                self._dirty.discard(sid)
            if self.fenced.delete(sid):
                with self._cond:
                    self._counts["deletes"] += 1
            return
        if write.closed:
            sealed = Sealed(self.fenced.generation(sid) + 1, b"", closed=True)
        else:
            assert write.produce is not None
            cut = parts.split(write.produce(), self.part_min_bytes)
            written = self.parts.write(cut.parts)  # before the skeleton that refers to them
            with self._cond:
                self._counts["bytes_written"] += written
            sealed = Sealed(write.generation, cut.skeleton)
        size = self.fenced.write(sid, sealed)
        held = sum(len(part) for part in cut.parts.values()) if not write.closed else 0
        with self._cond:
            self._dirty.discard(sid)
            if size is None or write.closed:  # stale here, or closed: not held here any more
                self._bytes.pop(sid, None)
            else:
                self._bytes[sid] = size + held  # its skeleton and its parts
            if size is not None:
                self._counts["closes" if write.closed else "writes"] += 1
                self._counts["bytes_written"] += size

    def _failed(self, sid: str, write: _Write, exc: Exception) -> None:
        write.attempts += 1
        with self._cond:
            retry = write.attempts < ATTEMPTS and sid not in self._pending and not self._closed
            if not retry:
                self._counts["failures"] += 1
                if write.produce is not None and sid not in self._pending:
                    self._dirty.add(sid)
        if not retry:
            log.warning(
                "shared session store: gave up the %s of session %s after %d tries (%s: %s); "
                "it is kept on this instance's local snapshots only",
                "write" if write.produce is not None else "deletion",
                sid,
                write.attempts,
                type(exc).__name__,
                exc,
            )
            return
        time.sleep(min(self.retry_s * 2 ** (write.attempts - 1), 5.0))  # the writer's own thread
        with self._cond:
            if sid not in self._pending and not self._closed:  # no newer state arrived
                self._pending[sid] = write
                self._pending.move_to_end(sid, last=False)
                self._cond.notify_all()
