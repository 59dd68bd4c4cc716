"""The kit's error tree: every failure a user can cause has an HTTP status and a stable code.

    KitError (500 internal_error)
    ├── InvalidRequest (400 invalid_request)
    │   ├── PayloadTooLarge (413 payload_too_large)
    │   └── ContextLengthExceeded (400 context_length_exceeded)
    ├── ImageError (400 invalid_image)
    │   ├── ImageFetchError (400 image_fetch_failed)
    │   ├── ImageForbidden (400 image_url_forbidden)
    │   └── ImageTooLarge (413 image_too_large)
    ├── SessionError (400 session_error)
    │   ├── SessionNotFound (400 session_not_found)
    │   ├── SessionExpired (400 session_expired)
    │   ├── SessionClosed (400 session_closed)
    │   ├── SessionLost (400 session_lost)
    │   └── SessionBusy (409 session_busy)
    ├── CapacityExceeded (429 capacity_exceeded)
    ├── Draining (503 draining)
    ├── StoreUnavailable (503 store_unavailable)
    └── Cancelled (499 cancelled)

The handler answers each request with `error.to_body()` and `error.status`; anything that is
not a `KitError` is logged with its traceback and answered 500 without one.
"""

from __future__ import annotations

from typing import Any


class KitError(Exception):
    """Base of every error the kit answers to a client."""

    status: int = 500
    code: str = "internal_error"
    # Kinds a client should retry say how soon: `retry_after_s` (a detail, and Retry-After).
    retry_after_default: int | None = None

    def __init__(self, message: str, *, field: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if self.retry_after_default is not None:
            details = {"retry_after_s": self.retry_after_default, **details}
        self.details = details
        self.retry_after_s: int | None = details.get("retry_after_s")

    def to_body(self) -> dict[str, Any]:
        """Render the JSON error body `{"error": {"code", "message", ...}}`."""
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        error.update(self.details)
        return {"error": error}


class InvalidRequest(KitError):
    status, code = 400, "invalid_request"


class PayloadTooLarge(InvalidRequest):
    status, code = 413, "payload_too_large"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"  # OpenAI's code for the same condition


class ImageError(KitError):
    status, code = 400, "invalid_image"


class ImageFetchError(ImageError):
    code = "image_fetch_failed"


class ImageForbidden(ImageError):
    code = "image_url_forbidden"


class ImageTooLarge(ImageError):
    status, code = 413, "image_too_large"


class UnknownImageHandle(ImageError):
    """A picture named by its uuid alone that this instance does not hold for this chat."""

    code = "unknown_image_handle"


SEND_PICTURE_AGAIN = (
    "send the picture again with its bytes (an image_url with its url) and its uuid"
)


class SessionError(KitError):
    status, code = 400, "session_error"


class SessionNotFound(SessionError):
    code = "session_not_found"


class SessionExpired(SessionError):
    code = "session_expired"


class SessionClosed(SessionError):
    code = "session_closed"


class SessionLost(SessionError):
    code = "session_lost"


class SessionBusy(SessionError):
    status, code = 409, "session_busy"


class CapacityExceeded(KitError):
    """No room for another session; the client should retry later."""

    status, code = 429, "capacity_exceeded"
    retry_after_default = 5


class OutOfDeviceMemory(KitError):
    """The device ran out of memory for this request even after freeing what it could."""

    status, code = 503, "out_of_device_memory"
    retry_after_default = 2


class Draining(KitError):
    """The instance is shutting down (scale-in, an update): it takes no new sessions."""

    status, code = 503, "draining"
    retry_after_default = 1


class StoreUnavailable(KitError):
    """The shared session store could not be read (down, or too busy): retry shortly."""

    status, code = 503, "store_unavailable"
    retry_after_default = 2


class EngineRestarting(KitError):
    """The model's engine failed and is starting again; sessions are kept: retry shortly."""

    status, code = 503, "engine_restarting"
    retry_after_default = 10


class EngineFailed(KitError):
    """The model's engine ended this answer itself (it aborted or failed the request); the
    session stays at its last finished turn: retry."""

    status, code = 503, "engine_failed"
    retry_after_default = 1


class Cancelled(KitError):
    """The client went away or the session closed while an answer was being generated."""

    status, code = 499, "cancelled"


def from_body(status: int, body: Any) -> KitError:
    """Rebuild the typed error from an HTTP status and a JSON error body (used by the client)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return KitError(f"HTTP {status}: {str(body)[:500]}")
    code = str(error.get("code", ""))
    message = str(error.get("message", f"HTTP {status}"))
    cls = _BY_CODE.get(code, KitError)
    details = {k: v for k, v in error.items() if k not in {"code", "message", "field"}}
    if cls is CapacityExceeded:
        return CapacityExceeded(message, **details)
    err = cls(message, field=error.get("field"), **details)
    if cls is KitError:
        err.status, err.code = status, code or err.code
    return err


def _subclasses(cls: type[KitError]) -> list[type[KitError]]:
    return [cls] + [s for c in cls.__subclasses__() for s in _subclasses(c)]


_BY_CODE: dict[str, type[KitError]] = {c.code: c for c in _subclasses(KitError)}
