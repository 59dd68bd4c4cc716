"""A per-model file of issued session ids, so a restarted worker can answer "session_lost".

Sessions live in one worker's memory. When that process dies (killed, out of memory, a response
timeout) TorchServe starts a fresh worker that knows nothing of them, and their clients would get
`session_not_found` as if they had sent a made-up id. The registry fixes that: the worker appends
one line per event to a small file outside its process,

    o <id> <expires_at>     opened (or used again: the expiry moves)
    e <id>                  ended (closed, expired, evicted)
    l <id> <expires_at>     lost by an earlier worker (carried over)

and a freshly started worker first `recover()`s the ids that were never ended: the store loads them
as LOST tombstones (400 `session_lost`), and the file is rewritten to hold just those. The file is
compacted when its dead lines outnumber the live ones. Writes go to the OS on every event (no
fsync: the file has to survive the process, not the machine).

One registry file belongs to one worker at a time: the worker holds an exclusive lock on a
sibling `.lock` file for its lifetime (released by the kernel when the process dies). A second
worker of the same model on the same host (which sessions do not support anyway) cannot take the
lock and runs without a registry rather than corrupt the first one's.

Nothing here raises into request handling: a failed write is logged once and the registry goes
quiet; sessions still work, only the "lost" diagnosis after a crash is degraded to "not found".
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import IO

from llava.core.ids import is_valid_session_id

try:  # POSIX only; TorchServe workers run on Linux
    import fcntl
except ImportError:  # pragma: no cover - no locking: assume a single worker
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

ENV_DIR = "LLAVA_SESSION_REGISTRY_DIR"
LOST_RETENTION_S = 24 * 3600.0  # how long after its expiry a lost id is still reported as lost
MAX_LOST = 65_536  # lost ids carried over at most (the store keeps as many tombstones)
_COMPACT_SLACK = 1024  # dead lines tolerated before the first compaction
_LOCK_WAIT_S = 5.0  # a dying predecessor may still hold the lock for a moment


def registry_path(model_name: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """Return the registry file of a model: `<dir>/llava-sessions-<model>.registry`.

    `directory` defaults to `$LLAVA_SESSION_REGISTRY_DIR`, else the temp directory (`$TMPDIR`).
    """
    base = directory or os.environ.get(ENV_DIR) or tempfile.gettempdir()
    return Path(base) / f"llava-sessions-{safe_name(model_name)}.registry"


def safe_name(model_name: str) -> str:
    """A model name as a file name (TorchServe's names are free text)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", model_name or "model")[:100] or "model"


class SessionRegistry:
    """Record issued session ids in a file; recover the ones a dead worker never ended."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        retention_s: float = LOST_RETENTION_S,
        lock_wait_s: float = _LOCK_WAIT_S,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self._retention_s = retention_s
        self._lock = threading.Lock()
        self._live: dict[str, float] = {}
        self._lost: OrderedDict[str, float] = OrderedDict()
        self._lines = 0  # lines in the file now
        self._file: IO[str] | None = None
        self._lock_file: IO[bytes] | None = None
        self._enabled = self._take_lock(lock_wait_s)

    @classmethod
    def for_model(
        cls, model_name: str, directory: str | os.PathLike[str] | None = None, **kwargs: object
    ) -> SessionRegistry:
        """Open the registry of `model_name` (see `registry_path`)."""
        return cls(registry_path(model_name, directory), **kwargs)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        """Tell whether events are being recorded (False without the lock or after a failure)."""
        return self._enabled

    # -- start-up --------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Return the ids an earlier worker issued and never ended; keep only them in the file.

        Call once, before the first session opens. Ids whose expiry is more than the retention
        in the past are forgotten.
        """
        if not self._enabled:
            return []
        with self._lock:
            live, lost = _read(self.path)
            horizon = self._clock() - self._retention_s
            merged = {**lost, **live}
            recovered = sorted(
                ((exp, sid) for sid, exp in merged.items() if exp >= horizon), reverse=True
            )[:MAX_LOST]
            self._lost = OrderedDict((sid, exp) for exp, sid in reversed(recovered))
            self._live = {}
            self._rewrite()
            return list(self._lost)

    # -- events ----------------------------------------------------------------------------
    def opened(self, sid: str, expires_at: float) -> None:
        """Record that `sid` is open until `expires_at` (wall-clock seconds) unless used again."""
        with self._lock:
            if not self._enabled:
                return
            self._live[sid] = expires_at
            self._append(f"o {sid} {expires_at:.0f}\n")

    def ended(self, sid: str) -> None:
        """Record that `sid` ended (closed, expired, evicted or lost in this worker)."""
        with self._lock:
            if not self._enabled or self._live.pop(sid, None) is None:
                return
            self._append(f"e {sid}\n")

    def close(self) -> None:
        """Stop recording and release the lock (the file stays for the next worker)."""
        with self._lock:
            self._enabled = False
            for handle in (self._file, self._lock_file):
                if handle is not None:
                    handle.close()
            self._file = self._lock_file = None

    def stats(self) -> dict[str, int]:
        """Count live ids, carried-over lost ids and lines in the file."""
        with self._lock:
            return {"live": len(self._live), "lost": len(self._lost), "lines": self._lines}

    # -- internals -------------------------------------------------------------------------
    def _take_lock(self, wait_s: float) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.path.with_name(self.path.name + ".lock"), "ab")  # noqa: SIM115
        except OSError as exc:
            log.warning("session registry disabled: cannot open %s (%s)", self.path, exc)
            return False
        if fcntl is None:
            return True
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    log.warning(
                        "session registry disabled: %s is held by another worker of this model",
                        self.path,
                    )
                    self._lock_file.close()
                    self._lock_file = None
                    return False
                time.sleep(0.05)

    def _append(self, line: str) -> None:
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="ascii")  # noqa: SIM115
            self._file.write(line)
            self._file.flush()
            self._lines += 1
            if self._lines > 2 * (len(self._live) + len(self._lost)) + _COMPACT_SLACK:
                self._compact()
        except OSError as exc:
            self._fail(exc)

    def _compact(self) -> None:
        horizon = self._clock() - self._retention_s
        while self._lost and next(iter(self._lost.values())) < horizon:
            self._lost.popitem(last=False)
        self._rewrite()

    def _rewrite(self) -> None:
        """Replace the file atomically with the lost and live entries."""
        lines = [f"l {sid} {exp:.0f}\n" for sid, exp in self._lost.items()]
        lines += [f"o {sid} {exp:.0f}\n" for sid, exp in self._live.items()]
        try:
            if self._file is not None:
                self._file.close()
                self._file = None
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(lines), encoding="ascii")
            os.replace(tmp, self.path)
            self._lines = len(lines)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        log.warning("session registry disabled after a write error on %s: %s", self.path, exc)
        self._enabled = False


def _read(path: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Parse a registry file into (open ids, lost ids) with their expiry; skip torn lines."""
    live: dict[str, float] = {}
    lost: dict[str, float] = {}
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return live, lost
    except OSError as exc:
        log.warning("could not read session registry %s: %s", path, exc)
        return live, lost
    for line in text.splitlines():
        parts = line.split()
        if len(parts) not in (2, 3) or not is_valid_session_id(parts[1]):
            continue  # a torn last line from a killed worker, or garbage
        kind, sid = parts[0], parts[1]
        if kind == "e" and len(parts) == 2:
            live.pop(sid, None)
            continue
        if len(parts) != 3 or kind not in ("o", "l"):
            continue
        try:
            expires_at = float(parts[2])
        except ValueError:
            continue
        (live if kind == "o" else lost)[sid] = expires_at
    return live, lost
