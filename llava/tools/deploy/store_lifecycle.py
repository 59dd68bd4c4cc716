"""Set the session store's lifecycle rule at deploy time: objects no instance deletes (an
instance lost before a session's expiry, a delete that failed) go on their own.

Every finished turn rewrites a session's object and an idle session ends after its TTL, so an
object not written for the TTL plus a day belongs to no live session. S3 counts expiry in whole
days from an object's last write. A rule the caller may not set is printed, to set by hand.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

from llava.tools.deploy.names import parse_s3_uri

DAY_S = 86_400
MARGIN_S = DAY_S  # past the longest TTL: an answer in flight, clocks, S3's own daily sweep


def lifecycle_rule(store_uri: str, ttl_s: float) -> dict[str, Any]:
    """The rule that expires the store's objects `ttl_s` plus a margin after their last write."""
    _, prefix = parse_s3_uri(store_uri, require_prefix=True)
    name = hashlib.sha256(prefix.encode()).hexdigest()[:12]
    return {
        "ID": f"llava-sessions-{name}",
        "Filter": {"Prefix": prefix},
        "Status": "Enabled",
        "Expiration": {"Days": max(1, math.ceil((ttl_s + MARGIN_S) / DAY_S))},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
    }


def ensure_lifecycle(
    s3: Any, store_uri: str, ttl_s: float, progress: Callable[[str], None] = print
) -> dict[str, Any] | None:
    """Add (or update) the store's rule among the bucket's own; return it, or None where it
    could not be set (the caller is told the rule to set)."""
    bucket, _ = parse_s3_uri(store_uri, require_prefix=True)
    rule = lifecycle_rule(store_uri, ttl_s)
    try:
        try:
            rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
        except Exception as exc:
            if _code(exc) != "NoSuchLifecycleConfiguration":
                raise
            rules = []
        kept = [r for r in rules if r.get("ID") != rule["ID"]]
        s3.put_bucket_lifecycle_configuration(
            Bucket=bucket, LifecycleConfiguration={"Rules": [*kept, rule]}
        )
    except Exception as exc:
        progress(
            f"warning: could not set the session store's lifecycle rule on {bucket} ({exc}); "
            "objects of sessions no instance deleted will stay until removed. Add this rule: "
            + json.dumps(rule)
        )
        return None
    days = rule["Expiration"]["Days"]
    progress(f"session objects under {store_uri} expire {days} days after their last write")
    return rule


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return str(error.get("Code", "")) if isinstance(error, dict) else ""
