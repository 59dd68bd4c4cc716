"""Split a session's snapshot into its large arrays, stored once by content, and the rest.

A snapshot is a safetensors file: a JSON header, then each array's bytes. Its large arrays are
a session's pictures (vLLM: their PNGs) or their features (transformers: 4.7 MB per picture
for a 7B); they never change after the picture is added, while the conversation around them
changes every turn. So the shared store (and the local snapshot directory) writes each large
array once, as an object named by
its content (SHA-256), and each turn writes only the *skeleton*: the snapshot with those byte
ranges cut out and a list of where they go. Reading joins them back and checks every part
against its digest, so a swapped or damaged part is refused like a damaged snapshot.

Anything that is not a safetensors file is kept whole (a skeleton with no parts); a snapshot
written before parts existed reads as itself.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass

PART_MIN_BYTES = 64 * 1024  # arrays at least this large are stored once, by content
_MAGIC = b"LLSK\x01"
_LENGTH = struct.Struct("<I")
_HEADER_LENGTH = struct.Struct("<Q")


class CorruptSnapshot(ValueError):
    """A snapshot (or a part of one) that is torn, altered or not one of ours."""


@dataclass(frozen=True)
class Split:
    """A snapshot's skeleton and its parts (digest -> bytes)."""

    skeleton: bytes
    parts: dict[str, bytes]


def split(data: bytes, min_bytes: int = PART_MIN_BYTES) -> Split:
    """Cut the arrays of at least `min_bytes` out of a safetensors snapshot."""
    ranges = [(a, b) for a, b in _array_ranges(data) if b - a >= min_bytes]
    refs: list[list[int | str]] = []
    parts: dict[str, bytes] = {}
    kept: list[bytes] = []
    at = 0
    for start, end in ranges:
        part = data[start:end]
        digest = hashlib.sha256(part).hexdigest()
        parts[digest] = part
        refs.append([start, end - start, digest])
        kept.append(data[at:start])
        at = end
    kept.append(data[at:])
    index = json.dumps(refs, separators=(",", ":")).encode()
    return Split(_MAGIC + _LENGTH.pack(len(index)) + index + b"".join(kept), parts)


def digests(skeleton: bytes) -> list[str]:
    """The digests of the parts a skeleton refers to."""
    return [str(ref[2]) for ref in _index(skeleton)[0]]


def join(skeleton: bytes, part: Callable[[str], bytes]) -> bytes:
    """Rebuild a snapshot from its skeleton and its parts (`part(digest)`); raise
    `CorruptSnapshot` if a part is not the bytes its digest names."""
    refs, body = _index(skeleton)
    out: list[bytes] = []
    at = 0  # in the snapshot
    taken = 0  # in the skeleton's body
    for ref in refs:
        start, length, digest = int(ref[0]), int(ref[1]), str(ref[2])
        chunk = part(digest)
        if len(chunk) != length or hashlib.sha256(chunk).hexdigest() != digest:
            raise CorruptSnapshot(f"a stored part of the session ({digest[:12]}) is damaged")
        gap = start - at
        if gap < 0 or taken + gap > len(body):
            raise CorruptSnapshot("the stored session's index of parts is damaged")
        out.append(body[taken : taken + gap])
        out.append(chunk)
        taken += gap
        at = start + length
    out.append(body[taken:])
    return b"".join(out)


def _index(skeleton: bytes) -> tuple[list[list[int | str]], bytes]:
    if not skeleton.startswith(_MAGIC):
        return [], skeleton  # written whole (before parts): a snapshot the engine checks
    head = len(_MAGIC) + _LENGTH.size
    try:
        (size,) = _LENGTH.unpack_from(skeleton, len(_MAGIC))
        refs = json.loads(skeleton[head : head + size])
        ok = isinstance(refs, list) and all(
            isinstance(r, list)
            and len(r) == 3
            and isinstance(r[0], int)
            and isinstance(r[1], int)
            and isinstance(r[2], str)
            for r in refs
        )
    except (struct.error, ValueError):
        ok = False
    if not ok:
        raise CorruptSnapshot("the stored session's index of parts is damaged")
    return refs, skeleton[head + size :]


def _array_ranges(data: bytes) -> list[tuple[int, int]]:
    """The byte ranges of a safetensors file's arrays, in order (none if it is not one)."""
    if len(data) < _HEADER_LENGTH.size:
        return []
    (size,) = _HEADER_LENGTH.unpack_from(data)
    base = _HEADER_LENGTH.size + size
    if size > len(data) - _HEADER_LENGTH.size:
        return []
    try:
        header = json.loads(data[_HEADER_LENGTH.size : base])
        ranges = sorted(
            (base + int(v["data_offsets"][0]), base + int(v["data_offsets"][1]))
            for k, v in header.items()
            if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    bounded = all(base <= a <= b <= len(data) for a, b in ranges)
    disjoint = all(b <= c for (_, b), (c, _) in zip(ranges, ranges[1:], strict=False))
    return ranges if bounded and disjoint else []
