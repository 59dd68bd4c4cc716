"""The shared store's parts: each picture (or its features) written once, by content.

A part is named by a MAC of its SHA-256 under the store's key (`sealed.part_name`) and shared
by every turn of its session, and by sessions with the same picture. No instance can tell when
the last session using a part ends, so parts go with the lifecycle rule (the TTL plus a day
after their last write); an instance writes a part again with its session's next turn once its
own write of it is PART_REFRESH_S old (or, after a resume, once), so a live session never loses
one to that rule.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from llava.sessions.fenced import MAX_OBJECT_BYTES, FencedObjects
from llava.sessions.parts import CorruptSnapshot

PART_REFRESH_S = 12 * 3600.0  # a part written longer ago is written again with its session
PARTS_REMEMBERED = 65_536  # parts whose last write this instance remembers


class StoredParts:
    """Write parts not written lately; read one back by its digest (blocking: threads only)."""

    def __init__(self, fenced: FencedObjects) -> None:
        self.fenced = fenced
        self.written = 0  # parts written
        self._lock = threading.Lock()
        self._at: OrderedDict[str, float] = OrderedDict()  # digest -> written at, oldest first

    def write(self, parts: dict[str, bytes]) -> int:
        """Write the parts this instance did not write lately; return the bytes written."""
        written = 0
        for digest, data in parts.items():
            with self._lock:
                at = self._at.get(digest)
            if at is not None and time.monotonic() - at < PART_REFRESH_S:
                continue
            key = self.fenced.part_key(digest)
            self.fenced.objects.put(key, data, if_match=None, always=True)  # same bytes, by name
            with self._lock:
                self._at.pop(digest, None)
                self._at[digest] = time.monotonic()
                while len(self._at) > PARTS_REMEMBERED:
                    self._at.popitem(last=False)
                self.written += 1
            written += len(data)
        return written

    def read(self, digest: str) -> bytes:
        """Return a part's bytes (checked against the digest by `parts.join`)."""
        stored = self.fenced.objects.get(self.fenced.part_key(digest), MAX_OBJECT_BYTES)
        if stored is None:
            raise CorruptSnapshot(
                f"a picture of the stored session ({digest[:12]}) is no longer in the store"
            )
        return stored[0]
