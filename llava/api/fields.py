"""Field validators shared by the dialects: each names the field it refuses and why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llava.core.errors import InvalidRequest


def check_fields(obj: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(obj) - allowed - {"type", "session_id"})
    if unknown:
        raise InvalidRequest(
            f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}",
            field=unknown[0],
        )


def text_field(obj: Mapping[str, Any], name: str, max_chars: int, *, required: bool) -> str | None:
    value = obj.get(name)
    if value is None:
        if required:
            raise InvalidRequest(f'missing "{name}"', field=name)
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f'"{name}" must be a string', field=name)
    if required and not value.strip():
        raise InvalidRequest(f'"{name}" is empty', field=name)
    if len(value) > max_chars:
        raise InvalidRequest(f'"{name}" is longer than {max_chars} characters', field=name)
    return value


def required_text(obj: Mapping[str, Any], name: str, max_chars: int) -> str:
    value = text_field(obj, name, max_chars, required=True)
    assert value is not None  # required: text_field raised otherwise
    return value


def number_field(
    obj: Mapping[str, Any], name: str, default: float, lo: float, hi: float, *, integer: bool
) -> Any:
    value = obj.get(name, default)
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise InvalidRequest(f'"{name}" must be {kind}', field=name)
    if not lo <= value <= hi or value != value:
        raise InvalidRequest(f'"{name}" must be between {lo} and {hi}', field=name)
    return value


def flag_field(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f'"{name}" must be true or false', field=name)
    return value
