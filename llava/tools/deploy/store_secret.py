"""The shared store's secret in Secrets Manager: made at deploy, read by each instance at start
through its role (LLAVA_SESSION_STORE_SECRET_ID), deleted with the endpoint.

The store refuses to run without a secret (`llava.sessions.secret`): it keys the seal and the
object names, so without it anyone who may write the bucket could plant a conversation.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from llava.tools.deploy.aws import is_missing

SECRET_ACTIONS = ("secretsmanager:GetSecretValue",)


def secret_name(endpoint: str) -> str:
    """The name of an endpoint's store secret."""
    return f"llava/{endpoint}/session-store"


def secret_arns(endpoint: str, role_arn: str, region: str) -> tuple[str, str]:
    """The ARN pattern the least policy grants (Secrets Manager appends six random characters
    to a secret's name), and one concrete ARN of it for IAM's policy simulator."""
    partition, account = role_arn.split(":")[1], role_arn.split(":")[4]
    base = f"arn:{partition}:secretsmanager:{region}:{account}:secret:{secret_name(endpoint)}"
    return f"{base}-??????", f"{base}-AbCdEf"


def ensure_store_secret(client: Any, endpoint: str, progress: Callable[[str], None] = print) -> str:
    """Make the endpoint's store secret (256 random bits), or keep the one an earlier deploy
    made (sessions sealed with it stay readable across an update; one scheduled for deletion
    is restored); return its ARN."""
    name = secret_name(endpoint)
    try:
        found = client.describe_secret(SecretId=name)
    except Exception as exc:
        if not is_missing(exc):
            raise
    else:
        if found.get("DeletedDate"):
            client.restore_secret(SecretId=name)
        progress(f"the session store keeps its secret {name}")
        return str(found["ARN"])
    made = client.create_secret(
        Name=name,
        SecretString=secrets.token_urlsafe(32),
        Description=f"seals the shared session store of the SageMaker endpoint {endpoint}",
        Tags=[{"Key": "llava:endpoint", "Value": endpoint}],
    )
    progress(f"made the session store's secret {name} in Secrets Manager")
    return str(made["ARN"])


def delete_store_secret(client: Any, endpoint: str) -> bool:
    """Delete the endpoint's store secret at once (its sessions go with the endpoint); False
    if there was none."""
    name = secret_name(endpoint)
    try:  # a forced delete succeeds with no secret at all: ask first
        client.describe_secret(SecretId=name)
    except Exception as exc:
        if not is_missing(exc):
            raise
        return False
    client.delete_secret(SecretId=name, ForceDeleteWithoutRecovery=True)
    return True
