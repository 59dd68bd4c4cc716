"""Which copy of a session wins in a shared store: generations and conditional writes.

Two instances can hold the same session: the router gave up on one and another resumed it from
the store, then the first came back. Every sealed object carries a generation that grows by one
with each state a holder writes (`sealed.py`), and every write is conditional on the object the
writer last wrote or read (`If-Match` its ETag; `If-None-Match: *` for a session never stored):

- a holder whose write is refused reads the winner: a newer generation or a close means its copy
  is stale, so it is marked *moved* (its holder drops it and resumes from the store); an older
  generation or a damaged object (an older copy put back, or written over by someone without
  the secret) is written over;
- a close writes a sealed tombstone, and always wins: a stale write after it is refused;
- an expiry or a loss deletes the object only if it is still the one this instance holds;
- a read that finds an older generation than this instance wrote is refused (a put-back copy).

This module holds the rules; `shared.py` queues the work on its threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from llava.sessions.objects import ObjectStore, Refused, StoreLocation
from llava.sessions.sealed import Sealed, object_name, part_name, seal, unseal
from llava.sessions.snapshots import CorruptSnapshot

log = logging.getLogger(__name__)

MAX_OBJECT_BYTES = 1 << 30  # a 7B session's snapshot is ~5 MB; refuse anything absurd
REMEMBERED = 65_536  # sessions whose object this instance holds (ETag and generation)
CHECK_PAUSE_S = 30.0  # how long turns go unchecked after a check failed or came too late
WRITE_TRIES = 4  # a conditional write refused this often in a row is given up (retried later)


class NotStored(LookupError):
    """The store holds no state for this session."""


class ClosedInStore(LookupError):
    """The store holds the session's tombstone: its user closed it (on any instance)."""


@dataclass(frozen=True)
class _Held:
    """The object of one session this instance wrote or read last."""

    etag: str
    generation: int


@dataclass(frozen=True)
class _Found:
    """An object as read back: its ETag, bytes, and content (None if it does not unseal)."""

    etag: str
    data: bytes
    sealed: Sealed | None


