"""Seal a session's snapshot for a shared store: bound to its id and its store, checked on read.

An object in a shared store (S3) is read by other instances, possibly after it was copied,
truncated or altered by someone with write access to the bucket. Each object is

    MAGIC | HMAC-SHA256(key, MAGIC | session id | payload) | payload

where the key is derived from the store's location (bucket and prefix) and, when one is set,
the endpoint's secret (`session_store_secret`). So a torn or flipped object, one moved to
another session's key, one written under another endpoint's prefix, and (with a secret) one
forged by a bucket writer without the secret are all refused as `CorruptSnapshot`, costing
that one session only. The payload itself is the engine's snapshot (safetensors: data, never
code), which checks the model it was taken with.
"""

from __future__ import annotations

import hashlib
import hmac

from llava.sessions.snapshots import CorruptSnapshot

MAGIC = b"LLSS\x01"
_MAC = hashlib.sha256().digest_size


def store_key(location: str, secret: str = "") -> bytes:
    """Derive the sealing key of one store location (and the endpoint's secret, if any)."""
    material = f"llava-session-store/1\0{location.rstrip('/')}\0{secret}".encode()
    return hashlib.sha256(material).digest()


def object_name(key: bytes, sid: str) -> str:
    """Name `sid`'s object by a MAC of the id under the store's key: a listing of the store
    reveals no session id (an id is its conversation's bearer token)."""
    names = hmac.new(key, b"object-names", hashlib.sha256).digest()
    return hmac.new(names, sid.encode(), hashlib.sha256).hexdigest()[:40]


def seal(key: bytes, sid: str, payload: bytes) -> bytes:
    """Wrap a snapshot for the store, bound to `sid` and the key's store."""
    mac = hmac.new(key, MAGIC + sid.encode() + b"\0" + payload, hashlib.sha256).digest()
    return MAGIC + mac + payload


def unseal(key: bytes, sid: str, data: bytes) -> bytes:
    """Return the snapshot inside a sealed object, or raise `CorruptSnapshot`."""
    head = len(MAGIC) + _MAC
    if len(data) <= head or not data.startswith(MAGIC):
        raise CorruptSnapshot(f"the stored state of {sid} is not a sealed session snapshot")
    mac, payload = data[len(MAGIC) : head], data[head:]
    expected = hmac.new(key, MAGIC + sid.encode() + b"\0" + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise CorruptSnapshot(
            f"the stored state of {sid} is torn, altered, or sealed for another session, "
            "store prefix or secret"
        )
    return payload
