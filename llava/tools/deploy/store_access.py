"""Check, before deploying, that the execution role may use the shared session store, and print
the least policy that lets it when it may not.

A worker whose role cannot write the store still answers (its writes fail, counted, with a
warning), so a missing permission would only show when an instance goes away and its
conversations with it: IAM's policy simulator finds it at deploy time instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llava.tools.deploy.errors import DeployError
from llava.tools.deploy.names import parse_s3_uri
from llava.tools.deploy.store_secret import SECRET_ACTIONS, secret_arns

OBJECT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")
# Without it S3 answers 403, not 404, for an object that is not there: every unknown session
# id would read as "the store refuses us" instead of "no such session".
LIST_ACTIONS = ("s3:ListBucket",)
KEY_ACTIONS = ("kms:GenerateDataKey", "kms:Decrypt")


def key_arn(kms_key: str, role_arn: str, region: str) -> str:
    """A KMS key's ARN from an id or ARN (a bare id is in the role's account and the region)."""
    if kms_key.startswith("arn:"):
        return kms_key
    account = role_arn.split(":")[4]
    return f"arn:aws:kms:{region}:{account}:key/{kms_key}"


def least_policy(store_uri: str, kms_arn: str | None, secret_arn: str) -> dict[str, Any]:
    """The least policy the execution role needs for the store, its secret (and its key)."""
    bucket, prefix = parse_s3_uri(store_uri, require_prefix=False)
    statements: list[dict[str, Any]] = [
        {
            "Sid": "SessionStoreObjects",
            "Effect": "Allow",
            "Action": list(OBJECT_ACTIONS),
            "Resource": f"arn:aws:s3:::{bucket}/{prefix}*",
        },
        {
            "Sid": "SessionStoreMissingObjects",
            "Effect": "Allow",
            "Action": list(LIST_ACTIONS),
            "Resource": f"arn:aws:s3:::{bucket}",
            "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*"]}},
        },
        {
            "Sid": "SessionStoreSecret",
            "Effect": "Allow",
            "Action": list(SECRET_ACTIONS),
            "Resource": secret_arn,
        },
    ]
    if kms_arn:
        statements.append(
            {
                "Sid": "SessionStoreKey",
                "Effect": "Allow",
                "Action": list(KEY_ACTIONS),
                "Resource": kms_arn,
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


def check_store_access(
    iam: Any,
    role_arn: str,
    store_uri: str,
    *,
    endpoint: str,
    kms_key: str = "",
    region: str = "us-east-1",
    progress: Callable[[str], None] = print,
) -> None:
    """Simulate the role's policies on the store's objects, the endpoint's store secret (and
    key); raise `DeployError` with the least policy if any action is denied. A caller not
    allowed to simulate is told so."""
    bucket, prefix = parse_s3_uri(store_uri, require_prefix=False)
    kms_arn = key_arn(kms_key, role_arn, region) if kms_key else None
    secret_pattern, secret_example = secret_arns(endpoint, role_arn, region)
    checks: list[tuple[tuple[str, ...], str]] = [
        (OBJECT_ACTIONS, f"arn:aws:s3:::{bucket}/{prefix}llava-check.snap"),
        (LIST_ACTIONS, f"arn:aws:s3:::{bucket}"),
        (SECRET_ACTIONS, secret_example),
    ]
    if kms_arn:
        checks.append((KEY_ACTIONS, kms_arn))
    denied: list[str] = []
    try:
        for actions, resource in checks:
            out = iam.simulate_principal_policy(
                PolicySourceArn=role_arn, ActionNames=list(actions), ResourceArns=[resource]
            )
            denied += [
                r["EvalActionName"]
                for r in out.get("EvaluationResults", [])
                if r.get("EvalDecision") != "allowed"
            ]
    except Exception as exc:
        progress(
            f"warning: could not check the role's access to the session store ({exc}); "
            "make sure it has: " + json.dumps(least_policy(store_uri, kms_arn, secret_pattern))
        )
        return
    if denied:
        raise DeployError(
            f"the execution role {role_arn} may not {', '.join(denied)} in the session store "
            f"{store_uri}: its conversations would not outlive an instance. Attach this "
            "policy to the role (or drop --session-store):\n"
            + json.dumps(least_policy(store_uri, kms_arn, secret_pattern), indent=2)
        )
    progress(f"the execution role may use the session store {store_uri}")
