"""Fetch s3://bucket/key images through a lazily imported boto3 client, within limits."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from llava.core.errors import ImageError, ImageFetchError, ImageForbidden, InvalidRequest, KitError
from llava.images.limits import READ_CHUNK, read_limited, too_many_bytes
from llava.images.policy import ImagePolicy
from llava.images.refs import INLINE_HINT, clean_text, describe_ref

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def default_s3_client(policy: ImagePolicy) -> Any:
    """Build a boto3 S3 client with the policy's timeouts."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ImageError(
            "s3:// image references need boto3 on the server (pip install "
            f"'llava-sessions[aws]'); or {INLINE_HINT}"
        ) from None
    config = Config(
        connect_timeout=policy.connect_timeout_s,
        read_timeout=policy.read_timeout_s,
        retries={"max_attempts": 2},
    )
    return boto3.client("s3", config=config)


def _s3_error_code(exc: Exception) -> str:
    """Pull the S3 error code (NoSuchKey, AccessDenied, ...) out of a botocore error."""
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    if isinstance(error, dict) and error.get("Code"):
        return clean_text(str(error["Code"]), 40)
    return type(exc).__name__


class S3Fetch:
    """ImageLoader's s3:// half: one shared client, the byte limit enforced while reading."""

    policy: ImagePolicy
    _lock: threading.Lock
    _s3_client: Any
    _s3_factory: Callable[[], Any]

    def _s3(self) -> Any:
        """Return the S3 client, creating it once (boto3 clients are thread-safe)."""
        with self._lock:
            if self._s3_client is None:
                self._s3_client = self._s3_factory()
            return self._s3_client

    def _fetch_s3(self, text: str) -> bytes:
        """Download an s3://bucket/key object within the byte limit."""
        where = describe_ref(text)
        bucket, _, key = text[5:].partition("/")
        if not _BUCKET.fullmatch(bucket) or not key:
            raise InvalidRequest(
                f"malformed S3 reference {where}; write it as s3://bucket/path/to/image.png"
            )
        if not self.policy.allow_s3:
            raise ImageForbidden(
                "s3:// image references are off on this endpoint (set image_s3_allow to the "
                f"buckets it may read); {INLINE_HINT}"
            )
        if not self.policy.s3_allowed(bucket, key):
            raise ImageForbidden(f"{where} is not under the buckets this endpoint may read")
        deadline = time.monotonic() + self.policy.total_timeout_s
        try:
            body = self._s3().get_object(Bucket=bucket, Key=key)
        except KitError:
            raise
        except Exception:  # noqa: BLE001 - boto3 raises its own tree
            # One answer whatever S3 said: telling NoSuchKey from AccessDenied would let a
            # caller learn which objects exist where the endpoint's role reaches.
            raise ImageFetchError(
                f"could not read {where}: it does not exist or this endpoint may not read it",
            ) from None
        stream = body.get("Body") if isinstance(body, dict) else None
        if stream is None:
            raise ImageFetchError(f"S3 returned no body for {where}")
        try:
            declared = body.get("ContentLength")
            if isinstance(declared, int) and declared > self.policy.max_bytes:
                raise too_many_bytes(f"image at {where}", self.policy.max_bytes)
            return read_limited(
                self._s3_chunks(stream), self.policy.max_bytes, deadline, f"image at {where}"
            )
        except KitError:
            raise
        except Exception as exc:  # noqa: BLE001 - connection errors mid-body, any flavour
            raise ImageFetchError(
                f"reading {where} failed midway ({_s3_error_code(exc)}); try again"
            ) from None
        finally:
            close = getattr(stream, "close", None)
            if callable(close):
                close()

    def _s3_chunks(self, stream: Any) -> Iterable[bytes]:
        """Yield body chunks, never asking for more than one byte past the limit."""
        remaining = self.policy.max_bytes + 1
        while remaining > 0:
            chunk = stream.read(min(READ_CHUNK, remaining))
            if not chunk:
                return
            remaining -= len(chunk)
            yield chunk
