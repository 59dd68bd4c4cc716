"""Seal a session's snapshot for a shared store: bound to its id, store and generation.

An object in a shared store (S3) is read by other instances, possibly after it was copied,
truncated, altered or put back by someone with write access to the bucket. Each object is

    MAGIC | HMAC-SHA256(key, MAGIC | session id | generation | kind | payload)
          | generation (8 bytes) | kind (1 byte: state or closed) | payload

where the key is derived from the store's location (bucket and prefix) and, when one is set,
the endpoint's secret (`session_store_secret`). So a torn or flipped object, one moved to
another session's key, one written under another endpoint's prefix, and (with a secret) one
forged by a bucket writer without the secret are all refused as `CorruptSnapshot`, costing
that one session only. The generation grows by one with every state a holder writes, so the
store can tell a newer copy from an older one put back (`shared.py` fences writes with it);
a closed session leaves a sealed tombstone (kind `closed`, no payload) that no stale write can
undo. The payload itself is the engine's snapshot (safetensors: data, never code), which
checks the model it was taken with.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from llava.sessions.snapshots import CorruptSnapshot

MAGIC = b"LLSS\x02"
_MAC = hashlib.sha256().digest_size
_HEADER = struct.Struct(">QB")  # generation, kind
_STATE, _CLOSED = 0, 1


@dataclass(frozen=True)
class Sealed:
    """What a sealed object holds: its generation, and a snapshot or a close."""

    generation: int
    payload: bytes
    closed: bool = False


def store_key(location: str, secret: str = "") -> bytes:
    """Derive the sealing key of one store location (and the endpoint's secret, if any)."""
    material = f"llava-session-store/1\0{location.rstrip('/')}\0{secret}".encode()
    return hashlib.sha256(material).digest()


def object_name(key: bytes, sid: str) -> str:
    """Name `sid`'s object by a MAC of the id under the store's key: a listing of the store
    reveals no session id (an id is its conversation's bearer token)."""
    names = hmac.new(key, b"object-names", hashlib.sha256).digest()
    return hmac.new(names, sid.encode(), hashlib.sha256).hexdigest()[:40]


def part_name(key: bytes, digest: str) -> str:
    """Name a part stored once by content (`parts.py`) by a MAC of its digest under the
    store's key: no one without the secret can tell which picture an object holds."""
    names = hmac.new(key, b"part-names", hashlib.sha256).digest()
    return hmac.new(names, digest.encode(), hashlib.sha256).hexdigest()[:40]


def seal(key: bytes, sid: str, sealed: Sealed) -> bytes:
    """Wrap a snapshot (or a close) for the store, bound to `sid` and the key's store."""
    body = _HEADER.pack(sealed.generation, _CLOSED if sealed.closed else _STATE) + sealed.payload
    return MAGIC + _mac(key, sid, body) + body


def unseal(key: bytes, sid: str, data: bytes) -> Sealed:
    """Return what a sealed object holds, or raise `CorruptSnapshot`."""
    head = len(MAGIC) + _MAC
    if len(data) < head + _HEADER.size or not data.startswith(MAGIC):
        raise CorruptSnapshot(f"the stored state of {sid} is not a sealed session snapshot")
    mac, body = data[len(MAGIC) : head], data[head:]
    if not hmac.compare_digest(mac, _mac(key, sid, body)):
        raise CorruptSnapshot(
            f"the stored state of {sid} is torn, altered, or sealed for another session, "
            "store prefix or secret"
        )
    generation, kind = _HEADER.unpack_from(body)
    payload = body[_HEADER.size :]
    if kind not in (_STATE, _CLOSED) or (kind == _STATE) != bool(payload):
        raise CorruptSnapshot(f"the stored state of {sid} has no valid content")
    return Sealed(generation, payload, kind == _CLOSED)


def _mac(key: bytes, sid: str, body: bytes) -> bytes:
    return hmac.new(key, MAGIC + sid.encode() + b"\0" + body, hashlib.sha256).digest()
