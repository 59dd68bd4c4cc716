"""Where a shared session store keeps its objects: S3 or any S3-compatible API, by boto3.

One small interface (`ObjectStore`) between the store's queue and the bytes' home, so the queue
is tested against a real S3 API server and nothing in it knows boto3's shapes. Every write is
conditional (S3's `If-Match` / `If-None-Match: *` on PutObject, `If-Match` on DeleteObject),
which is what fences a stale holder out (`shared.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

_URI = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?")


class Refused(Exception):
    """A conditional write or delete was refused: the object is not the one it named."""


class ObjectStore(Protocol):
    """Put, get, look up and delete whole objects by key; writes conditional on ETags."""

    def put(self, key: str, data: bytes, *, if_match: str | None, always: bool = False) -> str:
        """Write an object only if it is still `if_match` (an ETag), or, if None, only if
        there is none (or, `always`, whatever is there); return its ETag, or raise `Refused`."""
        ...

    def get(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        """Return an object's bytes and ETag, None if there is none; ValueError past
        `max_bytes`."""
        ...

    def etag(self, key: str) -> str | None:
        """Return an object's ETag, None if there is none."""
        ...

    def delete(self, key: str, *, if_match: str) -> None:
        """Delete an object only if it is still `if_match` (no error if there is none);
        raise `Refused` if it changed."""
        ...


@dataclass(frozen=True)
class StoreLocation:
    """A bucket and a key prefix, parsed from `s3://bucket/prefix`."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> StoreLocation:
        """Parse `s3://bucket[/prefix]`, or say what a valid one looks like."""
        match = _URI.fullmatch(uri.strip())
        if match is None:
            raise ValueError(
                f"session_store {uri!r} is not an S3 location: use s3://bucket/prefix "
                '(or "" to keep sessions on the instance only)'
            )
        return cls(match.group(1), (match.group(2) or "").strip("/"))

    def under(self, name: str) -> StoreLocation:
        """Return the location of one model's sessions below this one."""
        return StoreLocation(self.bucket, f"{self.prefix}/{name}".strip("/"))

    def key(self, sid: str) -> str:
        return f"{self.prefix}/{sid}.snap" if self.prefix else f"{sid}.snap"

    def part_key(self, name: str) -> str:
        """The key of a part stored once by content (a picture, or its features)."""
        return f"{self.prefix}/parts/{name}" if self.prefix else f"parts/{name}"

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


class S3Objects:
    """An `ObjectStore` over one bucket, with optional SSE-KMS for every object written."""

    def __init__(self, client: Any, bucket: str, kms_key_id: str = "") -> None:
        self.client = client
        self.bucket = bucket
        self.kms_key_id = kms_key_id

    @classmethod
    def connect(
        cls, bucket: str, *, endpoint_url: str = "", kms_key_id: str = "", timeout_s: float = 10
    ) -> S3Objects:
        """Build a boto3 client (the instance role's credentials, or the environment's)."""
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=timeout_s,
            read_timeout=timeout_s * 3,
            retries={"max_attempts": 3, "mode": "standard"},
        )
        client = boto3.client("s3", endpoint_url=endpoint_url or None, config=config)
        return cls(client, bucket, kms_key_id)

    def put(self, key: str, data: bytes, *, if_match: str | None, always: bool = False) -> str:
        extra: dict[str, str] = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}
        if always:
            extra = {}
        if self.kms_key_id:
            extra.update(ServerSideEncryption="aws:kms", SSEKMSKeyId=self.kms_key_id)
        try:
            out = self.client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=data,
                ContentType="application/octet-stream",
                **extra,
            )
        except Exception as exc:
            if _refused(exc) or (if_match and _missing(exc)):
                raise Refused(f"{key} is not the object this write expected") from None
            raise
        return str(out.get("ETag", ""))

    def get(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        try:
            out = self.client.get_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            if _missing(exc):
                return None
            raise
        body = out["Body"]
        try:
            if int(out.get("ContentLength") or 0) > max_bytes:
                raise ValueError(f"{key} is over {max_bytes} bytes")
            data = body.read(max_bytes + 1)
        finally:
            body.close()
        if len(data) > max_bytes:
            raise ValueError(f"{key} is over {max_bytes} bytes")
        return bytes(data), str(out.get("ETag", ""))

    def etag(self, key: str) -> str | None:
        try:
            out = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            if _missing(exc):
                return None
            raise
        return str(out.get("ETag", ""))

    def delete(self, key: str, *, if_match: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=if_match)
        except Exception as exc:
            if _refused(exc):
                raise Refused(f"{key} is not the object this deletion expected") from None
            if not _missing(exc):
                raise


def _code(exc: Exception) -> str:
    """The error code of a botocore error ("" for any other)."""
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return str(error.get("Code", "")) if isinstance(error, dict) else ""


def _missing(exc: Exception) -> bool:
    """Whether a botocore error says the object is not there."""
    return _code(exc) in ("NoSuchKey", "404", "NotFound")


def _refused(exc: Exception) -> bool:
    """Whether a botocore error says a condition failed (412), or a concurrent conditional
    write won (409, which S3 asks to retry: the retry reads the winner)."""
    return _code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
