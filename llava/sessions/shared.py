"""A shared session store: every session's latest snapshot in S3, so any instance can resume it.

Local snapshots survive a worker restart; these survive the instance: scale-in, a deployment
that replaces every instance, a lost host. After an open and after each finished turn the
service hands `save` the engine's snapshot producer (references taken on the step thread); one
writer thread serialises, seals (`sealed.py`) and uploads it. The queue holds at most one
pending write per session (a newer snapshot replaces the one not yet written: only the latest
matters) and at most `max_pending` sessions; past that the oldest pending write is dropped and
counted. Nothing here ever blocks the step thread, and a store that fails (an outage, missing
permissions) costs only the writes, retried a few times and counted, never an answer: local
snapshots still cover a restart.

Reading happens on reader threads (`fetch` returns a future): a request for a session this
instance does not hold waits for it like an image, never stalling other streams.

Deletion follows the session's end: a close deletes the object; an expiry or a loss deletes it
only if it is still the one this instance wrote or resumed from (another instance may have
resumed the session and written since); an eviction keeps it, so the session resumes from the
store on its next request instead of being lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from llava.core.errors import StoreUnavailable
from llava.sessions.objects import ObjectStore, StoreLocation
from llava.sessions.sealed import object_name, seal, store_key, unseal
from llava.sessions.session import CLOSED, EVICTED

log = logging.getLogger(__name__)

MAX_OBJECT_BYTES = 1 << 30  # a 7B session's snapshot is ~5 MB; refuse anything absurd
ATTEMPTS = 4  # tries of one write before it is given up (counted as a failure)
MAX_READS = 64  # reads waiting or running at once; past it a resume is refused (503)
SETTLE_S = 30.0  # how long a read waits for this instance's own pending write of the session
WRITTEN_MEMORY = 65_536  # sessions whose last object's ETag is remembered (conditional deletes)


class NotStored(LookupError):
    """The store holds no state for this session."""


@dataclass
class _Write:
    """One pending operation on a session's object: a put (with its producer) or a delete."""

    produce: Callable[[], bytes] | None  # None: delete
    queued_at: float
    only_if_ours: bool = False
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
    store.save(sid, producer)        # queued; the writer uploads the latest one
    data = store.fetch(sid).result() # on a reader thread; NotStored / CorruptSnapshot
    store.remove(sid, "closed")
    store.flush(30)                  # before the instance goes away
    """

    def __init__(
        self,
        objects: ObjectStore,
        location: StoreLocation,
        *,
        secret: str = "",
        max_pending: int = 256,
        readers: int = 4,
        retry_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.objects = objects
        self.location = location
        self.max_pending = max_pending
        self.retry_s = retry_s
        self._key = store_key(location.uri, secret)
        self._clock = clock
        self._pending: OrderedDict[str, _Write] = OrderedDict()  # oldest first
        self._busy: tuple[str, _Write] | None = None  # the write in progress
        # session id -> ETag of the object this instance wrote last (oldest first, bounded)
        self._ours: OrderedDict[str, str] = OrderedDict()
        self._dirty: set[str] = set()  # sessions whose latest state was never stored (gave up)
        self._reads = 0
        self._counts = {"writes": 0, "deletes": 0, "failures": 0, "dropped": 0, "resumes": 0}
        self._bytes: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._unreachable = False  # a start-up look-up failed (holds)
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="llava-store-read")
        self._writer = threading.Thread(target=self._run, name="llava-store-write", daemon=True)
        self._writer.start()
        log.info("sessions are kept in the shared store %s", location.uri)

    def object_key(self, sid: str) -> str:
        """The key of `sid`'s object (named by `sealed.object_name`)."""
        return self.location.key(object_name(self._key, sid))

    # -- the step thread's side: never blocks on the network -------------------------------
    def save(self, sid: str, produce: Callable[[], bytes]) -> None:
        """Queue the latest snapshot of `sid` (replacing one not yet written)."""
        self._queue(sid, _Write(produce, self._clock()))

    def remove(self, sid: str, reason: str) -> None:
        """Queue the deletion of `sid`'s object for a session that ended for `reason`."""
        if reason == EVICTED:  # not ended for the user: it resumes from the store next time
            with self._cond:
                self._bytes.pop(sid, None)  # no longer held here
            return
        self._queue(sid, _Write(None, self._clock(), only_if_ours=reason != CLOSED))

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
                "pending": len(self._pending) + (self._busy is not None),
                "lag_s": round(lag, 3),
                "objects": len(self._bytes),  # sessions whose latest state this instance wrote
                "bytes": sum(self._bytes.values()),
            }

    # -- readers ---------------------------------------------------------------------------
    def fetch(self, sid: str) -> Future[bytes]:
        """Read `sid`'s snapshot on a reader thread: NotStored, CorruptSnapshot or the bytes.
        Refuses (StoreUnavailable) while MAX_READS reads wait already: a flood of unknown ids
        must not hold up real resumes behind it."""
        with self._cond:
            if self._reads >= MAX_READS:
                raise StoreUnavailable(
                    f"{self._reads} session-store reads are waiting; retry shortly"
                )
            self._reads += 1
        return self._readers.submit(self._read, sid)

    def _settle(self, sid: str) -> None:
        deadline = time.monotonic() + SETTLE_S
        with self._cond:
            while (
                sid in self._pending or (self._busy is not None and self._busy[0] == sid)
            ) and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())

    def _read(self, sid: str) -> bytes:
        try:
            self._settle(sid)  # this instance's own newer state first (an evicted session's)
            return self._get(sid)
        finally:
            with self._cond:
                self._reads -= 1

    def _get(self, sid: str) -> bytes:
        stored = self.objects.get(self.object_key(sid), MAX_OBJECT_BYTES)
        if stored is None:
            raise NotStored(sid)
        data, etag = stored
        payload = unseal(self._key, sid, data)
        with self._cond:
            self._counts["resumes"] += 1
            self._own(sid, etag)  # resumed here: its expiry here deletes it, if still this one
        return payload

    def _own(self, sid: str, etag: str) -> None:
        """Remember `sid`'s object as the one this instance holds (for conditional deletes)."""
        self._ours.pop(sid, None)
        self._ours[sid] = etag
        while len(self._ours) > WRITTEN_MEMORY:
            self._ours.popitem(last=False)

    def holds(self, sid: str) -> bool:
        """Tell whether the store has an object for `sid` (blocking: start-up only); False if
        the store cannot be reached, so local snapshots take over."""
        if self._unreachable:  # one failed look-up is enough: start-up must not crawl
            return False
        try:
            return self.objects.etag(self.object_key(sid)) is not None
        except Exception as exc:
            log.warning("shared session store unreachable (%s): using local snapshots", exc)
            self._unreachable = True
            return False

    def forget(self, sid: str) -> None:
        """Queue the deletion of a stored session that can no longer be used (expired)."""
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

    # -- the writer thread -----------------------------------------------------------------
    def _queue(self, sid: str, write: _Write) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending.pop(sid, None)  # only the latest state of a session matters
            self._pending[sid] = write
            puts = [s for s, w in self._pending.items() if w.produce is not None]
            for old in puts[: max(0, len(self._pending) - self.max_pending)]:
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
        key = self.object_key(sid)
        if write.produce is not None:
            data = seal(self._key, sid, write.produce())
            etag = self.objects.put(key, data)
            with self._cond:
                self._own(sid, etag)
                self._bytes[sid] = len(data)
                self._dirty.discard(sid)
                self._counts["writes"] += 1
            return
        with self._cond:
            ours = self._ours.get(sid)
            self._bytes.pop(sid, None)
            self._dirty.discard(sid)
        if write.only_if_ours and (ours is None or self.objects.etag(key) != ours):
            with self._cond:
                self._ours.pop(sid, None)
            return  # another instance resumed it and wrote since (or we never wrote it)
        self.objects.delete(key)
        with self._cond:
            self._ours.pop(sid, None)
            self._counts["deletes"] += 1

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
