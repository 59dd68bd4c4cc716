"""AWS's event-stream framing, as a response stream is sent and botocore reads it."""

from __future__ import annotations

import json
import struct
from binascii import crc32
from collections.abc import Mapping
from typing import Any


def encode_event(headers: Mapping[str, str | bytes | bool | int], payload: bytes) -> bytes:
    """Encode one AWS event-stream message (what botocore's `EventStreamBuffer` decodes).

    Layout: prelude (total length, headers length: big-endian uint32 each; CRC32 of those 8
    bytes), headers (name length byte, name, type byte, value), payload, CRC32 of everything.
    """
    encoded = b"".join(_encode_header(name, value) for name, value in headers.items())
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack("!II", total, len(encoded))
    message = prelude + struct.pack("!I", crc32(prelude) & 0xFFFFFFFF) + encoded + payload
    return message + struct.pack("!I", crc32(message) & 0xFFFFFFFF)


def _encode_header(name: str, value: str | bytes | bool | int) -> bytes:
    raw_name = name.encode()
    if len(raw_name) > 255:
        raise ValueError(f"header name too long: {name!r}")
    out = struct.pack("!B", len(raw_name)) + raw_name
    if isinstance(value, bool):
        return out + struct.pack("!B", 0 if value else 1)  # 0 = true, 1 = false
    if isinstance(value, int):
        return out + struct.pack("!Bq", 5, value)  # int64
    if isinstance(value, bytes):
        return out + struct.pack("!BH", 6, len(value)) + value
    data = value.encode()
    return out + struct.pack("!BH", 7, len(data)) + data


def payload_part(data: bytes) -> bytes:
    """A `PayloadPart` event: its payload is the `Bytes` blob (the member is `eventpayload`)."""
    return encode_event(
        {
            ":event-type": "PayloadPart",
            ":content-type": "application/octet-stream",
            ":message-type": "event",
        },
        data,
    )


def exception_event(exception_type: str, message: str, **fields: Any) -> bytes:
    """A modeled exception event (`ModelStreamError`, `InternalStreamFailure`)."""
    body = json.dumps({"Message": message, **fields}).encode()
    return encode_event(
        {
            ":exception-type": exception_type,
            ":content-type": "application/json",
            ":message-type": "exception",
        },
        body,
    )
