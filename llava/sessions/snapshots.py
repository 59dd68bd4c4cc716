"""Session snapshots on local disk, so a restarted worker loses no conversation.

A worker that dies (a fatal CUDA error, the OOM killer, a response timeout) takes its sessions'
caches with it, but what rebuilds them is small: the token ids of the conversation and the image
features. After an open and after each finished turn the service hands this directory a
snapshot *producer* (the engine's `snapshot`: cheap references taken on the step thread); one
writer thread serialises it and writes `<id>.snap` atomically (temporary file, then rename),
the latest of each session only (a newer one replaces a snapshot not yet written, so what waits
is bounded by the sessions, however far behind the disk is),
readable by the worker's user only. A session's file goes when the session ends (closed,
expired, evicted). A disk budget bounds the directory: past it, the snapshots written longest
ago go first, and those sessions would answer `session_lost` after a restart.

Each file starts with the SHA-256 of the rest, so a torn or corrupt file is refused on reading
and costs that one session only. A snapshot's pictures (or their features) are written once, to
`parts/<SHA-256>` (`parts.py`), shared by every turn of the session and counted by the sessions
that use them: each turn writes the rest (a few KB), and a part goes with its last session.
A fresh worker lists the files, restores the sessions its session registry says an earlier
worker left open, and deletes the rest.

Pure: no torch; what a snapshot holds is each engine's business (`llava/engines/*/`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from llava.core.ids import is_valid_session_id
from llava.sessions.parts import CorruptSnapshot, digests, join, split
from llava.sessions.registry import safe_name
from llava.sessions.session import EXPIRED, LOST
from llava.sessions.store import SessionStore

log = logging.getLogger(__name__)

SUFFIX = ".snap"
PARTS = "parts"  # the pictures (or features) of the snapshots, one file each, by content
_DIGEST = hashlib.sha256().digest_size


class SnapshotDir:
    """Write, bound, list and read session snapshots in one directory (one writer thread)."""

    def __init__(self, path: str | os.PathLike[str], budget_bytes: int) -> None:
        self.path = Path(path)
        self.budget_bytes = budget_bytes
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        self._sizes: OrderedDict[str, int] = OrderedDict()  # written longest ago first
        self._parts = self.path / PARTS
        self._parts.mkdir(mode=0o700, exist_ok=True)
        self._refs: dict[str, frozenset[str]] = {}  # session -> its parts (writer thread)
        self._users: Counter[str] = Counter()  # part -> sessions using it
        self._lock = threading.Lock()
        # what waits, per session (latest only: a newer save or a removal replaces it), oldest
        # first, so the queue never holds more than one entry per session
        self._pending: OrderedDict[str, Callable[[], bytes] | None] = OrderedDict()
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._writer = threading.Thread(target=self._run, name="llava-snapshots", daemon=True)
        self._writer.start()

    @classmethod
    def for_model(cls, directory: str, model_name: str, budget_bytes: int | None) -> SnapshotDir:
        """Open `<directory>/<model>` ("" = the temp dir's `llava-snapshots`); the budget
        defaults to half the disk's free space."""
        base = Path(directory or Path(tempfile.gettempdir()) / "llava-snapshots")
        path = base / safe_name(model_name)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if budget_bytes is None:
            budget_bytes = shutil.disk_usage(path).free // 2
        log.info("session snapshots in %s (budget %d MiB)", path, budget_bytes >> 20)
        return cls(path, budget_bytes)

    # -- the step thread's side: never blocks on the disk ----------------------------------
    def save(self, sid: str, produce: Callable[[], bytes]) -> None:
        """Queue a snapshot of `sid` (produced and written on the writer thread), replacing
        one of it not yet written."""
        self._queue(sid, produce)

    def remove(self, sid: str) -> None:
        """Queue the removal of `sid`'s snapshot (a save of it not yet written is dropped)."""
        self._queue(sid, None)

    def _queue(self, sid: str, produce: Callable[[], bytes] | None) -> None:
        with self._cond:
            self._pending[sid] = produce  # in its place: a busy session is never put off
            self._cond.notify_all()

    def size_of(self, sid: str) -> int:
        """Bytes of `sid`'s snapshot as last written (0 when none is on disk)."""
        with self._lock:
            return self._sizes.get(sid, 0)

    def stats(self) -> dict[str, int]:
        """Count snapshots on disk and their bytes."""
        with self._lock:
            return {"snapshots": len(self._sizes), "bytes": sum(self._sizes.values())}

    def flush(self) -> None:
        """Wait until every queued save and removal is on disk."""
        with self._cond:
            while self._pending or self._busy:
                self._cond.wait()

    def close(self) -> None:
        """Finish what is queued, then stop the writer thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout=30)

    # -- start-up --------------------------------------------------------------------------
    def found(self) -> list[str]:
        """Return the ids of the snapshots in the directory (stray files are removed)."""
        ids = []
        for entry in sorted(self.path.iterdir(), key=_mtime):
            sid = entry.name.removesuffix(SUFFIX)
            if entry.suffix == SUFFIX and is_valid_session_id(sid) and entry.is_file():
                ids.append(sid)
                with self._lock:
                    self._sizes[sid] = entry.stat().st_size
                with contextlib.suppress(CorruptSnapshot, OSError):  # refused when read
                    used = digests(self._skeleton(sid))
                    self._use(sid, used)
                    with self._lock:
                        self._sizes[sid] += sum(_size(self._parts / d) for d in used)
            elif entry != self._parts:  # a temporary file a dead worker left half-written
                _unlink(entry)
        for part in self._parts.iterdir():  # parts no snapshot uses, or half-written
            if part.name not in self._users:
                _unlink(part)
        return ids

    def read(self, sid: str) -> bytes:
        """Return the payload of `sid`'s snapshot, or raise `CorruptSnapshot`."""
        return join(self._skeleton(sid), self._part)

    def _part(self, digest: str) -> bytes:
        try:
            return (self._parts / digest).read_bytes()
        except OSError as exc:
            raise CorruptSnapshot(f"a picture of the snapshot is missing: {exc}") from exc

    def _skeleton(self, sid: str) -> bytes:
        try:
            data = (self.path / (sid + SUFFIX)).read_bytes()
        except OSError as exc:
            raise CorruptSnapshot(f"cannot read the snapshot of {sid}: {exc}") from exc
        digest, payload = data[:_DIGEST], data[_DIGEST:]
        if len(data) <= _DIGEST or hashlib.sha256(payload).digest() != digest:
            raise CorruptSnapshot(f"the snapshot of {sid} is torn or corrupt")
        return payload

    def discard(self, sid: str) -> None:
        """Delete `sid`'s snapshot now (at start-up, before the writer has work)."""
        self._delete(sid)

    # -- the writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                sid, produce = self._pending.popitem(last=False)
                self._busy = True
            try:
                if produce is None:
                    self._delete(sid)
                else:
                    self._write(sid, produce)
            except Exception:  # a failed snapshot costs a restart's recovery, never a request
                log.exception("session snapshot for %s failed", sid)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, sid: str, produce: Callable[[], bytes]) -> None:
        cut = split(produce())
        for digest, data in cut.parts.items():  # before the skeleton that refers to them
            if not (self._parts / digest).exists():
                _write_atomically(self._parts / digest, [data])
        payload = cut.skeleton
        _write_atomically(self.path / (sid + SUFFIX), [hashlib.sha256(payload).digest(), payload])
        self._use(sid, cut.parts)
        with self._lock:
            self._sizes[sid] = _DIGEST + len(payload) + sum(map(len, cut.parts.values()))
            self._sizes.move_to_end(sid)
            over = sum(self._sizes.values()) - self.budget_bytes
            victims = []
            for old, size in self._sizes.items():
                if over <= 0 or old == sid:
                    break
                victims.append(old)
                over -= size
        for old in victims:
            log.warning(
                "snapshot disk budget (%d bytes) reached: dropping the snapshot of %s, which "
                "would be lost if the worker restarted; raise snapshot_budget_mb",
                self.budget_bytes,
                old,
            )
            self._delete(old)

    def _delete(self, sid: str) -> None:
        with self._lock:
            self._sizes.pop(sid, None)
        _unlink(self.path / (sid + SUFFIX))
        self._use(sid, [])

    def _use(self, sid: str, parts: Iterable[str]) -> None:
        """Record the parts `sid`'s snapshot uses now; delete those no snapshot uses any more
        (locked: start-up's discards may run beside the writer's deletions)."""
        with self._lock:
            new, old = frozenset(parts), self._refs.pop(sid, frozenset())
            if new:
                self._refs[sid] = new
            self._users.update(new - old)
            for digest in old - new:
                self._users[digest] -= 1
                if self._users[digest] <= 0:
                    del self._users[digest]
                    _unlink(self._parts / digest)


