"""boto3 plumbing: client creation, missing-resource errors, describe-or-None, pagination."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def aws_client(service: str, client: Any, region: str | None = None) -> Any:
    if client is not None:
        return client
    import boto3

    return boto3.client(service, region_name=region) if region else boto3.client(service)


def _error_code(err: Exception) -> str:
    return getattr(err, "response", {}).get("Error", {}).get("Code", "")


def is_missing(err: Exception) -> bool:
    """SageMaker answers a missing resource with ValidationException 'Could not find ...'."""
    from botocore.exceptions import ClientError

    if not isinstance(err, ClientError):
        return False
    code = _error_code(err)
    message = str(err.response.get("Error", {}).get("Message", "")).lower()
    if code in ("ResourceNotFound", "ResourceNotFoundException", "RepositoryNotFoundException"):
        return True
    return code == "ValidationException" and (
        "could not find" in message or "does not exist" in message
    )


def describe_or_none(call: Callable[..., dict[str, Any]], **params: Any) -> dict[str, Any] | None:
    try:
        return call(**params)
    except Exception as exc:
        if is_missing(exc):
            return None
        raise


def paginate(sm: Any, operation: str, key: str, **params: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for page in sm.get_paginator(operation).paginate(**params):
        items.extend(page.get(key, []))
    return items
