"""Turn a request body into a JSON object, whatever TorchServe or a front passes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llava.api.headers import (
    JSON_CONTENT_TYPE,
    header,
)
from llava.core.errors import InvalidRequest, PayloadTooLarge
from llava.core.params import Limits


def decode_body(body: Any, headers: Mapping[str, Any], limits: Limits) -> dict[str, Any]:
    """Return the body as a JSON object, whatever the Content-Type (which is not checked).

    The handler asks TorchServe's worker for raw bytes (`TS_DECODE_INPUT_REQUEST=false`), so
    bytes arrive. A worker that decodes anyway passes `application/json` as a dict, list, number
    or string and `text/*` as a string; those are taken too.
    """
    if isinstance(body, dict):
        # Decoded by TorchServe, whose own limit (max_request_size) is above ours: check the
        # length the client declared.
        declared = header(headers, "Content-Length")
        if declared is not None and declared.strip().isdigit():
            check_size(int(declared), limits)
        return body
    if body is not None and not isinstance(body, (str, bytes, bytearray)):
        raise InvalidRequest("body must be a JSON object", field="body")  # TorchServe decoded it
    if isinstance(body, str) and media_type(headers) == JSON_CONTENT_TYPE:
        # A JSON string that TorchServe already decoded: do not decode its content again.
        raise InvalidRequest("body must be a JSON object", field="body")
    if isinstance(body, str):
        body = body.encode()
    if not isinstance(body, (bytes, bytearray)) or not body:
        raise InvalidRequest('empty body: send a JSON object with a "type"', field="body")
    check_size(len(body), limits)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # incl. ints over Python's 4300-digit limit
        raise InvalidRequest(f"body is not valid JSON: {str(exc)[:200]}", field="body") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("body must be a JSON object", field="body")
    return obj


def check_size(size: int, limits: Limits) -> None:
    if size > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"body is {size} bytes, the limit is {limits.max_body_bytes}: "
            "send large images by https or s3:// URL instead of inline base64",
            field="body",
        )


def media_type(headers: Mapping[str, Any]) -> str:
    value = header(headers, "Content-Type") or ""
    return value.split(";", 1)[0].strip().lower()