class Resumer(Protocol):
    """What rebuilds a session from its snapshot bytes (the engine), and frees one."""

    def resume(self, data: bytes) -> tuple[Any, dict[str, Any]]: ...
    def adopt(self, state: Any) -> None: ...
    def release(self, state: Any) -> None: ...


def recover(
    snapshots: SnapshotDir,
    engine: Resumer,
    store: SessionStore,
    left_open: Iterable[str],
    *,
    clock: Callable[[], float] = time.time,
    shared: Callable[[str], bool] | None = None,
) -> dict[str, int]:
    """Restore the sessions an earlier worker left open from their snapshots, at start-up.

    Sessions left open without a usable snapshot answer `session_lost`, those whose idle time
    ran out while no worker served them `session_expired`; snapshots of sessions that ended
    are deleted. With a shared store, `shared(sid)` tells whether it holds a session: such a
    session is left to resume from there on its next request (its latest state, maybe
    answered on another instance meanwhile), not restored from this disk's copy. Returns how
    many sessions went each way.
    """
    left = set(left_open)
    found = snapshots.found()
    counts = {"restored": 0, "expired": 0, "corrupt": 0, "lost": 0}
    if shared is not None:
        counts["in_store"] = 0
    if found:
        log.info("restoring sessions from %d snapshot(s) in %s", len(found), snapshots.path)
    for n, sid in enumerate(found, 1):
        if sid not in left:  # ended before the worker died: nothing of it may stay
            snapshots.discard(sid)
            continue
        left.discard(sid)
        if shared is not None and shared(sid):
            counts["in_store"] += 1
            continue
        try:
            state, extra = engine.resume(snapshots.read(sid))
            expires_at = float(extra.get("expires_at", 0))
        except Exception as exc:  # whatever a damaged file raises costs its own session only
            log.warning(
                "session %s cannot be restored (%s: %s); it answers session_lost",
                sid,
                type(exc).__name__,
                exc,
            )
            snapshots.discard(sid)
            store.load_tombstones([sid], LOST)
            counts["corrupt"] += 1
            continue
        engine.adopt(state)
        if expires_at <= clock():
            engine.release(state)
            snapshots.discard(sid)
            store.load_tombstones([sid], EXPIRED)
            counts["expired"] += 1
            continue
        store.restore(sid, state, state.nbytes, expires_at, extra.get("info") or {})
        counts["restored"] += 1
        if n % 50 == 0:
            log.info("restored %d of %d snapshot(s)", n, len(found))
    if shared is not None:  # no snapshot here: the shared store may still have it
        left = {sid for sid in left if not shared(sid)}
    counts["lost"] = store.load_tombstones(left, LOST)
    if found or left:
        log.info("sessions after the restart: %s", counts)
    return counts


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(entry: Path) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:
        return 0.0


def _write_atomically(path: Path, chunks: list[bytes]) -> None:
    """Write a file readable by the worker's user only, whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        for chunk in chunks:
            out.write(chunk)
    os.replace(tmp, path)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
