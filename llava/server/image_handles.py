"""Pictures named by a client's uuid (vLLM's `{"image_url": null, "uuid": ...}` form), so a chat
client need not send megabytes of base64 again each turn.

A uuid is bound to the bytes it was first sent with, in its tenant's namespace (`cache_salt`):
sent again with other bytes it is refused, never served. It names those bytes only; what it may
be answered with is still what the instance holds of the same conversation (chats.py checks).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from llava.core.errors import SEND_PICTURE_AGAIN, InvalidRequest, UnknownImageHandle


class ImageHandles:
    """uuid -> content digest per tenant, the least recently used forgotten past `capacity`."""

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self._digests: OrderedDict[tuple[str | None, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def bind(self, salt: str | None, uuid: str, digest: str) -> None:
        """Name `digest` by `uuid`; a uuid named other bytes before is a 400."""
        with self._lock:
            known = self._digests.get((salt, uuid))
            if known is not None and known != digest:
                raise InvalidRequest(
                    f"the image uuid {uuid!r} was sent before with another picture: give each "
                    "picture its own uuid",
                    field="messages",
                )
            self._digests[(salt, uuid)] = digest
            self._digests.move_to_end((salt, uuid))
            while len(self._digests) > self.capacity:
                self._digests.popitem(last=False)

    def resolve(self, salt: str | None, uuid: str) -> str:
        """The digest a uuid names, checked before anything is read; unknown is a 400."""
        with self._lock:
            digest = self._digests.get((salt, uuid))
            if digest is not None:
                self._digests.move_to_end((salt, uuid))
        if digest is None:
            raise unknown_handle(uuid)
        return digest


def unknown_handle(uuid: str) -> UnknownImageHandle:
    """One refusal for every handle not resolved, whatever the reason (it tells nothing of
    what the instance holds)."""
    return UnknownImageHandle(
        f"this instance holds no picture named {uuid[:64]!r} for this chat: " + SEND_PICTURE_AGAIN,
        field="messages",
    )
