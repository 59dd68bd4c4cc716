"""Session ids: made unguessable, checked against SageMaker's pattern (also safe as file names)."""

from __future__ import annotations

import re
import secrets

SESSION_ID_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")

SESSION_ID_MAX_LEN = 256


def is_valid_session_id(sid: str) -> bool:
    """Tell whether `sid` matches SageMaker's session id pattern."""
    return len(sid) <= SESSION_ID_MAX_LEN and SESSION_ID_RE.fullmatch(sid) is not None


def new_session_id(prefix: str = "") -> str:
    """Make an unguessable id (160 random bits) that fits SageMaker's session id pattern;
    `prefix` (letters and digits) starts it, before a hyphen, to say where the session lives."""
    token = secrets.token_hex(20)
    return f"{prefix}-{token}" if prefix else token


def id_prefix(sid: str) -> str | None:
    """Return what a prefixed session id says about where it lives, or None if it has none."""
    head, hyphen, _ = sid.partition("-")
    return head if hyphen else None
