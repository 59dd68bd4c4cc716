"""SageMaker resource names (validation, `<name>-<stamp>` names) and S3 URI parsing."""

from __future__ import annotations

import re

NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
STAMP_RE = r"\d{8}-\d{6}"
STAMP_LEN = 15  # yyyymmdd-HHMMSS
MAX_NAME = 63


def validate_name(name: str, what: str = "endpoint name") -> str:
    """Return `name` if SageMaker accepts it (^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}), else raise."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        hint = ""
        if isinstance(name, str):
            bad = sorted(set(re.findall(r"[^a-zA-Z0-9-]", name)))
            if not name:
                hint = " (it is empty)"
            elif bad:
                hint = f" (it contains {''.join(bad)!r}; only letters, digits and hyphens)"
            elif len(name) > MAX_NAME:
                hint = f" (it has {len(name)} characters; at most {MAX_NAME})"
            else:
                hint = " (it must start and end with a letter or digit)"
        suggestion = re.sub(r"[^a-zA-Z0-9]+", "-", str(name)).strip("-")[:MAX_NAME].strip("-")
        raise ValueError(
            f"invalid SageMaker {what} {name!r}{hint}: use 1-63 letters, digits and hyphens, "
            f"starting and ending with a letter or digit"
            + (f", e.g. {suggestion!r}" if suggestion and suggestion != name else "")
        )
    return name


def base_name(name: str) -> str:
    return name[: MAX_NAME - STAMP_LEN - 1].rstrip("-")


def resource_name(name: str, stamp: str) -> str:
    """`<name>-<stamp>`, with `name` shortened so that the result fits 63 characters."""
    return validate_name(f"{base_name(name)}-{stamp}", "resource name")


def stamp_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(base_name(name))}-{STAMP_RE}")


def parse_s3_uri(uri: str, *, require_prefix: bool = True) -> tuple[str, str]:
    """Split `s3://bucket/some/prefix` into (bucket, "some/prefix/")."""
    match = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", uri or "")
    if not match:
        raise ValueError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix/)")
    bucket, prefix = match.group(1), (match.group(2) or "").strip("/")
    if require_prefix and not prefix:
        raise ValueError(
            f"{uri!r} names a whole bucket: give a prefix, e.g. s3://{bucket}/llava-sessions/llava/"
        )
    return bucket, f"{prefix}/" if prefix else ""