class FencedObjects:
    """Sealed, generation-fenced reads and writes of sessions' objects (blocking: threads only)."""

    def __init__(self, objects: ObjectStore, location: StoreLocation, key: bytes) -> None:
        self.objects = objects
        self.location = location
        self._key = key
        self._lock = threading.Lock()
        self._held: OrderedDict[str, _Held] = OrderedDict()  # oldest first, bounded
        self._moved: OrderedDict[str, None] = OrderedDict()  # sessions a newer copy replaced
        self.counts = {"fenced": 0, "replaced": 0}

    def object_key(self, sid: str) -> str:
        """The key of `sid`'s object (named by `sealed.object_name`)."""
        return self.location.key(object_name(self._key, sid))

    def part_key(self, digest: str) -> str:
        """The key of the part whose content has `digest` (named by `sealed.part_name`)."""
        return self.location.part_key(part_name(self._key, digest))

    def generation(self, sid: str) -> int:
        """The generation of `sid`'s object as this instance last wrote or read it (0: none)."""
        with self._lock:
            held = self._held.get(sid)
        return held.generation if held is not None else 0

    def read(self, sid: str) -> Sealed:
        """Read `sid`'s state to resume it: NotStored, ClosedInStore, CorruptSnapshot."""
        found = self._find(sid)
        if found is None:
            raise NotStored(sid)
        sealed = unseal(self._key, sid, found.data)
        if sealed.closed:
            raise ClosedInStore(sid)
        known = self.generation(sid)
        if sealed.generation < known:
            raise CorruptSnapshot(
                f"the stored state of {sid} is older (generation {sealed.generation}) than the "
                f"one this instance held ({known}): an older copy was put back"
            )
        self._hold(sid, found.etag, sealed.generation)
        return sealed

    def write(self, sid: str, sealed: Sealed) -> int | None:
        """Write a state or a tombstone over the object this instance holds; return its size,
        or None when the store holds a newer copy (this one is stale: marked moved)."""
        key = self.object_key(sid)
        with self._lock:
            held = self._held.get(sid)
        known = held.generation if held is not None else -1  # what this instance last saw
        for _ in range(WRITE_TRIES):
            data = seal(self._key, sid, sealed)
            try:
                etag = self.objects.put(key, data, if_match=held.etag if held else None)
            except Refused:
                found = self._find(sid)
                if found is not None and found.data == data:  # our own write, answered late
                    etag = found.etag
                elif sealed.closed or not _newer(found, known) or (found is None and held is None):
                    # put back (not newer than what this instance saw), damaged, or gone
                    # before a first write: ours stands (a close always does), written over it
                    held = _Held(found.etag, _generation(found)) if found else None
                    if sealed.closed and held is not None:
                        generation = max(sealed.generation, held.generation + 1)
                        sealed = Sealed(generation, b"", True)
                    self._replaced(sid, found)
                    continue
                else:
                    self._lose(sid, found)
                    return None
            self._hold(sid, etag, sealed.generation)
            return len(data)
        raise Refused(f"the object of session {sid} changed under {WRITE_TRIES} writes in a row")

    def delete(self, sid: str) -> bool:
        """Delete `sid`'s object if it is still the one this instance holds; True if deleted."""
        with self._lock:
            held = self._held.get(sid)
        if held is None:
            return False  # never stored here, or another instance holds it now
        try:
            self.objects.delete(self.object_key(sid), if_match=held.etag)
        except Refused:
            deleted = False  # written since by another instance: it holds the session now
        else:
            deleted = True
        self.forget(sid)  # after the call: a delete that failed is retried with the same ETag
        return deleted

    def current(self, sid: str) -> bool:
        """Whether this instance's copy of `sid` is still the newest (one HEAD; a GET only when
        the object changed). False also when it moved, was closed or ended elsewhere."""
        if self.moved(sid):
            return False
        with self._lock:
            held = self._held.get(sid)
        if held is None:
            return True  # never stored: this copy is the only one
        etag = self.objects.etag(self.object_key(sid))
        if etag in (held.etag, self._etag(sid)):  # ours (or our write that just landed)
            return True
        found = self._find(sid)
        if found is None or (found.sealed is not None and found.sealed.closed):
            return False
        if found.etag == self._etag(sid):
            return True
        return not _newer(found, held.generation)  # put back or damaged: ours stands

    def moved(self, sid: str) -> bool:
        """Whether a write of `sid` was refused for a newer copy (no I/O); it stays so until
        this instance reads or writes the session again."""
        with self._lock:
            return sid in self._moved

    def forget(self, sid: str) -> None:
        """Stop holding `sid` (its object is not this instance's any more)."""
        with self._lock:
            self._held.pop(sid, None)

    # -- inside ----------------------------------------------------------------------------
    def _find(self, sid: str) -> _Found | None:
        stored = self.objects.get(self.object_key(sid), MAX_OBJECT_BYTES)
        if stored is None:
            return None
        data, etag = stored
        try:
            sealed: Sealed | None = unseal(self._key, sid, data)
        except CorruptSnapshot:
            sealed = None
        return _Found(etag, data, sealed)

    def _etag(self, sid: str) -> str | None:
        with self._lock:
            held = self._held.get(sid)
        return held.etag if held is not None else None

    def _hold(self, sid: str, etag: str, generation: int) -> None:
        with self._lock:
            self._moved.pop(sid, None)  # read or written again: current from here
            self._held.pop(sid, None)
            self._held[sid] = _Held(etag, generation)
            while len(self._held) > REMEMBERED:
                self._held.popitem(last=False)

    def _lose(self, sid: str, found: _Found | None) -> None:
        with self._lock:
            self._held.pop(sid, None)
            self._moved[sid] = None
            while len(self._moved) > REMEMBERED:
                self._moved.popitem(last=False)
            self.counts["fenced"] += 1
        what = "gone" if found is None else "closed" if _closed(found) else "newer"
        log.warning(
            "session %s: the store holds a %s copy than this instance's (another instance "
            "answered it since): this copy is dropped, and its next request resumes from the store",
            sid,
            what,
        )

    def _replaced(self, sid: str, found: _Found | None) -> None:
        if found is None:
            return
        with self._lock:
            self.counts["replaced"] += 1
        log.warning(
            "session %s: the store held an older or damaged copy (put back, or written without "
            "the secret); it is written over with this instance's newer state",
            sid,
        )


def _generation(found: _Found) -> int:
    return found.sealed.generation if found.sealed is not None else 0


def _closed(found: _Found) -> bool:
    return found.sealed is not None and found.sealed.closed


def _newer(found: _Found | None, known: int) -> bool:
    """Whether the store's object beats the copy this instance last saw at generation `known`
    (-1: none): gone (ended elsewhere), closed, or of a later generation (written by another
    holder). Not newer: put back (an older genuine object, or this one again) or damaged."""
    if found is None:
        return True
    if found.sealed is None:
        return False  # damaged: never a reason to drop a good copy
    return found.sealed.closed or found.sealed.generation > known


class TurnChecks:
    """Ask whether held copies are still the newest, on threads of their own (a slow resume
    never holds up a held session's turn); paused while the store fails or is slow."""

    def __init__(self, fenced: FencedObjects, threads: int) -> None:
        self.fenced = fenced
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="llava-store-check")
        self._off_until = 0.0  # after a failed or late check: turns answer unchecked

    def check(self, sid: str) -> Future[bool]:
        """Tell whether this instance's copy of `sid` is still the newest (False: drop it and
        resume from the store). While paused, True at once: the held copy answers, its write
        still fenced."""
        if time.monotonic() < self._off_until:
            done: Future[bool] = Future()
            done.set_result(True)
            return done
        return self._pool.submit(self._current, sid)

    def pause(self) -> None:
        """Skip checks for CHECK_PAUSE_S: a check failed or came too late."""
        self._off_until = time.monotonic() + CHECK_PAUSE_S

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _current(self, sid: str) -> bool:
        try:
            return self.fenced.current(sid)
        except Exception:
            self.pause()
            raise
