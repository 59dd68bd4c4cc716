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

from llava.tools.deploy.errors import DeployError
from llava.tools.deploy.names import parse_s3_uri

FRONTS_MODEL = {"torchserve": "model", "ray": "llava"}  # the name each image serves the model
# under (docker/torchserve/serve registers `model`), which names its sessions' folder
DAY_S = 86_400
MARGIN_S = DAY_S  # past the longest TTL: an answer in flight, clocks, S3's own daily sweep


def lifecycle_rule(store_uri: str, ttl_s: float, model: str = "llava") -> dict[str, Any]:
    """The rule that expires the model's session objects (`<prefix><model>/`, where the
    instances write them) `ttl_s` plus a margin after their last write, and their older
    versions on a versioned bucket."""
    _, prefix = parse_s3_uri(store_uri, require_prefix=True)
    sessions = f"{prefix}{model}/"
    name = hashlib.sha256(sessions.encode()).hexdigest()[:12]
    return {
        "ID": f"llava-sessions-{name}",
        "Filter": {"Prefix": sessions},
        "Status": "Enabled",
        "Expiration": {"Days": max(1, math.ceil((ttl_s + MARGIN_S) / DAY_S))},
        "NoncurrentVersionExpiration": {"NoncurrentDays": 1},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
    }


def check_apart(store_uri: str, other_uris: list[str], model: str = "llava") -> None:
    """Refuse a store whose session objects' prefix holds other data (the model's archive):
    the lifecycle rule would delete it."""
    bucket, _ = parse_s3_uri(store_uri, require_prefix=True)
    sessions = lifecycle_rule(store_uri, 0, model)["Filter"]["Prefix"]
    for uri in other_uris:
        other_bucket, other = parse_s3_uri(uri, require_prefix=False)
        if other_bucket == bucket and (other.startswith(sessions) or sessions.startswith(other)):
            raise DeployError(
                f"the session store's objects (s3://{bucket}/{sessions}) and {uri} overlap: "
                "the store's lifecycle rule would expire the other's objects; pick a "
                "--session-store prefix of its own"
            )


def ensure_lifecycle(
    s3: Any,
    store_uri: str,
    ttl_s: float,
    progress: Callable[[str], None] = print,
    model: str = "llava",
) -> dict[str, Any] | None:
    """Add (or update) the store's rule among the bucket's own; return it, or None where it
    could not be set (the caller is told the rule to set)."""
    bucket, _ = parse_s3_uri(store_uri, require_prefix=True)
    rule = lifecycle_rule(store_uri, ttl_s, model)
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
    where = f"s3://{bucket}/{rule['Filter']['Prefix']}"
    progress(f"session objects under {where} expire {days} days after their last write")
    return rule


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return str(error.get("Code", "")) if isinstance(error, dict) else ""
