"""Client-side errors (TransportError, EndpointError) and mapping answers to typed errors."""

from __future__ import annotations

import json
from typing import Any

from llava.api.headers import header
from llava.client.response import Response
from llava.core.errors import CapacityExceeded, KitError, from_body


class TransportError(KitError):
    """No usable answer came back: the connection failed, timed out, or the stream broke.

    `original` is the underlying exception (httpx, botocore), `response` what came back if any.
    """

    status, code = 502, "transport_error"

    def __init__(
        self,
        message: str,
        *,
        original: BaseException | None = None,
        response: Response | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message, **details)
        self.original = original
        self.response = response


class EndpointError(TransportError):
    """The endpoint itself refused the request before (or instead of) the model answering.

    On SageMaker: `ValidationError` (400, e.g. an unknown session id or endpoint),
    `ModelNotReadyException` (429), `ServiceUnavailable` (503), `InternalFailure` (500),
    `ModelStreamError` / `InternalStreamFailure` in a stream. `error_code` is that name and
    `status` the HTTP status of the refusal.
    """

    code = "endpoint_error"

    def __init__(
        self,
        message: str,
        *,
        error_code: str = "",
        status: int | None = None,
        original: BaseException | None = None,
        response: Response | None = None,
    ) -> None:
        super().__init__(message, original=original, response=response)
        self.error_code = error_code
        if status is not None:
            self.status = status


class ErrorResponse(Exception):
    """Raised by `Transport.invoke_stream` when the answer is an error status, not a stream.

    The client turns `response` into the typed error, as it does for `invoke`.
    """

    def __init__(self, response: Response) -> None:
        super().__init__(f"HTTP {response.status}")
        self.response = response


def error_for(response: Response) -> KitError:
    """Rebuild the kit's typed error from an error response (status and JSON body)."""
    try:
        body: Any = json.loads(response.body) if response.body else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = response.body.decode("utf-8", "replace")
    err = from_body(response.status, body)
    if type(err) is KitError:
        err.status = response.status
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, CapacityExceeded) and "retry_after_s" not in (error or {}):
        retry = header(response.headers, "Retry-After")
        if retry and retry.isdigit():
            err.retry_after_s = err.details["retry_after_s"] = int(retry)
    err.response = response  # type: ignore[attr-defined]
    return err
